"""Speculative decoding on CUDA (run on the device): greedy ids unchanged with CUDA graphs on for the plain decode
steps, the verify path free of host syncs, and rejection sampling's distribution on the device."""

from __future__ import annotations

import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.spec_decode.test_rejection_sampler import CHI2_CRIT_0001, chi_square
from tests.spec_decode.test_spec_engine import PROMPTS, OracleProposer, _ids

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_greedy_unchanged_on_cuda(tiny_qwen2, max_num_seqs):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3)
    base = LLM(tiny_qwen2, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_qwen2, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **kwargs)
    llm.llm_engine.scheduler.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids
                                                             for o in base])
    assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == _ids(base)
    m = llm.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]


def test_rejection_sampler_has_no_host_sync_and_keeps_distribution():
    from hayabusa.sample.rejection_sampler import rejection_sample

    dev = torch.device("cuda")
    n, p = 10_000, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], device=dev)
    torch.manual_seed(0)
    target = p.expand(n, 2, 5).contiguous()
    drafts = torch.full((n, 2), 4, device=dev)
    bonus = torch.zeros(n, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = rejection_sample(drafts, torch.full((n,), 2, device=dev), target.argmax(-1), target, bonus,
                               torch.zeros(n, dtype=torch.bool, device=dev), {})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    first = torch.bincount(out[:, 0], minlength=5).float().cpu()
    assert chi_square(first, p.cpu()) < CHI2_CRIT_0001[4]


def test_draft_model_on_cuda_own_draft_accepts_everything(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.3)
    base = LLM(tiny_llama, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_llama, speculative_config={"model": tiny_llama, "num_speculative_tokens": 3}, **kwargs)
    assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == _ids(base)
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]
