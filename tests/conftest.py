"""Shared fixtures: real assets from ../shared/assets and tiny random-weight HF checkpoints of the real
architectures (built once per session in a temp dir, with real tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU the Triton kernel tests run in Triton's interpreter, which must be switched on before anything
# imports triton (see tests/kernels/conftest.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("HAYABUSA_ASSETS", REPO.parent / "shared" / "assets"))
STORIES = ASSETS / "models" / "stories260K"
STORIES_QWEN2 = ASSETS / "models" / "stories260K-qwen2"
TOKENIZERS = ASSETS / "tokenizers"

EN_PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1905, Albert Einstein published",
]
JA_PROMPTS = [
    "吾輩は猫である。名前はまだ無い。",
    "東京は日本の首都で、",
    "今日はいい天気ですね。",
]
# a prompt of ~30 tokens: longer than the small windows / blocks of the architecture tests
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog while five boxing wizards jump quickly, "
               "and a journey of a thousand miles begins with a single step.")


def require_asset(path: Path) -> Path:
    """The asset at `path`, or skip the test saying where assets are expected."""
    if not Path(path).exists():
        pytest.skip(f"asset not found at {path}; set HAYABUSA_ASSETS=/path/to/shared/assets")
    return Path(path)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _speculation_without_the_measured_rule(request, monkeypatch):
    """Speculative decoding's measured turn-off rule (``disable_by_payoff``, on by default) decides from wall-clock
    step times, so on a loaded CPU it may turn speculation off in any test that counts proposals or acceptance (the
    model as its own draft is slower than plain decoding there: the rule is right to). Tests therefore run with
    the rule's default off, unless they set ``disable_by_payoff`` themselves or are marked ``payoff_default``; the
    rule's own tests (tests/spec_decode/test_spec_payoff.py) drive it with an injected clock. Engines started in a
    subprocess keep the real default."""
    if request.node.get_closest_marker("payoff_default") is None:
        import hayabusa.spec_decode.config as spec_config

        monkeypatch.setattr(spec_config, "DEFAULT_DISABLE_BY_PAYOFF", False)
    yield


@pytest.fixture(autouse=True)
def _free_gpu_before_cuda_tests(request):
    """Before a CUDA test: nothing an earlier test left behind holds GPU memory. An engine sizes its KV cache from
    gpu_memory_utilization minus what the process holds, so an engine kept alive by a reference cycle, or by the
    frames of an earlier failure's traceback (``sys.last_*``), would leave the next one 0 blocks and turn one
    failure into many."""
    if "cuda" in request.keywords and torch.cuda.is_available():
        import gc
        import sys

        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        gc.collect()
        torch.cuda.empty_cache()
    yield


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The models under test are tiny: on a small shared CPU box, intra-op threads only add wake-up latency and
    contend with other processes. One thread for the whole run (HF references and hayabusa alike)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def stories_dir() -> str:
    if not STORIES.exists():
        pytest.skip(f"assets not found at {STORIES}; set HAYABUSA_ASSETS")
    return str(STORIES)


@pytest.fixture(scope="session")
def stories_qwen2_dir() -> str:
    if not STORIES_QWEN2.exists():
        pytest.skip(f"assets not found at {STORIES_QWEN2}; set HAYABUSA_ASSETS")
    return str(STORIES_QWEN2)


def _save_tiny(arch: str, tokenizer_dir: Path, out: Path) -> str:
    """A 2-layer random-weight checkpoint of `arch` whose vocab matches the real tokenizer in tokenizer_dir."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(require_asset(tokenizer_dir)))
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                    p.normal_(0.0, 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Random 2-layer Llama with the Japanese llm-jp-v3.1 SentencePiece tokenizer."""
    return _save_tiny("llama", TOKENIZERS / "llm-jp-v3.1", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """Random 2-layer Qwen2 (non-zero qkv biases, tied embeddings) with the Qwen2.5/3 BPE tokenizer."""
    return _save_tiny("qwen2", TOKENIZERS / "qwen3", tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def example_prompts() -> list[str]:
    return EN_PROMPTS + JA_PROMPTS


@pytest.fixture(scope="session")
def q05_dir(tmp_path_factory) -> str:
    """A random bf16 qwen2.5-0.5b-shape checkpoint for the CUDA tests: $HAYABUSA_Q05_DIR when it holds one (the
    device run makes it once), else made here (~1 GB)."""
    path = os.environ.get("HAYABUSA_Q05_DIR")
    if path and os.path.exists(os.path.join(path, "config.json")):
        return path
    from hayabusa.bench.models import make_model

    out = str(tmp_path_factory.mktemp("q05"))
    make_model("qwen2.5-0.5b-shape", out)
    return out
