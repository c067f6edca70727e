"""On a GPU: the fused split-KV merge (paged_attention.FUSED_MERGE) at Qwen2.5-7B's heads (28 q / 4 kv, D 128, bf16,
block size 16), batch 1 and 8, decode and q_len-5 verify steps, the split count the launcher picks from the SM count:
bit-equal to the two-kernel path over many launches (the splits of a tile really run concurrently here, unlike in
the CPU interpreter, so a merge that read a partial before it was visible would show), counters zero after each;
a CUDA graph captured once and replayed with new seq_lens; a capture with no counter buffer falls back to the
merge kernel and allocates nothing. Seconds in all."""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels import paged_attention as pa
from hayabusa.kernels.paged_attention import _auto_num_splits, paged_attention, paged_attention_ref
from tests.kernels.test_paged_attention import SENTINEL, TOL, make_case

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
H, H_KV, D = 28, 4, 128
CUDA = torch.device("cuda")


def _case(R: int, q_len: int, seed: int) -> dict:
    """R requests of q_len queries over contexts of 3..4096 keys (one of 3: every split but the first empty), and a
    trailing padding row (no queries, seq_len 0), as a graph batch has."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(3, 4096, (R,), generator=g).tolist()
    ctx[0] = 3
    return make_case([(c, q_len) for c in ctx] + [(0, 0)], H, H_KV, D, 16, torch.bfloat16, "cuda", seed=seed,
                     num_pad_tokens=0)


@pytest.fixture(autouse=True)
def _wide_short_query_tiles(monkeypatch):
    """q_len 5 x group 7 takes the 64-row short-query tile (and split-KV) at every R, not only at <= 4 programs."""
    monkeypatch.setattr(pa, "SHORT_QUERY_WIDE_MAX_PROGRAMS", 1 << 30)


def _run(case: dict, fused: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(pa, "FUSED_MERGE", fused)
    out = torch.full(case["q"].shape, SENTINEL, dtype=case["q"].dtype, device="cuda")
    paged_attention(out=out, **case)
    return out


def _splits(R: int, q_len: int) -> int:
    """The split count the launcher picks for _case(R, q_len) (R requests and the padding row)."""
    return _auto_num_splits((R + 1) * H_KV, q_len, CUDA, pa.is_short_query(q_len, H // H_KV, (R + 1) * H_KV))


def _counters_zero() -> bool:
    torch.cuda.synchronize()
    return not pa._COUNTERS[torch.device("cuda", torch.cuda.current_device())].any()


@pytest.mark.parametrize("R", [1, 8])
@pytest.mark.parametrize("q_len", [1, 5])
def test_fused_merge_bits_at_7b_heads(R, q_len, monkeypatch):
    case = _case(R, q_len, seed=R + q_len)
    assert _splits(R, q_len) > 1
    two_kernel = _run(case, False, monkeypatch)
    for _ in range(50):
        assert torch.equal(_run(case, True, monkeypatch), two_kernel)
        assert _counters_zero()
    ref = torch.full_like(two_kernel, SENTINEL)
    paged_attention_ref(out=ref, **case)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(two_kernel.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("R", [1, 8])
@pytest.mark.parametrize("q_len", [1, 5])
def test_fused_merge_graph_replay(R, q_len, monkeypatch):
    """Captured once at one set of lengths, replayed at others: each replay's bits equal the two-kernel path's
    eager output at those lengths, and the counters are zero after every replay."""
    case = _case(R, q_len, seed=10 + R + q_len)           # the cache holds the longest lengths replayed
    seq_lens = case["seq_lens"]
    full = seq_lens.clone()
    q_lens = case["query_start_loc"].diff()
    mid, short = (torch.maximum(full - d, q_lens).to(torch.int32) for d in (300, 2000))
    assert _splits(R, q_len) > 1
    monkeypatch.setattr(pa, "FUSED_MERGE", True)
    out = torch.zeros_like(case["q"])
    seq_lens.copy_(mid)
    paged_attention(out=out, **case)                       # compile and allocate the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(out=out, **case)
    for _ in range(3):
        for new in (short, full, mid):
            seq_lens.copy_(new)
            out.zero_()
            graph.replay()
            assert _counters_zero()
            want = _run(case, False, monkeypatch)
            monkeypatch.setattr(pa, "FUSED_MERGE", True)
            assert torch.equal(out, want)


def test_capture_without_counters_falls_back(monkeypatch):
    """A capture that finds no counter buffer big enough merges with the second kernel (allocating inside the
    capture would tie the buffer to the graph's pool), and its replays give the same bits."""
    case = _case(1, 1, seed=3)
    want = _run(case, False, monkeypatch)
    _run(case, True, monkeypatch)                          # compile the fused variant
    torch.cuda.synchronize()
    monkeypatch.setattr(pa, "_COUNTERS", {})
    out = torch.zeros_like(case["q"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(out=out, **case)
    assert not pa._COUNTERS
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
