"""CUDA graphs for speculative decoding's verify steps (run on the device): greedy ids with the (batch, k + 1)
graphs equal those of the same padded shapes run eagerly (enforce_eager) and those with speculation off, and the
verify steps were replayed from graphs."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from tests.spec_decode.test_spec_engine import PROMPTS, OracleProposer, _ids

pytestmark = pytest.mark.cuda


def _run(path, base, enforce_eager, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 0}
    llm = LLM(path, device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20, enforce_eager=enforce_eager,
              speculative_config=spec, **kwargs)
    llm.llm_engine.scheduler.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids
                                                             for o in base])
    return llm, _ids(llm.generate(PROMPTS, params, use_tqdm=False))


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_verify_graphs_equal_eager(tiny_qwen2, max_num_seqs):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kwargs = dict(max_num_seqs=max_num_seqs)
    base = LLM(tiny_qwen2, device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20,
               **kwargs).generate(PROMPTS, params, use_tqdm=False)
    graphs, ids_graphs = _run(tiny_qwen2, base, False, **kwargs)
    eager, ids_eager = _run(tiny_qwen2, base, True, **kwargs)
    assert ids_graphs == ids_eager == _ids(base)
    g, e = graphs.llm_engine.runner.decode_runner, eager.llm_engine.runner.decode_runner
    assert g.verify_graphs and g.num_verify_replays == g.num_verify_runs > 0
    assert not e.verify_graphs and e.num_verify_replays == 0 and e.num_verify_runs > 0
    m = graphs.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]


def test_verify_graphs_with_chunked_prefill_and_preemption(tiny_llama):
    """Steps mixing verify rows with short prompt chunks and resumed requests replay the graphs too."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=40, num_gpu_blocks_override=24, block_size=4,
                  max_model_len=64)
    base = LLM(tiny_llama, device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20,
               **kwargs).generate(PROMPTS, params, use_tqdm=False)
    graphs, ids_graphs = _run(tiny_llama, base, False, **kwargs)
    assert ids_graphs == _ids(base)
    assert graphs.llm_engine.runner.decode_runner.num_verify_replays > 0
    assert graphs.llm_engine.scheduler.num_preemptions > 0
