"""On a GPU (issue #17, W9): the encoders of admission steps replay CUDA graphs of padded (B, L) buckets. Greedy
token ids are identical with encoder graphs (replayed), enforce_eager (the same padded shapes, eagerly) and the
packed varlen path (padded encoder off), in float32 (bf16: graphs == eager); every admission step that fits a
bucket replays; no host sync in the encoder step; the graphs' pool is reserved by the KV sizing; the host time of an
admission step's encoder work, graphs vs eager, is printed. Each test runs in seconds (tiny random T5s)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.models._t5 import save_tiny_t5
from tests.models.test_t5_cuda import _assert_close   # STYLE.md's parity rule

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _encoder_graphs_on(monkeypatch):
    """Encoder graphs are opt-in on CUDA until these tests have passed on a GPU (encoder_decoder.USE_ENCODER_GRAPHS)."""
    from hayabusa.worker import encoder_decoder

    monkeypatch.setattr(encoder_decoder, "USE_ENCODER_GRAPHS", True)


@pytest.fixture(scope="module", params=["v1.0", "v1.1"])
def t5_dir(request, tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5_encg_" + request.param.replace(".", "")), request.param,
                        initializer_factor=1.0)


def _requests(n: int = 40, max_len: int = 120):
    """Ragged encoder inputs (3..max_len tokens) and W9-like equal ones (32), 4..20 output tokens, greedy."""
    rng = np.random.default_rng(0)
    prompts, params = [], []
    for i in range(n):
        k = 32 if i % 2 else int(rng.integers(3, max_len))
        prompts.append({"prompt_token_ids": rng.integers(5, 1000, size=k).tolist()})
        params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 20)), ignore_eos=True,
                                     logprobs=5))
    return prompts, params


def _run(model_dir: str, dtype: str = "float32", padded: bool = True, **kw):
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=128,
              kv_cache_memory_bytes=256 << 20, **kw)
    encdec = llm.llm_engine.runner.encdec
    encdec.padded_encoder = padded
    prompts, params = _requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    ids = [(o.outputs[0].token_ids, [set(d) for d in o.outputs[0].logprobs]) for o in outs]
    stats = dict(graphs=len(encdec.enc_graphs), buckets=len(encdec.buckets), padded=encdec.num_padded_runs,
                 replays=encdec.num_encoder_replays, packed=encdec.num_packed_runs,
                 pool_mib=encdec.enc_graph_pool_bytes / 2**20, capture_s=encdec.enc_capture_seconds)
    del llm, encdec
    gc.collect()
    torch.cuda.empty_cache()
    return ids, stats


def test_encoder_graphs_equal_eager_and_packed_fp32(t5_dir):
    graphs, g = _run(t5_dir)
    eager, e = _run(t5_dir, enforce_eager=True)
    packed, p = _run(t5_dir, padded=False)
    print(f"\nencoder graphs: {g}\nenforce_eager: {e}\npacked: {p}")
    assert g["graphs"] == g["buckets"] == 20     # B 1,2,4,8 x L 32..256 and 512 (the encoder limit: n_positions)
    assert g["replays"] == g["padded"] > 0 and g["packed"] == 0
    assert e["graphs"] == 0 and e["replays"] == 0 and e["padded"] == g["padded"]
    assert p["padded"] == 0 and p["packed"] > 0
    assert [t for t, _ in graphs] == [t for t, _ in eager]       # the same shapes: bitwise the same
    equal = _assert_close(graphs, packed, min_equal=0.9)           # packed varlen shapes: parity rule
    print(f"padded vs packed: {equal} of {len(packed)} sequences identical")


def test_encoder_graphs_equal_eager_bf16(t5_dir):
    graphs, g = _run(t5_dir, dtype="bfloat16")
    eager, _ = _run(t5_dir, dtype="bfloat16", enforce_eager=True)
    assert g["replays"] > 0
    assert [t for t, _ in graphs] == [t for t, _ in eager]


def test_no_host_sync_in_a_replayed_encoder_step(t5_dir):
    llm = LLM(t5_dir, device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128,
              kv_cache_memory_bytes=256 << 20)
    encdec = llm.llm_engine.runner.encdec
    run = encdec.run_encoders

    def strict(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    encdec.run_encoders = strict
    prompts, params = _requests(16)
    llm.generate(prompts, params, use_tqdm=False)
    assert encdec.num_encoder_replays > 0


def test_graph_pool_is_reserved_by_the_kv_sizing(t5_dir):
    """W9's shapes (max_num_seqs 256, max_model_len 512): 32 buckets; the memory profile reserved the pool."""
    llm = LLM(t5_dir, device="cuda", dtype="bfloat16", max_num_seqs=256, max_model_len=512,
              gpu_memory_utilization=0.3)
    encdec = llm.llm_engine.runner.encdec
    print(f"\n{len(encdec.enc_graphs)} encoder graphs, pool {encdec.enc_graph_pool_bytes / 2**20:.1f} MiB "
          f"(reserved by the profile: {encdec.enc_graph_profiled_bytes / 2**20:.1f} MiB), captured in "
          f"{encdec.enc_capture_seconds:.2f} s")
    assert len(encdec.enc_graphs) == len(encdec.buckets) == 32
    assert encdec.enc_graph_profiled_bytes > 0
    assert encdec.enc_graph_pool_bytes <= 2 * encdec.enc_graph_profiled_bytes + (64 << 20)
    assert encdec.enc_capture_seconds < 60
    del llm, encdec
    gc.collect()
    torch.cuda.empty_cache()


def test_admission_host_time_graphs_vs_eager(t5_dir):
    """W9-like admissions (256-token inputs): host µs of EncoderDecoderRunner.run_encoders per admission step
    (the device work is queued, not waited for), encoder graphs vs enforce_eager; printed, graphs must be faster."""
    res = {}
    for eager in (False, True):
        llm = LLM(t5_dir, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                  kv_cache_memory_bytes=512 << 20, enforce_eager=eager)
        encdec = llm.llm_engine.runner.encdec
        run, times = encdec.run_encoders, []

        def timed(out, *a, **kw):
            t0 = time.perf_counter()
            r = run(out, *a, **kw)
            if out.scheduled_encoder_prompt_req_ids:
                times.append(time.perf_counter() - t0)
            return r

        encdec.run_encoders = timed
        rng = np.random.default_rng(1)
        prompts = [{"prompt_token_ids": rng.integers(5, 1000, size=256).tolist()} for _ in range(96)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        warm = times[2:] or times
        res[eager] = (1e6 * float(np.median(warm)), len(times), encdec.num_encoder_replays)
        del llm, encdec
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\nrun_encoders host µs per admission step (median): graphs {res[False][0]:.0f} "
          f"({res[False][1]} steps, {res[False][2]} replays), eager {res[True][0]:.0f} ({res[True][1]} steps)")
    assert res[False][2] == res[False][1] > 0
    assert res[False][0] < res[True][0]
