"""Every supported architecture beyond Llama/Qwen2 (GPT-2, Qwen3, Mistral, Gemma 2) and the RoPE scaling variants:
greedy token ids equal HF Transformers' (float32, CPU) on tiny random checkpoints, at batch size 1 and 8 and with
preemption forced (plus chunked prefill); sliding windows (W=8) are exercised by prompts and continuations longer
than the window, Gemma 2's soft-capping by small caps; first-token logprobs equal HF's."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError, UnsupportedModelError
from tests.conftest import EN_PROMPTS, JA_PROMPTS, LONG_PROMPT, TOKENIZERS, require_asset
from tests.helpers import assert_first_token_logprobs_match_hf, assert_greedy_close, hf_greedy

WINDOW = 8
PROMPTS = EN_PROMPTS + JA_PROMPTS + [LONG_PROMPT]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)

CONFIGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=8": dict(max_num_seqs=8),
    # block_size 4, 20 blocks for 8 rows of up to ~56 tokens, 16-token steps: preemption and chunked prefill
    "preempt+chunk": dict(max_num_seqs=8, block_size=4, num_gpu_blocks_override=20, max_model_len=64,
                          max_num_batched_tokens=16),
}


def _randomize(model: torch.nn.Module, names: tuple[str, ...], std: float) -> None:
    """HF initialises biases to 0 and norm weights to 1 (Gemma: 0): draw them so they matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(names):
                p.normal_(0.0, std)


def _build(arch: str, out) -> str:
    import transformers as tf

    tok_name = {"gpt2": "gpt2", "qwen3": "qwen3", "mistral": "llm-jp-v2.2", "gemma2": "llm-jp-v3.1"}[arch]
    tok = tf.AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / tok_name)))
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               initializer_range=0.2)
    llama_like = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, **ids)
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **ids)
        model = tf.GPT2LMHeadModel(cfg)
        _randomize(model, ("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"), 0.3)
    elif arch == "qwen3":  # head_dim 32 != hidden / heads; layer 1 slides (max_window_layers=1)
        cfg = tf.Qwen3Config(**llama_like, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        model = tf.Qwen3ForCausalLM(cfg)
        _randomize(model, ("q_norm.weight", "k_norm.weight"), 0.5)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**llama_like, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=WINDOW)
        model = tf.MistralForCausalLM(cfg)
    else:  # Gemma 2: layer 0 slides, layer 1 is global; caps small enough to bite
        cfg = tf.Gemma2Config(**{**llama_like, "num_attention_heads": 4}, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                              rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id or 0)
        model = tf.Gemma2ForCausalLM(cfg)
        _randomize(model, ("norm.weight", "layernorm.weight"), 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


ARCHS = ["gpt2", "qwen3", "mistral", "gemma2"]
# our per-layer sliding windows, as HF's configs define them
EXPECTED_WINDOWS = {"gpt2": [None, None], "qwen3": [None, WINDOW], "mistral": [WINDOW, WINDOW],
                    "gemma2": [WINDOW, None]}



@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """arch -> {"dir", "prompt_ids", "ref"}, each built (and HF's greedy reference computed) once."""
    built: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in built:
            d = _build(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(d)
            prompt_ids = [tok(p).input_ids for p in PROMPTS]
            built[arch] = {"dir": d, "prompt_ids": prompt_ids,
                           "ref": hf_greedy(d, prompt_ids, GREEDY.max_tokens)}
        return built[arch]

    return get


def _attn_windows(llm: LLM) -> list:
    model = llm.llm_engine.runner.model
    return [m.sliding_window for m in model.modules() if type(m).__name__ == "Attention"]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, config, cases):
    case = cases(arch)
    llm = LLM(case["dir"], **CONFIGS[config])
    assert _attn_windows(llm) == EXPECTED_WINDOWS[arch]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if config == "preempt+chunk":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if EXPECTED_WINDOWS[arch] != [None, None]:  # the window is exceeded in prefill and in decode
        assert max(len(i) for i in case["prompt_ids"]) > 2 * WINDOW
    for ids, out, ref in zip(case["prompt_ids"], outs, case["ref"]):
        assert out.prompt_token_ids == ids
        c = out.outputs[0]
        assert_greedy_close(case["dir"], ids, c.token_ids, ref, [set(d) for d in c.logprobs])


@pytest.mark.parametrize("arch", ARCHS)
def test_first_token_logprobs_match_hf(arch, cases):
    """Logits, not only their argmax: Gemma 2's final soft-cap changes logprobs but never the argmax."""
    case = cases(arch)
    hf, ids, top = assert_first_token_logprobs_match_hf(case["dir"], case["prompt_ids"])
    if arch == "gemma2":  # the final cap is active: without it the last prompt's logprobs differ
        hf.config.final_logit_softcapping = None
        with torch.no_grad():
            uncapped = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        assert abs(uncapped[top.indices[0]].item() - top.values[0].item()) > 0.05


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_path_matches_hf(arch, cases):
    """The CUDA path (Triton attention with window / softcap, fused norms and RoPE, CUDA graphs) in float32."""
    case = cases(arch)
    llm = LLM(case["dir"], device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=1 << 28)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for ids, out, ref in zip(case["prompt_ids"], outs, case["ref"]):
        c = out.outputs[0]
        assert_greedy_close(case["dir"], ids, c.token_ids, ref, [set(d) for d in c.logprobs])


def test_sliding_window_rules_of_configs_without_layer_types():
    """transformers < 4.53 configs carry no layer_types: the architectures' own rules apply."""
    from types import SimpleNamespace

    from hayabusa.model.gemma2 import gemma2_sliding_window
    from hayabusa.model.mistral import MistralForCausalLM
    from hayabusa.model.qwen2 import qwen_sliding_window

    qwen = SimpleNamespace(use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert [qwen_sliding_window(qwen, i) for i in range(4)] == [None, None, 16, 16]
    qwen.use_sliding_window = False
    assert [qwen_sliding_window(qwen, i) for i in range(4)] == [None] * 4
    gemma = SimpleNamespace(sliding_window=16)
    assert [gemma2_sliding_window(gemma, i) for i in range(4)] == [16, None, 16, None]
    mistral = SimpleNamespace(sliding_window=None, layer_types=["sliding_attention"])  # HF Mistral ignores it
    assert MistralForCausalLM.sliding_window(mistral, 0) is None


def test_gpt2_original_checkpoint_layout(cases, tmp_path):
    """openai-community/gpt2's files: keys without the "transformer." prefix, causal-mask buffers included."""
    from safetensors.torch import load_file, save_file

    src = cases("gpt2")["dir"]
    state = load_file(os.path.join(src, "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256, dtype=torch.bool))
    renamed["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    for name in os.listdir(src):
        if name != "model.safetensors":
            os.symlink(os.path.join(src, name), tmp_path / name)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = LLM(src).generate(PROMPTS[:2], params, use_tqdm=False)
    b = LLM(str(tmp_path)).generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


# ---------------------------------------------------------------- RoPE scaling (tiny Llama, token-id prompts)
ROPE_VARIANTS = {
    # transformers 4.x spelling in config.json (standardised by 5.x exactly as for the HF reference)
    "linear": ("rope_scaling", {"type": "linear", "factor": 4.0}, 128 * 4),
    "llama3": ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, 128),
    "yarn": ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 64 * 4),
}


def _tiny_llama_with_rope(out, key: str, rope: dict) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    path = os.path.join(str(out), "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw.pop("rope_parameters", None)
    if key == "rope_scaling":
        raw["rope_scaling"], raw["rope_theta"] = rope, 10000.0
    else:
        raw["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    with open(path, "w") as f:
        json.dump(raw, f)
    return str(out)


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_matches_hf(variant, tmp_path):
    key, rope, max_len = ROPE_VARIANTS[variant]
    d = _tiny_llama_with_rope(tmp_path, key, rope)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 90)]
    llm = LLM(d, skip_tokenizer_init=True, max_num_seqs=8)
    assert llm.llm_engine.config.model_config.max_model_len == max_len
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out, ref in zip(prompts, outs, hf_greedy(d, prompts, 16)):
        assert_greedy_close(d, p, out.outputs[0].token_ids, ref, [set(x) for x in out.outputs[0].logprobs])


def test_dynamic_ntk_is_rejected_clearly(tmp_path):
    d = _tiny_llama_with_rope(tmp_path, "rope_scaling", {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        LLM(d, skip_tokenizer_init=True)


def test_unsupported_architecture_lists_supported(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, f)
    with pytest.raises(HayabusaValidationError) as e:
        LLM(str(tmp_path), skip_tokenizer_init=True)
    for arch in ("GPT2LMHeadModel", "Gemma2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                 "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(e.value)
