"""paged_attention (Triton) vs paged_attention_ref (torch), and the ref vs dense SDPA.

Every case: K/V behind a shuffled block table with holes; cache slots no request owns hold NaN (so an unmasked
read past seq_len shows up as NaN); q is a strided view of a fused qkv tensor; padding tokens at the end of T.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hayabusa.kernels.paged_attention import paged_attention, paged_attention_ref
from hayabusa.kernels.store_kv import store_kv_ref

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}
MIXED = [(30, 1), (0, 37), (50, 20), (0, 0)]  # (cached, new): decode, prefill, chunked prefill, empty row
SENTINEL = 123.0


def make_case(reqs, H, H_kv, D, block_size, dtype, device, num_pad_tokens=2, seed=0, q_mult=1.0):
    """Metadata and tensors for requests given as (num_cached, num_new) pairs; (0, 0) is an empty row."""
    gen = torch.Generator().manual_seed(seed)
    R = len(reqs)
    seq_lens = [c + n for c, n in reqs]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(need) + 2                       # half the pool stays unused: holes
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    poison = int(ids[-1])                                # unused, all-NaN block for the table's tail
    block_table = torch.full((R, max(need) + 2), poison, dtype=torch.int32)
    off = 0
    for r, n in enumerate(need):
        block_table[r, :n] = ids[off:off + n]
        off += 2 * n                                     # skip ids: a request's blocks are not adjacent
    k_cache = torch.full((num_blocks, block_size, H_kv, D), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        kv = torch.randn(2, s, H_kv, D, generator=gen).to(dtype)
        store_kv_ref(kv[0], kv[1], k_cache, v_cache, slots)
    q_lens = [n for _, n in reqs]
    T = sum(q_lens) + num_pad_tokens
    qkv = (q_mult * torch.randn(T, (H + 2 * H_kv) * D, generator=gen)).to(dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(
        q=qkv.to(device)[:, :H * D].view(T, H, D),
        k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        query_start_loc=qsl.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device), scale=D ** -0.5, max_query_len=max(q_lens))


def run_both(case, **kwargs):
    """(kernel out, ref out), both pre-filled with SENTINEL."""
    outs = []
    for fn in (paged_attention, paged_attention_ref):
        out = torch.full(case["q"].shape, SENTINEL, dtype=case["q"].dtype, device=case["q"].device)
        fn(out=out, **case, **kwargs)
        outs.append(out)
    return outs


def check(case, **kwargs):
    out, ref = run_both(case, **kwargs)
    atol, rtol = TOL[case["q"].dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    valid = int(case["query_start_loc"][-1])
    assert torch.isfinite(ref[:valid].float()).all()
    assert (out[valid:] == SENTINEL).all()  # padding tokens are not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (14, 2)])  # MHA, GQA group 2, group 7
def test_mixed_batch(device, dtype, H, H_kv):
    check(make_case(MIXED, H, H_kv, 64, 16, dtype, device))


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_head_dims_and_block_sizes(device, D, block_size):
    check(make_case(MIXED, 6, 2, D, block_size, torch.float16, device, seed=D + block_size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_chunked_prefill(device, dtype):
    """Contexts spanning several key tiles: the unmasked tiles below the diagonal and the masked ones."""
    reqs = [(200, 70), (0, 150), (33, 1), (129, 2)]
    check(make_case(reqs, 14, 2, 64, 16, dtype, device, seed=3))


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("H,H_kv", [(4, 4), (14, 2)])
def test_decode_only(device, block_size, H, H_kv):
    """max_query_len == 1 (the CUDA-graph decode shape) with ragged contexts, one of them empty."""
    reqs = [(0, 1), (15, 1), (16, 1), (300, 1), (0, 0), (33, 1)]
    check(make_case(reqs, H, H_kv, 128, block_size, torch.float32, device, seed=block_size))


def test_decode_head_dim_256(device):
    reqs = [(0, 1), (300, 1), (0, 0), (40, 1)]
    check(make_case(reqs, 14, 2, 256, 16, torch.bfloat16, device, seed=4))


@pytest.mark.parametrize("window", [1, 8, 40, 1000])
def test_sliding_window(device, window):
    check(make_case(MIXED + [(90, 3)], 14, 2, 64, 16, torch.float32, device, seed=window),
          sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(device, dtype):
    case = make_case(MIXED, 4, 2, 64, 16, dtype, device, q_mult=8.0)  # scores far beyond the cap
    check(case, softcap=5.0)
    check(case, softcap=5.0, sliding_window=16)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
@pytest.mark.parametrize("window", [None, 50])
def test_split_kv(device, num_kv_splits, window):
    reqs = [(300, 1), (0, 0), (7, 1), (130, 1)]
    check(make_case(reqs, 14, 2, 128, 16, torch.float32, device), sliding_window=window,
          num_kv_splits=num_kv_splits)
    check(make_case(MIXED, 4, 2, 64, 32, torch.float16, device), sliding_window=window,
          num_kv_splits=num_kv_splits)


def test_oversized_grid_and_graph_padding(device):
    """max_query_len above the real maximum and trailing empty rows (a padded CUDA-graph batch)."""
    case = make_case(MIXED + [(0, 0), (0, 0)], 4, 2, 64, 16, torch.float32, device)
    case["max_query_len"] = 64
    check(case)
    check(case, num_kv_splits=3)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_zero_seq_len_row_is_skipped(device, num_kv_splits):
    """seq_len 0 skips a row even when query_start_loc gives it tokens: its out rows stay untouched."""
    case = make_case([(5, 2), (3, 3), (4, 1)], 4, 2, 64, 16, torch.float32, device, num_pad_tokens=0)
    case["seq_lens"][1] = 0
    out, ref = run_both(case, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert (out[2:5] == SENTINEL).all() and (out[:2] != SENTINEL).all() and (out[5:] != SENTINEL).all()


def test_num_seqs_limits_rows(device):
    case = make_case([(10, 3), (20, 2)], 4, 2, 64, 16, torch.float32, device, num_pad_tokens=0)
    out, _ = run_both(case, num_seqs=1)
    full, _ = run_both(case)
    torch.testing.assert_close(out[:3], full[:3])
    assert (out[3:] == SENTINEL).all()


def test_rejects_bad_input(device):
    case = make_case([(4, 2)], 4, 2, 64, 16, torch.float32, device)
    out = torch.empty_like(case["q"])
    with pytest.raises(ValueError, match="int32"):
        paged_attention(out=out, **{**case, "seq_lens": case["seq_lens"].long()})
    with pytest.raises(ValueError, match="multiple of H_kv"):
        paged_attention(out=out[:, :3], **{**case, "q": case["q"][:, :3]})
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(out=out.half(), **{**case, "q": case["q"].half()})


# ---- the reference pinned against dense attention on one contiguous sequence ----

def _dense(q, k, v, scale, window=None, softcap=None):
    """q [S, H, D], k/v [S, H_kv, D] -> [S, H, D] by explicit fp32 math; SDPA when no window/softcap."""
    S, H, _ = q.shape
    G = H // k.shape[1]
    qh, kh, vh = (x.float().transpose(0, 1) for x in (q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)))
    if window is None and softcap is None:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale).transpose(0, 1)
    s = qh @ kh.transpose(1, 2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(S)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - (window or S + 1))
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vh).transpose(0, 1)


@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 3.0), (20, 3.0)])
@pytest.mark.parametrize("H,H_kv", [(4, 4), (14, 2)])
def test_ref_matches_dense_attention(window, softcap, H, H_kv):
    """A 300-token sequence: prefilled in one step, and in chunks of 128 (chunked prefill) with decode tails."""
    S, D, bs = 300, 32, 16
    case = make_case([(0, S)], H, H_kv, D, bs, torch.float32, "cpu", num_pad_tokens=0, q_mult=2.0)
    q = case["q"]
    pos = torch.arange(S)
    slots = case["block_table"][0, pos // bs].long() * bs + pos % bs
    k = case["k_cache"].view(-1, H_kv, D)[slots]
    v = case["v_cache"].view(-1, H_kv, D)[slots]
    want = _dense(q, k, v, case["scale"], window, softcap)
    out = torch.empty_like(q)
    paged_attention_ref(out=out, **case, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for start, end in [(0, 128), (128, 256), (256, 299), (299, 300)]:  # the same tokens, one chunk per step
        step = dict(case, q=q[start:end], seq_lens=torch.tensor([end], dtype=torch.int32),
                    query_start_loc=torch.tensor([0, end - start], dtype=torch.int32), max_query_len=end - start)
        out = torch.empty_like(q[start:end])
        paged_attention_ref(out=out, **step, sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out, want[start:end], atol=1e-5, rtol=1e-5)
    assert math.isfinite(float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,H_kv", [(4, 2), (9, 3)])
def test_mixed_graph_padding_gives_the_unpadded_bits(device, dtype, H, H_kv):
    """A mixed-step CUDA graph (worker/cuda_graph.py, ``run_mixed``) runs a step of R requests / T tokens on its
    captured (bs, T_pad) shape: trailing requests without queries and seq_len 0, padding tokens T..T_pad-1 in no
    request's range, and max_query_len = T_pad. With a prompt chunk in the step (the prefill tile, whatever the
    length; no KV split) every real row has the unpadded step's bits, and padding rows are not written."""
    reqs = [(30, 1), (0, 37), (50, 20), (9, 1)]
    T, bs, T_pad = 59, 8, 128
    case = make_case(reqs + [(0, 0)] * (bs - len(reqs)), H, H_kv, 64, 16, dtype, device,
                     num_pad_tokens=T_pad - T)
    assert int(case["query_start_loc"][-1]) == T and case["max_query_len"] == 37
    out_pad = torch.full(case["q"].shape, SENTINEL, dtype=dtype, device=device)
    paged_attention(out=out_pad, **{**case, "max_query_len": T_pad})
    R = len(reqs)
    out = torch.full((T,) + tuple(case["q"].shape[1:]), SENTINEL, dtype=dtype, device=device)
    paged_attention(out=out, **{**case, "q": case["q"][:T], "query_start_loc": case["query_start_loc"][:R + 1],
                                "seq_lens": case["seq_lens"][:R], "block_table": case["block_table"][:R]})
    assert torch.equal(out_pad[:T], out)
    assert (out_pad[T:] == SENTINEL).all()
