"""paged_attention_bi: batch-invariant mode's attention (``batch_invariant=True``) with split-KV at fixed key
positions.

The mode's contract (kernels/paged_attention.py, ``batch_invariant_tile_config``): a query row's output bits depend
only on its request's K/V and its own position p, never on the other requests of the step, on how its prompt was
chunked, or on whether it was computed in a prefill chunk or in a decode step (a preempted request recomputes its
generated tokens as a prefill; a prefix hit starts a prompt mid-way).

Split-KV without giving that up: split s covers the key tiles [s * SPLIT_TILES, (s + 1) * SPLIT_TILES) -- points
that are key positions, the same for every request, every step and every row -- so a row at position p has the
splits 0 .. n(p) - 1, n(p) = min(cdiv(cdiv(p + 1, TILE_N), SPLIT_TILES), BI_MAX_SPLITS), each split's partial
(m, l, acc) computed by one loop body (``attention_tiles.attend_tiles``, every tile masked) from the empty state,
and the partials merged in split order, one after another (``_merge_step``, elementwise: no reduction tree whose
shape could follow a padded split count):

    keys  |<- split 0 ->|<- split 1 ->|<- split 2 ->| ... |<- split MAX-1: everything from here on ->|
          0          ST*N          2*ST*N                (MAX-1)*ST*N

    split mode  (decode-like steps, few programs): grid (R * q tiles, H_kv, S); program s writes split s's
                partial to fp32 scratch [T, H, S, D_PAD]; a second launch of the same kernel (merge mode) merges
                the partials its query tile needs in split order and writes out.
    inline mode (prefill steps, or enough programs already): grid (R * q tiles, H_kv, 1); the program computes
                its splits one after another and merges each as it goes: the same loop body, the same merge
                step, no scratch.

Prefill steps split too (inline): the contract needs a token's row computed in a prefill chunk to equal the
same token's decode step bit for bit, so both walk the same split points and merge them the same way; inline
mode keeps prefill free of scratch memory (T x H x S x D_PAD fp32 would be ~1 GB for an 8k-token chunk at S = 32)
and of the second launch.

The three modes are one compiled kernel (``mode`` is a runtime int, not specialized), so a split's partial and
the merge are the same instructions in a prefill chunk and in a decode step. A split that is empty for a row (past
its position, or before its sliding window) has m = -inf, l = 0, acc = 0 and its merge step is skipped row-wise
(``tl.where`` on m > -inf): it changes no bit, which is why the padded split count S (a power-of-two bucket of
cdiv(max_seq_len, SPLIT_TILES * TILE_N), capped at BI_MAX_SPLITS: few scratch shapes, and CUDA graphs captured at
max_model_len cover every length) and the number of splits a query tile walks (it is the tile's longest row's)
do not matter.

Why SPLIT_TILES = 4 (256 keys with the mode's TILE_N of 64): W3 on the 0.5b shape (one request, 128 -> 640 keys,
H_kv = 2) gets up to 3 x 2 programs instead of 2 each walking every key; smaller splits add merge work per key
(partials of BLOCK_M x D_PAD fp32 per split) and longer merges, larger ones leave short contexts unsplit.
Beyond BI_MAX_SPLITS splits (32 x 256 = 8,192 keys) the last split takes every remaining key: still a rule of key
positions alone (invariant and exact), only less parallel for very long contexts.
"""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import tl, triton
from hayabusa.kernels.attention_tiles import attend_tiles, batch_invariant_tile_config, check_inputs
from hayabusa.kernels.bi_gemm import num_sms
from hayabusa.kernels.fp8 import is_fp8, unit_scale

_LOG2E = 1.4426950408889634
BI_SPLIT_TILES = 4      # key tiles (of the mode's TILE_N) per split: the split points are multiples of this
BI_MAX_SPLITS = 32      # the last split (index BI_MAX_SPLITS - 1) takes every key from its start on
_INLINE, _SPLIT, _MERGE = 0, 1, 2   # the kernel's runtime modes


@triton.jit
def _merge_step(M, L, ACC, m, l, acc):
    """Fold one split's partial (m, l, acc) [BLOCK_M], [BLOCK_M], [BLOCK_M, D_PAD] into the running (M, L, ACC);
    rows whose split saw no key (m = -inf) keep their state bit for bit."""
    live = m > float("-inf")
    m_new = tl.maximum(M, m)
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    a = tl.exp2(M - m_safe)
    b = tl.exp2(m - m_safe)
    l_new = L * a + l * b
    acc_new = ACC * a[:, None] + acc * b[:, None]
    return tl.where(live, m_new, M), tl.where(live, l_new, L), tl.where(live[:, None], acc_new, ACC)


# num_q_tiles, split_stride and mode change between steps: not specialized, so every step of the mode (prefill,
# decode, merge) runs this one compiled kernel.
@triton.jit(do_not_specialize=["num_q_tiles", "split_stride", "mode"])
def _paged_attn_bi_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr,                   # [R + 1] int32, [R] int32, [R, max_blocks] int32
    part_acc_ptr, part_m_ptr, part_l_ptr,             # scratch [T, H, split_stride, D_PAD] / [T, H, split_stride]
    k_scale_ptr, v_scale_ptr,                         # [1] fp32 each, read only when KV_FP8
    pre_scale, post_scale, window, num_q_tiles, split_stride, mode,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr,
    SPLIT_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    r = tl.program_id(0) // num_q_tiles
    qt = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)                          # 0 unless mode == _SPLIT
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    ctx_len = seq_len - q_len
    kv_end = ctx_len + tl.minimum(qt * BLOCK_Q + BLOCK_Q, q_len)   # last query position of the tile + 1
    tile_hi = tl.cdiv(kv_end, TILE_N)
    n_splits = tl.minimum(tl.cdiv(tile_hi, SPLIT_TILES), MAX_SPLITS)   # the splits of the tile's last row
    if (qt * BLOCK_Q >= q_len) | (seq_len <= 0) | (split >= n_splits):
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    tok = qt * BLOCK_Q + offs_m // GROUP                       # [BLOCK_M] token index inside the request
    head = kv_head * GROUP + offs_m % GROUP                    # [BLOCK_M] query head
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    t64 = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (t64 * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    pos = ctx_len + tok
    tile_lo = 0
    if USE_WINDOW:  # tiles before the tile's first row's window are invisible to every row of it
        tile_lo = tl.maximum(ctx_len + qt * BLOCK_Q - window + 1, 0) // TILE_N
    bt_row_ptr = bt_ptr + r.to(tl.int64) * stride_bt
    if KV_FP8:  # fold k_scale into the softmax scale (before the soft-cap's tanh, as q.k * scale is)
        pre_scale = pre_scale * tl.load(k_scale_ptr)
    part = (t64 * NUM_HEADS + head) * split_stride             # [BLOCK_M] int64: (token, head) row of scratch

    s_begin = tl.where(mode == 1, split, 0)                    # _SPLIT: this program's split only
    s_end = tl.where(mode == 1, split + 1, n_splits)
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    ACC = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for s in range(s_begin, s_end):
        if mode == 2:  # _MERGE: split s's partials, as the _SPLIT launch wrote them
            m_s = tl.load(part_m_ptr + part + s, mask=row_mask, other=float("-inf"))
            l_s = tl.load(part_l_ptr + part + s, mask=row_mask, other=0.0)
            acc_s = tl.load(part_acc_ptr + (part + s)[:, None] * D_PAD + offs_d[None, :], mask=row_mask[:, None],
                            other=0.0)
        else:
            lo = tl.maximum(tile_lo, s * SPLIT_TILES)
            hi = tl.where(s < MAX_SPLITS - 1, tl.minimum(tile_hi, s * SPLIT_TILES + SPLIT_TILES), tile_hi)
            m_s = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_s = tl.zeros([BLOCK_M], tl.float32)
            acc_s = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            # every tile through the masked body (the mode's ALL_MASKED): one loop body for every row
            m_s, l_s, acc_s = attend_tiles(q, m_s, l_s, acc_s, lo, hi, kv_end, pos, kv_head, bt_row_ptr,
                                           k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                           stride_vb, stride_vs, stride_vh, offs_d, d_mask, pre_scale, post_scale,
                                           window, seq_lens_ptr, offs_m, 1,
                                           TILE_N, BLOCK_SIZE, USE_WINDOW, USE_SOFTCAP, True, DOT_FP32, KV_FP8,
                                           False)
            if KV_FP8:  # v_scale on the (unnormalised) accumulator; the merge is linear in acc
                acc_s = acc_s * tl.load(v_scale_ptr)
        if mode == 1:
            tl.store(part_m_ptr + part + s, m_s, mask=row_mask)
            tl.store(part_l_ptr + part + s, l_s, mask=row_mask)
            tl.store(part_acc_ptr + (part + s)[:, None] * D_PAD + offs_d[None, :], acc_s, mask=row_mask[:, None])
        else:
            M, L, ACC = _merge_step(M, L, ACC, m_s, l_s, acc_s)
    if mode != 1:
        o = ACC / tl.where(L > 0.0, L, 1.0)[:, None]
        o_ptrs = out_ptr + (t64 * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def bi_num_splits(max_seq_len: int, tile_n: int) -> int:
    """The split launch's padded split count S: the power of two >= cdiv(max_seq_len, BI_SPLIT_TILES * tile_n),
    at most BI_MAX_SPLITS (host ints only)."""
    need = triton.cdiv(max(int(max_seq_len), 1), BI_SPLIT_TILES * tile_n)
    return min(BI_MAX_SPLITS, triton.next_power_of_2(need))


def paged_attention_bi(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       scale: float, max_query_len: int, num_seqs: int | None = None,
                       sliding_window: int | None = None, softcap: float | None = None,
                       *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                       max_seq_len: int | None = None, split: bool | None = None) -> None:
    """``paged_attention(..., batch_invariant=True)``: the same arguments and output (out [T, H, D] written in
    place), rows' bits independent of the batch and of prefill / decode (module docstring).

    Args (beyond paged_attention's):
        max_seq_len: host int >= every seq_len of the step (None: the block table's capacity, block_table.shape[1]
            x block_size); sizes the split launch's grid and scratch only. Smaller than a seq_len: wrong output.
        split: True = split mode (S programs per query tile + a merge launch), False = inline (one program per
            query tile walks its splits); None picks split for steps of one query tile per request whose grid
            (R x H_kv) leaves SMs idle. Both give the same bits.
    Raises:
        ValueError: on bad tensors (paged_attention's checks) or a max_seq_len < 1.
    """
    R = query_start_loc.numel() - 1 if num_seqs is None else num_seqs
    check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, R)
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    T, H, D = q.shape
    H_kv = k_cache.shape[2]
    if R <= 0 or T == 0 or max_query_len <= 0:
        return
    use_window = sliding_window is not None and sliding_window > 0
    use_softcap = softcap is not None and softcap > 0
    d_pad = max(16, triton.next_power_of_2(D))
    cfg = batch_invariant_tile_config(H // H_kv, d_pad, q.element_size())
    num_q_tiles = triton.cdiv(max_query_len, cfg["BLOCK_Q"])
    if split is None:
        split = num_q_tiles == 1 and R * H_kv < num_sms(q.device)
    S = bi_num_splits(block_table.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len,
                      cfg["TILE_N"]) if split else 1
    if split:
        part_acc = torch.empty((T, H, S, d_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((T, H, S), dtype=torch.float32, device=q.device)
        part_l = torch.empty((T, H, S), dtype=torch.float32, device=q.device)
    else:  # never read or written in inline mode, but fp32: the kernel's merge-mode loads (compiled whatever the
        # runtime mode) must see fp32 pointers, and one pointer signature keeps one compiled kernel for every mode
        part_acc = part_m = part_l = torch.empty(1, dtype=torch.float32, device=q.device)
    kv_fp8 = is_fp8(k_cache.dtype)
    unit = unit_scale(q.device) if kv_fp8 else seq_lens  # never read unless kv_fp8
    args = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, part_acc, part_m, part_l,
            unit if k_scale is None else k_scale, unit if v_scale is None else v_scale,
            scale / softcap if use_softcap else scale * _LOG2E, softcap * _LOG2E if use_softcap else 1.0,
            sliding_window if use_window else 0, num_q_tiles, S)
    rest = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0))
    meta = dict(NUM_HEADS=H, GROUP=H // H_kv, HEAD_DIM=D, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1],
                USE_WINDOW=use_window, USE_SOFTCAP=use_softcap,
                # the CPU interpreter (numpy) computes bf16 tl.dot on raw bits: give it fp32 operands instead
                DOT_FP32=q.dtype == torch.bfloat16 and q.device.type == "cpu", KV_FP8=kv_fp8,
                SPLIT_TILES=BI_SPLIT_TILES, MAX_SPLITS=BI_MAX_SPLITS, **cfg)
    if split:
        _paged_attn_bi_kernel[(R * num_q_tiles, H_kv, S)](*args, _SPLIT, *rest, **meta)
        _paged_attn_bi_kernel[(R * num_q_tiles, H_kv, 1)](*args, _MERGE, *rest, **meta)
    else:
        _paged_attn_bi_kernel[(R * num_q_tiles, H_kv, 1)](*args, _INLINE, *rest, **meta)


__all__ = ["paged_attention_bi", "bi_num_splits", "BI_SPLIT_TILES", "BI_MAX_SPLITS"]
