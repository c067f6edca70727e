"""The greedy verify path on CUDA (run on the device): the Triton kernel in the engine (CUDA graphs on), greedy ids
identical with it on and off and to speculation off, no host sync inside verify, and the host time per verify call
on and off printed (the greedy path must not be slower)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import hayabusa.worker.model_runner as model_runner
import hayabusa.worker.spec_verify as spec_verify
from hayabusa import LLM, SamplingParams
from tests.spec_decode.test_spec_engine import PROMPTS, OracleProposer, _ids

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _timed_run(llm, params, fast: bool, monkeypatch) -> tuple[list[list[int]], list[float], int]:
    runner = llm.llm_engine.runner
    runner.greedy_verify_fast_path = fast
    runner.num_greedy_verify_steps = 0
    times = []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = spec_verify.verify(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(model_runner, "verify", timed)
    ids = _ids(llm.generate(PROMPTS, params, use_tqdm=False))
    return ids, times, runner.num_greedy_verify_steps


@pytest.mark.parametrize("triton_kernel", [False, True])
@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_greedy_path_on_cuda_equals_off_and_speculation_off(tiny_qwen2, max_num_seqs, triton_kernel, monkeypatch,
                                                            capsys):
    from hayabusa.worker import spec_verify

    monkeypatch.setattr(spec_verify, "USE_GREEDY_VERIFY_TRITON", triton_kernel)   # the kernel, or its torch form
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3)
    base = LLM(tiny_qwen2, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    # (four runs of one engine, each expected to verify: the measured turn-off rule, whose decisions would carry
    # from one run into the next, off)
    llm = LLM(tiny_qwen2, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                              "disable_by_payoff": False}, **kwargs)
    oracle = [o.prompt_token_ids + o.outputs[0].token_ids for o in base]
    results = {}
    for fast in (True, False, True, False):   # the first two warm up (Triton compile)
        llm.llm_engine.scheduler.spec.proposer = OracleProposer(oracle)
        results[fast] = _timed_run(llm, params, fast, monkeypatch)
    (on, t_on, steps_on), (off, t_off, steps_off) = results[True], results[False]
    assert on == off == _ids(base)
    assert steps_on > 0 and steps_off == 0
    m = llm.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    med_on, med_off = statistics.median(t_on) * 1e6, statistics.median(t_off) * 1e6
    with capsys.disabled():
        print(f"\nmax_num_seqs {max_num_seqs}, triton kernel {triton_kernel}: verify host µs per call "
              f"(median over {len(t_on)} / {len(t_off)} "
              f"calls): greedy path {med_on:.1f}, general path {med_off:.1f}")
    assert med_on < med_off


def test_greedy_path_has_no_host_sync(tiny_qwen2):
    import numpy as np

    from hayabusa.kernels.greedy_verify import greedy_verify
    from hayabusa.worker.spec_verify import SpecStepInputs, greedy_plan, to_device

    R, K, V = 16, 4, 32000
    nd = np.full(R, K)
    width = nd + 1
    starts = np.cumsum(width) - width
    spec = SpecStepInputs(nd, np.zeros((R, K), dtype=np.int64), starts + nd, np.zeros((R, K), dtype=np.int64))
    logits = torch.randn(int(width.sum()), V, device="cuda")
    dev = torch.device("cuda")
    greedy_verify(logits.argmax(-1), to_device(greedy_plan(spec), np.int64, dev))   # compile
    plan = to_device(greedy_plan(spec), np.int64, dev)   # (pageable H2D, as the general path's copies)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = greedy_verify(logits.argmax(-1), plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    am = logits.argmax(-1).cpu()
    # column 0 is the argmax at each request's first row (an accepted proposal 0 equals it); a run goes on only
    # while the proposals (all 0) equal the argmax
    assert torch.equal(out[:, 0].cpu(), am[torch.from_numpy(starts)])
    assert bool(((out[:, 1].cpu() >= 0) == (am[torch.from_numpy(starts)] == 0)).all())
