"""LLM.get_metrics() in vLLM's shape on CUDA (run on the device): with async scheduling and the verify CUDA graphs,
vLLM's example loop reads counters that agree with the requests' own, and greedy ids stay those of speculation
off. Tiny models: seconds."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from tests.spec_decode.test_spec_engine import PROMPTS, OracleProposer, _ids
from tests.spec_decode.test_vllm_metrics import _vllm_loop

pytestmark = pytest.mark.cuda

K = 4
KWARGS = dict(device="cuda", dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.3)
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_vllm_loop_with_oracle_proposals_on_cuda(tiny_qwen2):
    base = LLM(tiny_qwen2, **KWARGS).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(tiny_qwen2, speculative_config={"method": "ngram", "num_speculative_tokens": K}, **KWARGS)
    llm.llm_engine.scheduler.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids
                                                             for o in base])
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _ids(outputs) == _ids(base)
    drafts, draft_tokens, accepted, per_pos = _vllm_loop(llm.get_metrics())
    print(f"oracle on CUDA: num_drafts {drafts}, draft tokens {draft_tokens}, accepted {accepted}, "
          f"per position {per_pos}")
    assert drafts == sum(o.metrics.spec_num_steps for o in outputs) > 0
    assert draft_tokens == sum(o.metrics.spec_num_draft_tokens for o in outputs)
    assert 0 < accepted == sum(o.metrics.spec_num_accepted_tokens for o in outputs) < draft_tokens
    assert len(per_pos) == K and sum(per_pos) == accepted and per_pos[0] <= drafts
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))


def test_vllm_loop_with_own_draft_model_on_cuda(tiny_llama):
    base = LLM(tiny_llama, **KWARGS).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(tiny_llama, speculative_config={"model": tiny_llama, "num_speculative_tokens": 3}, **KWARGS)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _ids(outputs) == _ids(base)
    m = llm.get_metrics()
    drafts, draft_tokens, accepted, per_pos = _vllm_loop(m)
    print(f"own draft on CUDA: num_drafts {drafts}, draft tokens {draft_tokens}, accepted {accepted}, "
          f"per position {per_pos}")
    assert drafts == sum(o.metrics.spec_num_steps for o in outputs) > 0
    assert accepted == draft_tokens and per_pos[0] == drafts and sum(per_pos) == accepted
    assert m["spec_decode_num_accepted_tokens"] == accepted          # the dict-style shorthand agrees
    assert m.by_name("vllm:num_requests_running").value == 0.0 and m.by_name("vllm:kv_cache_usage_perc").value == 0.0
