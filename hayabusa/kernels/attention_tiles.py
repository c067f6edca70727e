"""attention_tiles: the pieces both paged attention kernels share: the key-tile loop (load a K / V tile through the
block table, score it, one online-softmax step), the launchers' input checks, and the batch-invariant mode's one
tile configuration. kernels/paged_attention.py (the default kernel) and kernels/paged_attention_bi.py (the mode's
split-KV kernel) import them; the math is described in paged_attention.py's module docstring."""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import tl, triton
from hayabusa.kernels.fp8 import is_fp8

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

@triton.jit
def _tanh(x):
    # exp form instead of libdevice so it also runs under TRITON_INTERPRET; saturates to +-1, never NaN
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


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
def attend_tiles(q, m_i, l_i, acc, tile_start, tile_end, kv_end, pos, kv_head, bt_row_ptr,
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


def check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, num_seqs) -> None:
    """The paged attention launchers' argument checks (shapes, dtypes, strides, one device); ValueError."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [T, H, D] and k_cache == v_cache shape [num_blocks, block_size, H_kv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    H, D, H_kv = q.shape[1], q.shape[2], k_cache.shape[2]
    if k_cache.shape[3] != D or H % H_kv != 0:
        raise ValueError(f"head dims differ or H={H} is not a multiple of H_kv={H_kv}")
    if q.dtype not in SUPPORTED_DTYPES or q.dtype != out.dtype or k_cache.dtype != v_cache.dtype \
            or not (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(f"q and out need one dtype of {SUPPORTED_DTYPES}, the caches that dtype or fp8 "
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


def batch_invariant_tile_config(group: int, d_pad: int, elem_size: int) -> dict:
    """The one tile configuration of batch-invariant mode (``batch_invariant=True``): the same for prefill
    chunks and decode, a function of the model's head shape only. Every query row then walks its keys in TILE_N
    tiles from position 0, in splits of fixed key positions merged in order (kernels/paged_attention_bi.py), with
    the same tl.dot shapes and the same online-softmax steps (every tile through the masked loop body); tiles a
    row cannot see (past its position, or before its window) add exact zeros (p = 0, alpha = 1), so whether the
    tile is visited (which depends on the other rows of the query tile) changes nothing."""
    block_m = max(64, triton.next_power_of_2(group))
    tile_n = 64
    while tile_n > 16 and 2 * tile_n * d_pad * elem_size * 2 > 160 * 1024:
        tile_n //= 2
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n,
                num_warps=8 if block_m * d_pad >= 64 * 256 else 4, num_stages=2)


__all__ = ["attend_tiles", "batch_invariant_tile_config", "check_inputs", "SUPPORTED_DTYPES"]
