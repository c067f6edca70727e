"""paged_attention: one causal attention kernel over the paged KV cache for prefill, chunked prefill and decode.

Kernel + launcher + reference, like vLLM's Triton "unified attention". One program owns one tile of query rows of
one request and one KV head, and loops over that request's keys with an online softmax in fp32.

GQA packing: a tile's BLOCK_M rows are (query token, query head of this KV head's group) pairs, so a decode step
of Qwen2.5-7B (28 q heads / 4 KV heads, group 7) puts 7 heads of one token into the M dimension of tl.dot and reads
each K/V tile once per group:

    row m  ->  token  qt * BLOCK_Q + m // GROUP,   q head  kv_head * GROUP + m % GROUP
    BLOCK_Q = BLOCK_M // GROUP tokens per tile; rows m >= BLOCK_Q * GROUP are idle (masked)

Positions of request r after this step (the new tokens' K/V are already in the cache):

    |<------ ctx_len = seq_len - q_len ------>|<------- q_len -------->|
    | cached keys                             | this step's queries    |
    0                                      ctx_len                 seq_len
    query i has position p = ctx_len + i and sees keys 0..p (with sliding window W: p-W+1..p)

Split-KV ("flash decoding"): when the grid is too small to fill the GPU (few requests, decode), each
(request, tile, KV head) is cut into NUM_SPLITS ranges of key tiles, partial (m, l, acc) go to fp32 scratch,
and a second kernel merges them. The split count depends only on host ints, so both paths are CUDA-graph safe.

Short-query steps (speculative decoding's verify steps: every request has at most SHORT_QUERY_MAX = 8 query
tokens, 1 + k proposals) are decode-like: few programs, each walking a whole context. They take a tile of
next_pow2(max_query_len x GROUP) rows (one query tile per request and KV head), decode's long key tiles and
decode's split-KV rule (``SHORT_QUERY_SPLIT``; before issue #21 they got the prefill tile and never split). With
the causal mask each query token of a split sees a different number of keys; a split whose tiles lie past a token's
position leaves that row at m = -inf, l = 0, acc = 0, which the merge weighs 0 (every token sees key 0, in split 0).

FP8 KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2): K/V tiles are loaded as fp8 and upcast to q's dtype
(exact: every fp8 value is an fp16/bf16 value), and the per-layer scales are folded in where they cost one
multiply per program: softmax(q.(k8 * ks) * scale) = softmax(q.k8 * (scale * ks)), and sum_j p_j (v8_j * vs) =
vs * sum_j p_j v8_j, so k_scale joins the softmax scale and v_scale multiplies the accumulator once at the end.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from hayabusa.envs import env_flag
from hayabusa.kernels._triton import cdiv, next_power_of_2, tl, triton
from hayabusa.kernels.pdl import pdl_kwargs, pdl_wait
from hayabusa.kernels.fp8 import check_scale, dequantize_fp8_ref, is_fp8, unit_scale

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_SPLITS = 32
# Short-query steps: max_query_len in 2..SHORT_QUERY_MAX (verify steps of k <= 7 proposals; vLLM's n-gram and
# EAGLE k are 1-7) with max_query_len x GROUP <= SHORT_QUERY_MAX_ROWS (one 64-row tile, the prefill tile's height,
# holds every query row of a request's KV head: GQA groups up to 8 at 8 tokens). Longer queries are prefill.
SHORT_QUERY_MAX = 8
SHORT_QUERY_MAX_ROWS = 64
# A tile of more than 32 rows (GQA group 7 at 5 tokens: 64 rows) pays only while the grid is tiny. Measured on an
# H200 (bench_attention.py --verify, q_len 5, bf16, graph replay, µs old -> new; BENCHMARKS.md session 11): Qwen2.5-7B
# heads at R = 1 (4 programs) 10.6 -> 11.0 at 256 keys, 23.9 -> 11.3 at 700, 124 -> 11.8 at 4,096; at R = 4
# 10.8 -> 24.7 at 256 keys, 24.7 -> 25.5 at 700; at R = 16 10.9 -> 30.2 at 256 keys. 16-row tiles (SmolLM2, group 3)
# won at every R in 1-16 from 700 keys (2.0-11.6x) and lost only at R = 16 with 256 keys (7.3 -> 8.9).
SHORT_QUERY_WIDE_ROWS = 32
SHORT_QUERY_WIDE_MAX_PROGRAMS = 4
# HAYABUSA_SHORT_QUERY_SPLIT=0 in the environment (read at import) or SHORT_QUERY_SPLIT = False (read at call
# time) gives short-query steps the prefill tile and no split-KV again, for A/B runs.
SHORT_QUERY_SPLIT = env_flag("HAYABUSA_SHORT_QUERY_SPLIT", True)


@triton.jit
def _tanh(x):
    # exp form instead of libdevice so it also runs under TRITON_INTERPRET; saturates to +-1, never NaN
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tile_range(qt, q_len, seq_len, window, split,
                BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
                NUM_SPLITS: tl.constexpr):
    """Key tiles [tile_lo, tile_hi) that query tile qt needs (this split's share), and kv_end (exclusive)."""
    ctx_len = seq_len - q_len
    kv_end = ctx_len + tl.minimum(qt * BLOCK_Q + BLOCK_Q, q_len)  # last query position + 1
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(ctx_len + qt * BLOCK_Q - window + 1, 0) // TILE_N
    tile_hi = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)
    return ctx_len, kv_end, tile_lo, tile_hi


@triton.jit
def _load_kv_tile(cache_ptr, bt_row_ptr, tile, kv_end, kv_head, stride_b, stride_s, stride_h, offs_d, d_mask,
                  TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, TRANSPOSED: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """Keys tile*TILE_N .. +TILE_N of one KV head: [D_PAD, TILE_N] if TRANSPOSED else [TILE_N, D_PAD]."""
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    n_mask = offs_n < kv_end
    if BLOCK_SIZE % TILE_N == 0:  # the tile lies inside one cache block: one block-table read
        blk = tl.load(bt_row_ptr + (tile * TILE_N) // BLOCK_SIZE).to(tl.int64)
        in_blk = (tile * TILE_N) % BLOCK_SIZE + tl.arange(0, TILE_N)
    else:  # the tile spans blocks: one block id per key
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_blk = offs_n % BLOCK_SIZE
    rows = blk * stride_b + in_blk * stride_s + kv_head * stride_h  # [TILE_N] int64 element offsets
    if TRANSPOSED:
        ptrs = cache_ptr + rows[None, :] + offs_d[:, None]
        mask = n_mask[None, :] & d_mask[:, None]
    else:
        ptrs = cache_ptr + rows[:, None] + offs_d[None, :]
        mask = n_mask[:, None] & d_mask[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _scores(q, k, offs_n, pos, pre_scale, post_scale, window, bias_ptr, bias_row, bias_len,
            USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, USE_BIAS: tl.constexpr):
    """Scores in log2 units: [BLOCK_M, TILE_N] fp32; if MASKED, -inf where a key is not visible.
    USE_BIAS: + bias[head, query_pos - key_pos] (T5), bias_row [BLOCK_M] int64 = head * stride (-1: idle row)."""
    s = tl.dot(q, k, input_precision="ieee") * pre_scale
    if USE_SOFTCAP:
        s = post_scale * _tanh(s)  # post_scale = softcap * log2(e), pre_scale = scale / softcap
    if USE_BIAS:
        dist = tl.minimum(tl.maximum(pos[:, None] - offs_n[None, :], 0), bias_len - 1)   # [BLOCK_M, TILE_N]
        b = tl.load(bias_ptr + bias_row[:, None] + dist, mask=(bias_row >= 0)[:, None], other=0.0)
        s = s + b * 1.4426950408889634   # to log2 units, like the scores
    if MASKED:
        visible = offs_n[None, :] <= pos[:, None]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc):
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that saw no key yet: exp2(-inf) = 0, no NaN
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_tiles(q, m_i, l_i, acc, tile_start, tile_end, kv_end, pos, kv_head, bt_row_ptr,
                  k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  offs_d, d_mask, pre_scale, post_scale, window, bias_ptr, bias_row, bias_len,
                  TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr,
                  USE_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
                  KV_FP8: tl.constexpr, USE_BIAS: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) over key tiles [tile_start, tile_end).
    With KV_FP8 the tiles are upcast to q's dtype (the scales are applied by the caller)."""
    for tile in range(tile_start, tile_end):
        k = _load_kv_tile(k_cache_ptr, bt_row_ptr, tile, kv_end, kv_head, stride_kb, stride_ks, stride_kh,
                          offs_d, d_mask, TILE_N, BLOCK_SIZE, True, DOT_FP32)
        if KV_FP8:
            k = k.to(q.dtype)
        s = _scores(q, k, tile * TILE_N + tl.arange(0, TILE_N), pos, pre_scale, post_scale, window,
                    bias_ptr, bias_row, bias_len, USE_WINDOW, USE_SOFTCAP, MASKED, USE_BIAS)
        v = _load_kv_tile(v_cache_ptr, bt_row_ptr, tile, kv_end, kv_head, stride_vb, stride_vs, stride_vh,
                          offs_d, d_mask, TILE_N, BLOCK_SIZE, False, DOT_FP32)
        if KV_FP8:
            v = v.to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc)
    return m_i, l_i, acc


# num_q_tiles changes with every step's longest query: not specialized, so a new length never compiles a variant.
@triton.jit(do_not_specialize=["num_q_tiles"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr,                  # [R + 1] int32, [R] int32, [R, max_blocks] int32
    part_acc_ptr, part_m_ptr, part_l_ptr,            # split scratch [T, H, S, D_PAD] / [T, H, S] fp32
    k_scale_ptr, v_scale_ptr,                        # [1] fp32 each, read only when KV_FP8
    bias_ptr, stride_bias, bias_len,                 # [H, bias_len] fp32 position bias, read only when USE_BIAS
    pre_scale, post_scale, window, num_q_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr, USE_BIAS: tl.constexpr = False, ALL_MASKED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    r = tl.program_id(0) // num_q_tiles
    qt = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    if (qt * BLOCK_Q >= q_len) | (seq_len <= 0):  # tile past this request's queries, or an empty row
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

    ctx_len, kv_end, tile_lo, tile_hi = _tile_range(qt, q_len, seq_len, window, split,
                                                    BLOCK_Q, TILE_N, USE_WINDOW, NUM_SPLITS)
    pos = ctx_len + tok
    bias_row = tl.where(row_mask, head.to(tl.int64) * stride_bias, -1)   # [BLOCK_M], -1 = idle row
    bt_row_ptr = bt_ptr + r.to(tl.int64) * stride_bt
    if KV_FP8:  # fold k_scale into the softmax scale (before the soft-cap's tanh, as q.k * scale is)
        pre_scale = pre_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Tiles below full_hi hold only keys <= the tile's first query position: no row needs the causal mask.
    # With a sliding window every tile is masked (simpler; window layers are the minority). ALL_MASKED (batch-
    # invariant mode): every tile too, so a key tile is scored by the one loop body whichever query tile (and so
    # chunking) a row is in: the unmasked body may contract q.k * scale - m into one FMA, the masked one cannot.
    if USE_WINDOW or ALL_MASKED:
        full_hi = tile_lo
    else:
        full_hi = (ctx_len + qt * BLOCK_Q + 1) // TILE_N
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, tile_lo, tl.minimum(tile_hi, full_hi), kv_end, pos, kv_head,
                                  bt_row_ptr, k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                  stride_vb, stride_vs, stride_vh, offs_d, d_mask, pre_scale, post_scale, window,
                                  bias_ptr, bias_row, bias_len,
                                  TILE_N, BLOCK_SIZE, USE_WINDOW, USE_SOFTCAP, False, DOT_FP32, KV_FP8, USE_BIAS)
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, tl.maximum(tile_lo, full_hi), tile_hi, kv_end, pos, kv_head,
                                  bt_row_ptr, k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                  stride_vb, stride_vs, stride_vh, offs_d, d_mask, pre_scale, post_scale, window,
                                  bias_ptr, bias_row, bias_len,
                                  TILE_N, BLOCK_SIZE, USE_WINDOW, USE_SOFTCAP, True, DOT_FP32, KV_FP8, USE_BIAS)
    if KV_FP8:  # v_scale once on the (unnormalised) accumulator; the split merge is linear in acc
        acc = acc * tl.load(v_scale_ptr)

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + (t64 * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:
        idx = (t64 * NUM_HEADS + head) * NUM_SPLITS + split    # [BLOCK_M] (token, head, split)
        tl.store(part_m_ptr + idx, m_i, mask=row_mask)
        tl.store(part_l_ptr + idx, l_i, mask=row_mask)
        tl.store(part_acc_ptr + idx[:, None] * D_PAD + offs_d[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, qsl_ptr, seq_lens_ptr,
    max_query_len, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the attention kernel here (nothing is read before)
    r = tl.program_id(0) // max_query_len
    i = tl.program_id(0) % max_query_len
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    if (i >= q_len) | (seq_len <= 0):  # same rows the attention kernel skipped
        return
    t64 = (q_start + i).to(tl.int64)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    idx = (t64 * NUM_HEADS + h) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + idx, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + idx, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + idx[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max > float("-inf"), m_max, 0.0))  # empty split: m = -inf -> weight 0
    denom = tl.sum(l * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + t64 * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, num_seqs) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [T, H, D] and k_cache == v_cache shape [num_blocks, block_size, H_kv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    H, D, H_kv = q.shape[1], q.shape[2], k_cache.shape[2]
    if k_cache.shape[3] != D or H % H_kv != 0:
        raise ValueError(f"head dims differ or H={H} is not a multiple of H_kv={H_kv}")
    if q.dtype not in _SUPPORTED_DTYPES or q.dtype != out.dtype or k_cache.dtype != v_cache.dtype \
            or not (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(f"q and out need one dtype of {_SUPPORTED_DTYPES}, the caches that dtype or fp8 "
                         f"(float8_e4m3fn / float8_e5m2); got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}, "
                         f"{out.dtype}")
    if out.shape != q.shape or not out.is_contiguous() or q.stride(-1) != 1:
        raise ValueError(f"out must be contiguous with q's shape and q.stride(-1) == 1, got out "
                         f"{tuple(out.shape)} stride {out.stride()}, q stride {q.stride()}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a unit stride on the last dim")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype != torch.int32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be int32 with a unit last stride, got {t.dtype} stride {t.stride()}")
    if (query_start_loc.dim() != 1 or query_start_loc.numel() < num_seqs + 1 or seq_lens.dim() != 1
            or seq_lens.numel() < num_seqs or block_table.dim() != 2 or block_table.shape[0] < num_seqs):
        raise ValueError(f"metadata too short for num_seqs={num_seqs}: query_start_loc "
                         f"{tuple(query_start_loc.shape)}, seq_lens {tuple(seq_lens.shape)}, "
                         f"block_table {tuple(block_table.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def is_short_query(max_query_len: int, group: int, num_programs: int | None = None) -> bool:
    """Whether a step whose longest query has ``max_query_len`` tokens (host int) at GQA group ``group`` runs as a
    short-query step (decode-like tiles and split-KV): 1 < max_query_len <= SHORT_QUERY_MAX, max_query_len x group
    <= SHORT_QUERY_MAX_ROWS, and SHORT_QUERY_SPLIT on; a tile of more than SHORT_QUERY_WIDE_ROWS rows only when the
    unsplit grid (``num_programs`` = requests x KV heads; None: not limited) has at most
    SHORT_QUERY_WIDE_MAX_PROGRAMS programs (the measurement is at SHORT_QUERY_WIDE_ROWS). Host ints only: a CUDA
    graph's capture and replay agree."""
    if not (SHORT_QUERY_SPLIT and 1 < max_query_len <= SHORT_QUERY_MAX
            and max_query_len * group <= SHORT_QUERY_MAX_ROWS):
        return False
    rows = next_power_of_2(max_query_len * group)
    return rows <= SHORT_QUERY_WIDE_ROWS or num_programs is None or num_programs <= SHORT_QUERY_WIDE_MAX_PROGRAMS


def _auto_num_splits(num_programs: int, max_query_len: int, device: torch.device, short_query: bool = False) -> int:
    """Split KV only for decode-only and short-query steps whose grid cannot fill the GPU; aim at about two
    programs per SM.

    Steps with a prefill never split: their grid is large, and each split count is its own compiled variant (a
    server would stall ~1 s compiling one the first time a new mix of lengths arrives). Short-query steps (verify
    steps) have decode's grid, one program per (request, KV head), so they split like decode."""
    if device.type != "cuda" or (max_query_len > 1 and not short_query):
        return 1
    sms = _num_sms(device)
    if num_programs >= sms:
        return 1
    return min(_MAX_SPLITS, next_power_of_2(cdiv(2 * sms, num_programs)))


def _tile_config(max_query_len: int, group: int, d_pad: int, elem_size: int, short_query: bool = False) -> dict:
    """BLOCK_M (rows = tokens x group heads), TILE_N (keys per step), warps, stages; from host ints only.

    Tuned on an H200 (bf16, D=128, block_size 16, graph replay): decode wants long key tiles (TILE_N 128:
    3.9 TB/s at R=64, ctx 2048, against 2.6 with 32); prefill wants BLOCK_M 64 x TILE_N 32, 4 warps, 2 stages
    (about 186 TFLOP/s on 16 x 512 tokens; 8 warps or 3 stages were 20-50% slower). Short-query steps
    (``is_short_query``) get every query row of a request in one tile (BLOCK_M = next_pow2(max_query_len x group),
    at least 16) and decode's key tiles, stages and warps.
    """
    if max_query_len == 1:
        block_m = max(16, next_power_of_2(group))
    elif short_query:
        block_m = max(16, next_power_of_2(max_query_len * group))
    else:  # one prefill tile size whatever the length: a new length compiles no new variant
        block_m = max(64, next_power_of_2(group))
    tile_n, num_stages = (128, 2) if max_query_len == 1 or short_query else (32, 2)
    while tile_n > 16 and 2 * tile_n * d_pad * elem_size * num_stages > 160 * 1024:  # K + V tiles in smem
        tile_n //= 2
    num_warps = 8 if block_m * d_pad >= 64 * 256 else 4
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n, num_warps=num_warps,
                num_stages=num_stages)


# Batch-invariant decode tile (issue #23): a decode-only step (max_query_len 1) whose grid has at least
# BI_DECODE_MIN_PROGRAMS_PER_SM programs (requests x KV heads) per SM takes 16 query rows and one warp instead of the
# mode's 64 rows and 4 warps, at the same TILE_N, where its bits were measured: bf16 / fp16 q and cache (not fp8),
# head dim 64 (d_pad 64), GQA groups up to 7, no sliding window, soft-cap or position bias. Measured on an H200
# (bench_attention.py --bi-tiles, commits 50b9d14 / 04408ba, BENCHMARKS.md "twenty-fifth session", call 2's numbers):
# - bits: a row's output under 16 x 64 / 1 warp equals the mode tile's in every row of both runs (1,920 rows:
#   Qwen2.5-0.5B's heads, D 64, and 7B's, D 128; 64-256 requests), and in the CUDA test on groups 1 / 3 / 4 / 7;
#   with 4 warps (both head shapes) or 2 (7B's) some rows differ (up to 5 of 256: the warps split the key tile, so
#   a row's sums are added in another order);
# - us per layer, 0.5B heads: 256 requests (512 programs), contexts 300-900: 43.2 -> 32.9 (the default decode
#   kernel: 32.4); 192 requests (384 programs) 30.4 -> 31.3 and 128 requests 25.4 -> 24.9 (even); 64 requests,
#   contexts 20-2,000: 40.0 -> 46.4 (too few programs). Hence 3 programs per SM (the engine runs of that session,
#   the bit grid among them, used 2: the tile is the same, only the step sizes that take it differ);
# - 7B heads: 114.5 -> 151 at 256 requests: one warp holds a [16, 128] fp32 accumulator and loads 128-wide rows
#   alone; so D 128 keeps the mode's tile.
BI_DECODE_MIN_PROGRAMS_PER_SM = 3


def batch_invariant_tile_config(group: int, d_pad: int, elem_size: int, decode_programs: int = 0,
                                num_sms: int = 0) -> dict:
    """The tile configuration of batch-invariant mode (``batch_invariant=True``): the same for prefill chunks and
    decode, a function of the model's head shape only. Every query row then walks its keys in TILE_N tiles from
    position 0 with the same tl.dot shapes and the same online-softmax steps (every tile through the masked loop
    body: ALL_MASKED); tiles a row cannot see (past its position, or before its window) add exact zeros (p = 0,
    alpha = 1), so whether the tile is visited (which depends on the other rows of the query tile) changes nothing.

    ``decode_programs`` (a decode-only step's requests x KV heads; 0 for any other step, and for a step with a
    sliding window, soft-cap, position bias or fp8 cache) and ``num_sms``: a decode step with at least
    BI_DECODE_MIN_PROGRAMS_PER_SM programs per SM on 64-dim heads takes the 16-row, one-warp tile that was measured
    to give every row the same bits (see BI_DECODE_MIN_PROGRAMS_PER_SM); host ints only, so a CUDA graph's capture
    and replay agree."""
    tile_n = 64
    while tile_n > 16 and 2 * tile_n * d_pad * elem_size * 2 > 160 * 1024:
        tile_n //= 2
    if (0 < num_sms * BI_DECODE_MIN_PROGRAMS_PER_SM <= decode_programs and d_pad == 64 and group <= 7
            and elem_size == 2):   # measured in bf16 / fp16; fp32's tl.dot is another instruction path
        return dict(BLOCK_M=16, BLOCK_Q=16 // group, TILE_N=tile_n, num_warps=1, num_stages=2)
    block_m = max(64, next_power_of_2(group))
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n,
                num_warps=8 if block_m * d_pad >= 64 * 256 else 4, num_stages=2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    scale: float, max_query_len: int, num_seqs: int | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    *, num_kv_splits: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, position_bias: torch.Tensor | None = None,
                    batch_invariant: bool = False) -> None:
    """Causal attention of this step's queries over the paged KV cache; writes out in place.

    Args:
        q: [T, H, D] fp32/fp16/bf16, stride(-1) == 1 (may be a view into a fused qkv output).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], q's dtype or fp8 (torch.float8_e4m3fn /
            float8_e5m2, read as fp8 * scale), H % H_kv == 0. Must already hold this step's keys/values
            (store_kv runs first). Any block_size >= 1 (typical 16).
        out: [T, H, D] contiguous, same dtype; rows of skipped/padding tokens are left untouched.
        query_start_loc: [R + 1] int32, cumulative query lengths (request r owns tokens qsl[r]..qsl[r+1]-1).
        seq_lens: [R] int32, context length of each request after this step (cached + new tokens).
        block_table: [R, max_blocks] int32; key j of request r is at block block_table[r, j // block_size],
            offset j % block_size.
        scale: softmax scale (usually D ** -0.5).
        max_query_len: host int >= every request's query length; sizes the grid and picks the tile configuration
            (1: decode, up to SHORT_QUERY_MAX: short-query, else prefill; see ``is_short_query``).
        num_seqs: host int R (default query_start_loc.numel() - 1). Rows with seq_len 0 or no queries are skipped.
        sliding_window: W; query at position p sees keys p-W+1 .. p (W keys, itself included; HF / Mistral
            convention, vLLM's window (W-1, 0)). None or <= 0 = full causal.
        softcap: c; scores = c * tanh(scale * q.k / c) before softmax (Gemma 2). None or <= 0 = off.
        num_kv_splits: split-KV count (1 = single pass); None picks one from (R, max_query_len, H_kv) on CUDA:
            decode-only and short-query steps (``is_short_query``: verify steps) split when their grid is smaller
            than the GPU, steps with longer queries never.
        k_scale, v_scale: [1] fp32 device tensors, the fp8 cache's dequantization scales (None = 1.0); read on
            the device (CUDA-graph safe); ignored unless the caches are fp8.
        position_bias: [H, L] fp32 contiguous (T5's relative position bias): bias[h, p - j] is added to the
            score of query head h at position p and key j (before the softmax; distances >= L use column L - 1).
            Not combined with softcap. None = none.
        batch_invariant: one tile configuration for every step (``batch_invariant_tile_config``; large decode
            steps on small heads a smaller tile measured to give the same bits) and no split-KV (num_kv_splits
            ignored): a query row's output bits depend only on its request's queries' positions and K/V, not on
            the other requests nor on how its prompt was chunked.
    Raises:
        ValueError: on a shape, dtype, stride or device mismatch.
    The grid depends only on (num_seqs, max_query_len, H_kv, num_kv_splits), all per-request lengths are read
    on the device, so a captured CUDA graph replays correctly for new lengths and block tables.
    """
    R = query_start_loc.numel() - 1 if num_seqs is None else num_seqs
    _check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, R)
    check_scale("k_scale", k_scale, q.device)
    check_scale("v_scale", v_scale, q.device)
    T, H, D = q.shape
    H_kv = k_cache.shape[2]
    if R <= 0 or T == 0 or max_query_len <= 0:
        return
    use_window = sliding_window is not None and sliding_window > 0
    use_softcap = softcap is not None and softcap > 0
    kv_fp8 = is_fp8(k_cache.dtype)
    use_bias = position_bias is not None
    d_pad = max(16, next_power_of_2(D))
    short_query = not batch_invariant and is_short_query(max_query_len, H // H_kv, R * H_kv)
    if batch_invariant:
        decode = (max_query_len == 1 and q.device.type == "cuda"   # where the small tile was measured
                  and not (use_window or use_softcap or use_bias or kv_fp8))
        cfg = batch_invariant_tile_config(H // H_kv, d_pad, q.element_size(), R * H_kv if decode else 0,
                                          _num_sms(q.device) if decode else 0)
    else:
        cfg = _tile_config(max_query_len, H // H_kv, d_pad, q.element_size(), short_query)
    num_q_tiles = cdiv(max_query_len, cfg["BLOCK_Q"])
    splits = 1 if batch_invariant else (
        num_kv_splits or _auto_num_splits(R * num_q_tiles * H_kv, max_query_len, q.device, short_query))
    if splits > 1:
        part_acc = torch.empty((T, H, splits, d_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out  # unused
    pre_scale = scale / softcap if use_softcap else scale * _LOG2E
    post_scale = softcap * _LOG2E if use_softcap else 1.0
    unit = unit_scale(q.device) if kv_fp8 else seq_lens  # never read unless kv_fp8
    if use_bias and (position_bias.dim() != 2 or position_bias.shape[0] != H or position_bias.dtype != torch.float32
                     or not position_bias.is_contiguous() or use_softcap or position_bias.device != q.device):
        raise ValueError(f"position_bias must be [H={H}, L] fp32 contiguous on q's device, without softcap; got "
                         f"{tuple(position_bias.shape)} {position_bias.dtype}")
    _paged_attn_kernel[(R * num_q_tiles, H_kv, splits)](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, part_acc, part_m, part_l,
        unit if k_scale is None else k_scale, unit if v_scale is None else v_scale,
        position_bias if use_bias else seq_lens, position_bias.stride(0) if use_bias else 0,
        position_bias.shape[1] if use_bias else 1,
        pre_scale, post_scale, sliding_window if use_window else 0, num_q_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        NUM_HEADS=H, GROUP=H // H_kv, HEAD_DIM=D, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1],
        USE_WINDOW=use_window, USE_SOFTCAP=use_softcap, NUM_SPLITS=splits,
        # the CPU interpreter (numpy) computes bf16 tl.dot on raw bits: give it fp32 operands instead
        DOT_FP32=q.dtype == torch.bfloat16 and q.device.type == "cpu", KV_FP8=kv_fp8, USE_BIAS=use_bias,
        ALL_MASKED=batch_invariant, **cfg, **pdl_kwargs(q.device))
    if splits > 1:
        _merge_splits_kernel[(R * max_query_len, H)](
            out, part_acc, part_m, part_l, query_start_loc, seq_lens, max_query_len, out.stride(0), out.stride(1),
            NUM_HEADS=H, HEAD_DIM=D, D_PAD=d_pad, NUM_SPLITS=splits, S_PAD=next_power_of_2(splits),
            num_warps=4, **pdl_kwargs(q.device))


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, lo: int, hi: int, scale) -> torch.Tensor:
    """Keys/values at positions lo..hi-1 of one request: [hi - lo, H_kv, D] fp32 (fp8 caches dequantized)."""
    bs = cache.shape[1]
    first = lo // bs
    blocks = block_row[first: -(-hi // bs)].long()
    if is_fp8(cache.dtype):  # gather through a uint8 view: not every torch build indexes fp8 tensors
        rows = cache.view(torch.uint8)[blocks].view(cache.dtype).flatten(0, 1)[lo - first * bs: hi - first * bs]
        return dequantize_fp8_ref(rows, 1.0 if scale is None else scale)
    return cache[blocks].flatten(0, 1)[lo - first * bs: hi - first * bs].float()


def _attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor,
                seq_len: int, scale: float, window: int, softcap: float, k_scale=None, v_scale=None,
                chunk: int = 256, position_bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention of one request's queries q [q_len, H, D] -> [q_len, H, D] (chunks bound the memory)."""
    q_len, H, D = q.shape
    H_kv = k_cache.shape[2]
    G = H // H_kv
    ctx = seq_len - q_len
    lo = max(0, ctx - window + 1) if window > 0 else 0
    k = gather_kv(k_cache, block_row, lo, seq_len, k_scale).permute(1, 2, 0)  # [H_kv, D, S] fp32
    v = gather_kv(v_cache, block_row, lo, seq_len, v_scale).permute(1, 0, 2)  # [H_kv, S, D] fp32
    key_pos = torch.arange(lo, seq_len, device=q.device)
    out = torch.empty((q_len, H, D), dtype=torch.float32, device=q.device)
    for c0 in range(0, q_len, chunk):
        c1 = min(q_len, c0 + chunk)
        n = c1 - c0
        hi = ctx + c1 - lo  # keys past the chunk's last position are never visible
        pos = torch.arange(ctx + c0, ctx + c1, device=q.device)
        visible = key_pos[None, :hi] <= pos[:, None]  # [n, S']
        if window > 0:
            visible &= key_pos[None, :hi] > pos[:, None] - window
        qh = q[c0:c1].float().reshape(n, H_kv, G, D).permute(1, 2, 0, 3).reshape(H_kv, G * n, D)
        s = torch.bmm(qh, k[:, :, :hi]) * scale  # [H_kv, G * n, S']
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.view(H_kv, G, n, hi)
        if position_bias is not None:  # bias[h, query_pos - key_pos] (clamped to the table: masked anyway)
            dist = (pos[:, None] - key_pos[None, :hi]).clamp(0, position_bias.shape[1] - 1)  # [n, S']
            s = s + position_bias[:, dist].view(H_kv, G, n, hi)
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1).view(H_kv, G * n, hi)
        o = torch.bmm(p, v[:, :hi])  # [H_kv, G * n, D]
        out[c0:c1] = o.view(H_kv, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out


def ref_window_softcap(sliding_window: int | None, softcap: float | None) -> tuple[int, float]:
    """The reference attentions' window and softcap: None or <= 0 -> 0 (off)."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    cap = softcap if softcap is not None and softcap > 0 else 0.0
    return window, cap


def ref_requests(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 num_seqs: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """The reference attentions' per-request walk: (r, q_start, q_end, seq_len) for each request r < R (R =
    num_seqs, or query_start_loc's length - 1) with queries (q_end > q_start, token offsets into q) and a context
    (seq_len > 0, in tokens); other rows (padding) are skipped. Reads query_start_loc [R + 1] / seq_lens [R] on the
    host (a sync on CUDA)."""
    R = query_start_loc.numel() - 1 if num_seqs is None else num_seqs
    qsl = query_start_loc[: R + 1].tolist()
    lens = seq_lens[:R].tolist()
    for r in range(R):
        q_start, q_end, seq_len = qsl[r], qsl[r + 1], lens[r]
        if q_end > q_start and seq_len > 0:
            yield r, q_start, q_end, seq_len


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                        scale: float, max_query_len: int, num_seqs: int | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        *, num_kv_splits: int | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, position_bias: torch.Tensor | None = None) -> None:
    """Plain-torch paged_attention (same arguments and semantics; max_query_len and num_kv_splits are unused).

    A per-request loop that gathers K/V through the block table (fp8 caches dequantized to fp32 as fp8 * scale)
    and runs a masked fp32 softmax; the CPU engine's attention path. Reads query_start_loc / seq_lens on the host
    (a sync on CUDA).
    """
    window, cap = ref_window_softcap(sliding_window, softcap)
    for r, q_start, q_end, seq_len in ref_requests(query_start_loc, seq_lens, num_seqs):
        o = _attend_one(q[q_start:q_end], k_cache, v_cache, block_table[r], seq_len, scale, window, cap,
                        k_scale, v_scale, position_bias=position_bias)
        out[q_start:q_end] = o.to(out.dtype)
