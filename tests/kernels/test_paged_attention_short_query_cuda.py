"""On a GPU: short-query (verify-step) paged_attention at real sizes (issue #21): SmolLM2-135M's heads (9 q / 3 kv,
D 64) and Qwen2.5-7B's (28 / 4, D 128), bf16, block size 16, q_len 2-5, contexts up to 4096 with the split count
the launcher picks from the SM count, vs paged_attention_ref and vs the old path (prefill tile, one pass); a CUDA
graph captured at one set of lengths and replayed at others; the split choice. Seconds in all."""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels import paged_attention as pa
from hayabusa.kernels.paged_attention import _auto_num_splits, paged_attention, paged_attention_ref
from tests.kernels.test_paged_attention import SENTINEL, TOL, make_case

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HEADS = {"smollm2": (9, 3, 64), "qwen7b": (28, 4, 128)}


def _reqs(R: int, q_len: int, seed: int) -> list[tuple[int, int]]:
    """R verify rows of q_len tokens (one plain decode row, one of fewer tokens) over contexts of 3..4096 keys."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(3, 4096, (R,), generator=g).tolist()
    ctx[0] = 3                                              # 3 + q_len keys: all splits but the first empty
    lens = [q_len] * R
    if R > 2:
        lens[1], lens[2] = 1, max(1, q_len - 2)
    return list(zip(ctx, lens))


def _run(case, **kwargs) -> torch.Tensor:
    out = torch.full(case["q"].shape, SENTINEL, dtype=case["q"].dtype, device="cuda")
    paged_attention(out=out, **case, **kwargs)
    return out


@pytest.mark.parametrize("model", sorted(HEADS))
@pytest.mark.parametrize("R", [1, 4, 16])
@pytest.mark.parametrize("q_len", [2, 5])
def test_short_query_real_sizes(model, R, q_len, monkeypatch):
    H, H_kv, D = HEADS[model]
    monkeypatch.setattr(pa, "SHORT_QUERY_WIDE_MAX_PROGRAMS", 1 << 30)   # the wide tile's math at every R too
    case = make_case(_reqs(R, q_len, R * 10 + q_len), H, H_kv, D, 16, torch.bfloat16, "cuda", seed=R)
    assert _auto_num_splits(R * H_kv, case["max_query_len"], torch.device("cuda"), True) > 1
    new = _run(case)
    ref = torch.full_like(new, SENTINEL)
    paged_attention_ref(out=ref, **case)
    monkeypatch.setattr(pa, "SHORT_QUERY_SPLIT", False)
    old = _run(case)
    atol, rtol = TOL[torch.bfloat16]
    valid = int(case["query_start_loc"][-1])
    torch.testing.assert_close(new[:valid].float(), ref[:valid].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(new[:valid].float(), old[:valid].float(), atol=atol, rtol=rtol)
    assert torch.isfinite(new[:valid].float()).all() and (new[valid:] == SENTINEL).all()


def test_short_query_graph_replay():
    """Capture at one set of lengths, replay at others (the verify graph's contract: lengths read on the device)."""
    H, H_kv, D = HEADS["smollm2"]
    reqs = _reqs(4, 5, 1)
    case = make_case(reqs, H, H_kv, D, 16, torch.bfloat16, "cuda", seed=2, num_pad_tokens=0)
    out = torch.zeros_like(case["q"])
    seq_lens = case["seq_lens"]
    longer = seq_lens.clone()
    short = torch.clamp(seq_lens - 100, min=5)              # the same queries over fewer cached keys
    seq_lens.copy_(longer)
    _run(case)                                              # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(out=out, **case)
    for lens in (short, longer):
        seq_lens.copy_(lens)
        graph.replay()
        ref = torch.zeros_like(out)
        paged_attention_ref(out=ref, **case)
        atol, rtol = TOL[torch.bfloat16]
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_short_query_auto_splits():
    cuda = torch.device("cuda")
    sms = pa._num_sms(cuda)
    expect = min(32, 1 << (-(-2 * sms // 3) - 1).bit_length())   # next power of two of cdiv(2 * sms, 3)
    assert _auto_num_splits(3, 5, cuda, True) == expect > 1
    assert _auto_num_splits(3, 5, cuda, False) == 1       # prefill-shaped steps never split
    assert _auto_num_splits(sms, 5, cuda, True) == 1      # a full grid does not split
