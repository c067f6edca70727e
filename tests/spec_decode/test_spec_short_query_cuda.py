"""On a GPU: greedy output with n-gram speculation and CUDA-graph verify steps equals speculation off, with the
short-query attention path (split-KV verify steps, issue #21) on and off; a random Llama of GQA group 3 (SmolLM2's)
over prompts of 150-600 tokens (several key tiles, so verify steps split). A random model's output repeats no
n-gram of its prompt (n-gram lookups all miss: no verify step), so the n-gram proposer is replaced by the oracle of
test_spec_engine (the reference continuation, every third run corrupted: full, partial and no acceptance), as in
test_spec_graphs_cuda. About a minute."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.kernels import paged_attention as pa
from tests.conftest import TOKENIZERS, require_asset
from tests.spec_decode.test_spec_engine import OracleProposer, _ids

pytestmark = pytest.mark.cuda
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
         "min_acceptance_rate": 0}


@pytest.fixture(scope="module")
def tiny_group3(tmp_path_factory) -> str:
    """A 2-layer random Llama with 6 query heads over 2 KV heads (group 3), head_dim 32."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / "qwen3")))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_group3")
    LlamaForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


def _prompts() -> list[list[int]]:
    """Token-id prompts that repeat themselves (n-gram lookups hit), 150-600 tokens."""
    out = []
    for i, n in enumerate((150, 300, 450, 600, 200, 350)):
        unit = [(17 * i + 31 * j) % 5000 + 100 for j in range(23 + i)]
        out.append((unit * (n // len(unit) + 1))[:n])
    return out


def _generate(path: str, max_num_seqs: int, spec: dict | None, reference: list[list[int]] | None = None):
    llm = LLM(path, device="cuda", dtype="float32", kv_cache_memory_bytes=512 << 20, max_model_len=1024,
              max_num_seqs=max_num_seqs, speculative_config=spec, skip_tokenizer_init=True)
    if reference is not None:
        llm.llm_engine.scheduler.spec.proposer = OracleProposer([p + o for p, o in zip(_prompts(), reference)])
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return llm, _ids(outs)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_greedy_spec_on_equals_off(tiny_group3, max_num_seqs, monkeypatch):
    _, base = _generate(tiny_group3, max_num_seqs, None)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(pa, "SHORT_QUERY_SPLIT", on)
        llm, ids = _generate(tiny_group3, max_num_seqs, NGRAM, base)
        results[on] = ids
        runner = llm.llm_engine.runner.decode_runner
        assert runner.verify_graphs and runner.num_verify_replays > 0
        m = llm.get_metrics()
        assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert results[True] == base
    assert results[False] == base
