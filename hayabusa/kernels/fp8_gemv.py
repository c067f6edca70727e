"""fp8_small_m_linear: FP8 W8A8 for a few rows (decode), the per-token activation quantization fused in (kernel +
launcher + reference).

    y [M, N] = (q(x) [M, K] @ w_q[:N, :K]^T) * s_x [M, 1] * s_w [1, N]   (+ bias), cast to x's dtype

with q(x), s_x exactly per_token_quant_fp8's (kernels/fp8_quant.py): s_x[m] = max(amax(|x[m, :]|) / 448, MIN_SCALE)
(IEEE division) or one static scale; q = e4m3(clamp(x / s_x, -448, 448)), round to nearest even. The engine's
other FP8 path is per_token_quant_fp8 + torch._scaled_mm: two launches per linear, and at M = 1-16 cuBLAS /
CUTLASS's FP8 GEMMs stream the weights far below bandwidth (issue #25: batch-1 decode of a 7B model slower in FP8
than in bf16). Here one launch reads each e4m3 weight once:

  * every program computes the amax of its rows over the WHOLE row itself (x rows are small, K <= ~19k, and stay
    in L2), then quantizes only its K slice: no separate quantize launch and no x_q round trip through memory;
  * "gemv" (decode's 1-4 rows): one program per (row, N tile, K split), _fp8_gemv_kernel. Bandwidth-bound, so
    built for bytes in flight: each thread loads 16 contiguous e4m3 (one 16-byte load) per vector, a tile
    [BLOCK_N, BLOCK_K] is 4-8 such loads per thread, and the fp32 products (exact: e4m3 x e4m3) are summed inside
    the thread every step, so the accumulator is 16x smaller than the tile and 16-32 KB tiles fit the registers
    (the first version kept one fp32 per weight of the tile: 8 KB tiles, two loads per thread, ~36 % of HBM
    bandwidth at batch 1). The rows of one weight tile are neighbours in launch order (later rows hit L2);
  * "dot" (more rows, up to FP8_SMALL_M_MAX): one 16-row tile per program, tl.dot of fp16 operands
    (_fp8_dot_kernel): e4m3 values are exact in fp16, so the products are exact and the tensor cores only change
    the fp32 summation order;
  * split-K spreads a narrow N over the SMs: the fp32 partials (already times s_x and s_w) go to a workspace
    [splits, M, N]; the last program of each output tile to finish (a per-tile counter, reset by that program, so
    CUDA-graph replays need no memset) adds them in split order (+ bias): splitk_reduce's sum, without its launch;
    deterministic, unlike atomics on the output.

The launch comes from FP8_TABLE, keyed by (shape class, M bucket), no autotune (CUDA-graph safe, the same every
run): pick_fp8_config; retune with ``benchmarks/kernels/bench_quant_linear.py --fp8 --sweep``.
The weight is the layer's stored [N', K'] e4m3 (row-major, K contiguous: what ``_scaled_mm`` takes as ``.t()``;
N', K' >= N, K, zero padding ignored): no second copy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from hayabusa.kernels._triton import cdiv, next_power_of_2, tl, triton
from hayabusa.kernels.pdl import pdl_kwargs, pdl_wait
from hayabusa.kernels.fp8 import FP8_FORMATS, round_to_fp8_grid
from hayabusa.kernels.fp8_quant import FP8_DTYPE, MIN_SCALE, per_token_quant_fp8_ref
from hayabusa.kernels.per_token_quant import check_per_token_quant_inputs
from hayabusa.kernels.quant_linear import (
    LaunchConfig, device_limits, gemm_shape_class, split_k_for, splitk_epilogue, splitk_reduce,
)

# Rows up to here run this kernel (Fp8LinearMethod.apply on CUDA); more rows: per_token_quant_fp8 + _scaled_mm.
# 16: one tl.dot tile; decode batches of 1-16 are where _scaled_mm is far below bandwidth (issue #25). Not yet
# measured against _scaled_mm at 5-16 rows: `bench_quant_linear.py --fp8` prints the crossover; lower it there.
# Measured 2026-12-02 (FP8_TABLE's note): the fused kernel wins at M = 1 only, _scaled_mm at M = 4 and 16 for every
# 7B layer (M = 2, 3 not measured); lowering this to 1 awaits the lead's engine-level A/B.
FP8_SMALL_M_MAX = 16
# e4m3 weights per thread and vector of the GEMV: one 16-byte load
_VEC = 16
# x elements one step of the amax prologue holds (BLOCK_M x AMAX_BLOCK): 32 per thread for the 8-warp GEMV
_MAX_AMAX_ELEMS = 8192
# The prologue's steps are unrolled (every load in flight at once) while a thread holds at most this many x
# elements in all (7B at M = 1: K = 3584 -> 16, K = 18944 -> 96); a loop beyond (16-row tiles)
_AMAX_UNROLL_ELEMS = 128
# Split-K partials summed by the last program of each tile (True) or by splitk_reduce's second launch (False):
# the same sum in the same order, so the same bits; read per call (A/B runs and tests)
USE_FUSED_REDUCE = True
FP8_MAX, _MANT, _EMIN = FP8_FORMATS[FP8_DTYPE]          # 448.0, 3, -6


@triton.jit
def _amax_step(acc, x_ptr, rows, m_mask, stride_xm, K, k0, offs):
    cols = k0 + offs
    xk = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :],
                 other=0.0).to(tl.float32)
    return tl.maximum(acc, tl.abs(xk))


@triton.jit
def _row_scales(x_ptr, rows, m_mask, stride_xm, K, scale_ptr, STATIC: tl.constexpr, XQ: tl.constexpr,
                BLOCK_M: tl.constexpr, AMAX_BLOCK: tl.constexpr, AMAX_ITERS: tl.constexpr,
                AMAX_UNROLL: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """s [BLOCK_M] fp32: per_token_quant_fp8's scale of each row, from the amax over all K columns (or static; or,
    XQ, the producer's scales [M, 1] at scale_ptr). AMAX_UNROLL: the AMAX_ITERS chunks unrolled, every chunk's
    load in flight at once: the prologue then costs about one L2 latency before the weights stream, not one per
    chunk."""
    if XQ:
        s = tl.load(scale_ptr + rows, mask=m_mask, other=1.0)
    elif STATIC:
        s = tl.load(scale_ptr + tl.zeros([BLOCK_M], dtype=tl.int32))
    else:
        offs = tl.arange(0, AMAX_BLOCK)
        acc = tl.zeros([BLOCK_M, AMAX_BLOCK], dtype=tl.float32)
        if AMAX_UNROLL:
            for i in tl.static_range(AMAX_ITERS):
                acc = _amax_step(acc, x_ptr, rows, m_mask, stride_xm, K, i * AMAX_BLOCK, offs)
        else:
            for k0 in range(0, K, AMAX_BLOCK):
                acc = _amax_step(acc, x_ptr, rows, m_mask, stride_xm, K, k0, offs)
        amax = tl.max(acc, axis=1)                                   # a max: the same in any order
        # div_rn: IEEE division, as per_token_quant_fp8 and the torch reference
        s = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    return s


@triton.jit
def _quantize(x, s, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr,
              SOFT_ROUND: tl.constexpr):
    """fp32 x divided by its row's scale s (broadcast), clamped, rounded to e4m3: per_token_quant_fp8's bits."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
    if SOFT_ROUND:  # the CPU interpreter's fp8 cast does not round correctly (kernels/fp8.py); on-grid is exact
        q = round_to_fp8_grid(q, FP8_MANT, FP8_EMIN)
    return q.to(tl.float8e4nv)


@triton.jit
def splitk_finish(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, lock_ptr, tile, pid_k, splits,
                   M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr):
    """acc [BM, BN] fp32 -> out (+ bias, cast); with split-K the fp32 partial of split pid_k goes to the workspace
    [splits, M, N] and, FUSED_REDUCE, the tile's last program to arrive (a counter per tile, lock_ptr[tile], reset
    by that program: zero again for the next launch, so CUDA-graph replays need no memset) adds the partials in
    split order (+ bias), exactly splitk_reduce's sum: the same bits, without its launch."""
    if not SPLIT or not FUSED_REDUCE:
        splitk_epilogue(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                        HAS_BIAS, SPLIT)
    else:
        mask = m_mask[:, None] & n_mask[None, :]
        part = part_ptr + rows[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()                     # every thread's partial stored before the release below
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:             # the last split: every other partial is visible (acquire)
            tl.debug_barrier()
            total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                     mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _gemv_row(acc, w, x_ptr, row, M, stride_xm, kk, k0, k_mask, s, XQ: tl.constexpr, FP8_MAX: tl.constexpr,
              FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """acc [BN, BJ] += the exact products of one x row's quantized [BJ, VEC] slice (XQ: loaded as the producer
    quantized it) with the weight tile, summed over each thread's VEC (in-thread adds)."""
    x = tl.load(x_ptr + row * stride_xm + k0 + kk, mask=k_mask & (row < M), other=0.0)
    if XQ:
        q = x                                                                             # [BJ, VEC] e4m3
    else:
        q = _quantize(x.to(tl.float32), s, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)       # [BJ, VEC] e4m3
    return acc + tl.sum(w * q.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _pick(v, idx, i):
    """v [BM] -> its element i (a scalar)."""
    return tl.sum(tl.where(idx == i, v, 0.0), axis=0)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, sw_ptr, bias_ptr, scale_ptr, out_ptr, part_ptr, lock_ptr,
                     M, N, K, k_per_split, splits, stride_xm, stride_wn, stride_om,
                     STATIC: tl.constexpr, XQ: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     FUSED_REDUCE: tl.constexpr, VEC_MASK: tl.constexpr, SOFT_ROUND: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                     AMAX_BLOCK: tl.constexpr, AMAX_ITERS: tl.constexpr, AMAX_UNROLL: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                     FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    # grid (row tiles of BLOCK_M <= 4 rows, N tiles, K splits). The weight tile is [BLOCK_N, BLOCK_K / VEC, VEC]:
    # VEC = 16 contiguous e4m3 per thread (one 16-byte load), loaded once per step for all the program's rows (one
    # accumulator each, unrolled: rows read the weights once, not once per row), and each row's products summed
    # inside the thread, so an accumulator is BLOCK_K / VEC times smaller than the tile and a tile of 8-32 KB (2-8
    # loads per thread in flight) fits the registers.
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    idx = tl.arange(0, BLOCK_M)
    rows = row0 + idx                                                                     # [BM]
    m_mask = rows < M
    s = _row_scales(x_ptr, rows, m_mask, stride_xm, K, scale_ptr, STATIC, XQ, BLOCK_M, AMAX_BLOCK, AMAX_ITERS,
                    AMAX_UNROLL, FP8_MAX, MIN_SCALE)                                      # [BM] fp32
    s0 = _pick(s, idx, 0)
    s1 = _pick(s, idx, 1)
    s2 = _pick(s, idx, 2)
    s3 = _pick(s, idx, 3)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    BJ: tl.constexpr = BLOCK_K // VEC
    kj = tl.arange(0, BJ)[:, None] * VEC                                                  # [BJ, 1]
    kk = kj + tl.arange(0, VEC)[None, :]                                                  # [BJ, VEC]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_tile = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn + kk[None, :, :]      # [BN, BJ, VEC]: W [N', K']
    acc0 = tl.zeros([BLOCK_N, BJ], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BJ], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BJ], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BJ], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if VEC_MASK:  # K % VEC == 0: whole vectors in or out (the mask is constant over a vector: 16-byte loads)
            k_mask = (k0 + kj) < k_end                                                    # [BJ, 1]
        else:
            k_mask = (k0 + kk) < k_end                                                    # [BJ, VEC]
        w = tl.load(w_tile + k0, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0).to(tl.float32)
        acc0 = _gemv_row(acc0, w, x_ptr, row0, M, stride_xm, kk, k0, k_mask, s0, XQ, FP8_MAX, FP8_MANT, FP8_EMIN,
                         SOFT_ROUND)
        if BLOCK_M > 1:
            acc1 = _gemv_row(acc1, w, x_ptr, row0 + 1, M, stride_xm, kk, k0, k_mask, s1, XQ, FP8_MAX, FP8_MANT,
                             FP8_EMIN, SOFT_ROUND)
        if BLOCK_M > 2:
            acc2 = _gemv_row(acc2, w, x_ptr, row0 + 2, M, stride_xm, kk, k0, k_mask, s2, XQ, FP8_MAX, FP8_MANT,
                             FP8_EMIN, SOFT_ROUND)
            acc3 = _gemv_row(acc3, w, x_ptr, row0 + 3, M, stride_xm, kk, k0, k_mask, s3, XQ, FP8_MAX, FP8_MANT,
                             FP8_EMIN, SOFT_ROUND)
    r = idx[:, None]
    acc = tl.where(r == 0, tl.sum(acc0, axis=1)[None, :], 0.0)                            # [BM, BN]
    if BLOCK_M > 1:
        acc = tl.where(r == 1, tl.sum(acc1, axis=1)[None, :], acc)
    if BLOCK_M > 2:
        acc = tl.where(r == 2, tl.sum(acc2, axis=1)[None, :], acc)
        acc = tl.where(r == 3, tl.sum(acc3, axis=1)[None, :], acc)
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * s[:, None] * sw[None, :]            # (acc * s_x) * s_w: fp8_matmul_emulated's order
    splitk_finish(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, lock_ptr,
                   tl.program_id(0) * tl.num_programs(1) + pid_n, pid_k, splits, M, N, stride_om, HAS_BIAS, SPLIT,
                   FUSED_REDUCE)


@triton.jit
def dot_tile_setup(x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The 16-row tl.dot kernels' program (this module's and kernels/small_m_linear.py's), grid (row tiles, N
    tiles, K splits), row tiles varying fastest so the programs sharing a weight tile run together: (pid_m, pid_n,
    pid_k, rows [BM] int64, m_mask, offs_n [BN], n_mask, k_start, k_end, w_cols [1, BN] pointers into W [N', K'],
    x_rows [BM, 1] pointers into x)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    return pid_m, pid_n, pid_k, rows, rows < M, offs_n, offs_n < N, k_start, k_end, w_cols, x_rows


@triton.jit
def load_w_tile(w_cols, offs_k, k_end, n_mask, EVEN_K: tl.constexpr):
    """The weight tile [BK, BN] at columns offs_k (EVEN_K: every tile whole, no column mask)."""
    if EVEN_K:
        w = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :], other=0.0)
    else:
        w = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :] & (offs_k < k_end)[:, None], other=0.0)
    return w


@triton.jit
def load_x_tile(x_rows, offs_k, k_end, m_mask, EVEN_K: tl.constexpr):
    """The x tile [BM, BK] at columns offs_k (EVEN_K: every tile whole, no column mask)."""
    if EVEN_K:
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < k_end)[None, :], other=0.0)
    return x


@triton.jit
def _fp8_tile_dot(acc, x, w, s, XQ: tl.constexpr, DOT_FP32: tl.constexpr, FP8_MAX: tl.constexpr,
                  FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """acc [BM, BN] + q(x) [BM, BK] @ w [BK, BN]: x as its producer quantized it (XQ) or quantized here with its
    rows' scales s [BM]; e4m3 operands are exact in fp16 (exact products, fp32 sums), fp32 in the interpreter."""
    if XQ:
        q = x                                                                             # [BM, BK] e4m3
    else:
        q = _quantize(x.to(tl.float32), s[:, None], FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
    if DOT_FP32:  # the interpreter (numpy): fp32 operands, exact products as well
        acc = tl.dot(q.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:         # e4m3 values are exact in fp16: exact products, fp32 sums
        acc = tl.dot(q.to(tl.float16), w.to(tl.float16), acc)
    return acc


@triton.jit
def _fp8_dot_kernel(x_ptr, w_ptr, sw_ptr, bias_ptr, scale_ptr, out_ptr, part_ptr, lock_ptr,
                    M, N, K, k_per_split, splits, stride_xm, stride_wn, stride_om,
                    STATIC: tl.constexpr, XQ: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                    FUSED_REDUCE: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_ROUND: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    AMAX_BLOCK: tl.constexpr, AMAX_ITERS: tl.constexpr, AMAX_UNROLL: tl.constexpr,
                    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                    FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, PDL: tl.constexpr = False):
    pid_m, pid_n, pid_k, rows, m_mask, offs_n, n_mask, k_start, k_end, w_cols, x_rows = dot_tile_setup(
        x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N)
    if PDL:
        # kernels/pdl.py: the first weight tile is loaded BEFORE waiting for the previous kernel (no kernel of the
        # step writes weights), x, its scales, the workspace and the counters only after the wait; every split has
        # at least one tile and the tiles are summed in the same order: the same bits as without PDL
        offs_k0 = k_start + tl.arange(0, BLOCK_K)
        w0 = load_w_tile(w_cols, offs_k0, k_end, n_mask, EVEN_K)
        pdl_wait(PDL)
    s = _row_scales(x_ptr, rows, m_mask, stride_xm, K, scale_ptr, STATIC, XQ, BLOCK_M, AMAX_BLOCK, AMAX_ITERS,
                    AMAX_UNROLL, FP8_MAX, MIN_SCALE)                                                   # [BM] fp32
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_loop = k_start
    if PDL:
        x0 = load_x_tile(x_rows, offs_k0, k_end, m_mask, EVEN_K)
        acc = _fp8_tile_dot(acc, x0, w0, s, XQ, DOT_FP32, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
        k_loop = k_start + BLOCK_K
    for k0 in range(k_loop, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = load_w_tile(w_cols, offs_k, k_end, n_mask, EVEN_K)                               # [BK, BN] e4m3
        x = load_x_tile(x_rows, offs_k, k_end, m_mask, EVEN_K)                               # [BM, BK]
        acc = _fp8_tile_dot(acc, x, w, s, XQ, DOT_FP32, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * s[:, None] * sw[None, :]            # (acc * s_x) * s_w: fp8_matmul_emulated's order
    splitk_finish(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, lock_ptr,
                   pid_m * tl.num_programs(1) + pid_n, pid_k, splits, M, N, stride_om, HAS_BIAS, SPLIT,
                   FUSED_REDUCE)


# Launches keyed by (shape class, M bucket): gemm_shape_class(N, K) ("square": attention's qkv / o, "wide": an
# MLP's gate_up, "deep": its down) and the smallest FP8_M_BUCKETS entry >= M. Values: (kind "gemv" | "dot",
# BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); SPLIT_K 0 = as many K splits as bring the programs
# to FP8_AUTO_SPLIT_WAVES per SM (split_k_for). "gemv" holds BLOCK_M <= 4 rows per program.
# Measured on an H200 (2026-12-02, two runs of `bench_quant_linear.py --fp8 --sweep --m 1,4,16`, 7B layers,
# CUDA-graph us; the literal below is the second run's, whose best agree with the first's within ~5 % run-to-run
# noise): M = 1 qkv 9.6, o 8.2, gate_up 44.8-48.0 (69-73 % of a same-size copy), down 28.9-31.5 (54-58 %), the
# first version 10.2 / 8.5 / 49.3 / 31.9 with its launches (and 134 us a layer in the profiled decode step, with
# the splitk_reduce launches this drops). M = 4: the 4-row GEMV is ALU-bound (each row quantizes its x slice in
# every program: IEEE divisions) and M = 16 the dot tiles: both slower than per_token_quant_fp8 + _scaled_mm
# there (gate_up M = 4 155 us vs 50; M = 16 110 vs 49): see FP8_SMALL_M_MAX.
FP8_M_BUCKETS = (1, 4, 16)
FP8_AUTO_SPLIT_WAVES = 4
FP8_TABLE: dict[tuple[str, int], tuple[str, int, int, int, int, int, int]] = {
    ('deep', 1): ('gemv', 1, 32, 512, 4, 8, 1),
    ('deep', 4): ('gemv', 4, 32, 256, 2, 4, 1),
    ('deep', 16): ('dot', 16, 128, 128, 8, 8, 3),
    ('square', 1): ('gemv', 1, 32, 256, 8, 4, 1),
    ('square', 4): ('gemv', 4, 32, 256, 4, 4, 1),
    ('square', 16): ('dot', 16, 128, 128, 8, 8, 3),
    ('wide', 1): ('gemv', 1, 16, 512, 1, 4, 1),
    ('wide', 4): ('gemv', 4, 32, 256, 1, 4, 1),
    ('wide', 16): ('dot', 16, 64, 256, 1, 8, 3),
}

# The launches for an x already quantized (XQ: by its producer, rms_norm_quant / silu_and_mul_quant, or by
# per_token_quant_fp8): no amax prologue and no per-program quantization, so the weights start streaming at once and
# the 16-row tl.dot tile is no longer bound by its divisions, at one row too (15 rows masked). Measured on an H200
# (2026-12-03, `bench_quant_linear.py --fp8 --sweep --m 1,4,16`, 7B layers, CUDA-graph us,
# benchmarks/results/2026-12-03_h200_df2f410.fp8_sweep.json), this table's launch at M = 1 / 4 / 16: qkv 6.8 / 6.8 /
# 7.2, o 6.2 / 6.2 / 6.7, gate_up 34.0 / 34.5 / 35.0 (97 / 96 / 95 % of a same-size copy), down 20.6 / 21.0 / 21.8
# (83 / 81 / 79 %); against the kernel quantizing x itself (FP8_TABLE) 9.4 / 24.0 / 18.3, 8.2 / 16.9 / 18.0, 47.6 /
# 155.7 / 109.8, 31.3 / 99.6 / 71.3, per_token_quant_fp8 + _scaled_mm 15.0-15.3, 14.9-15.2, 48.8-50.1, 53.4-53.7 and
# bf16 cuBLAS 7.6-8.8, 8.0-9.1, 68.8-71.7, 38.9-40.9.
FP8Q_TABLE: dict[tuple[str, int], tuple[str, int, int, int, int, int, int]] = {
    ('deep', 1): ('dot', 16, 64, 256, 8, 4, 3),
    ('deep', 4): ('dot', 16, 64, 256, 8, 4, 3),
    ('deep', 16): ('dot', 16, 32, 128, 8, 4, 3),
    ('square', 1): ('dot', 16, 64, 128, 8, 4, 3),
    ('square', 4): ('dot', 16, 64, 128, 8, 4, 3),
    ('square', 16): ('dot', 16, 64, 128, 8, 4, 3),
    ('wide', 1): ('dot', 16, 32, 128, 1, 4, 3),
    ('wide', 4): ('dot', 16, 64, 256, 1, 4, 3),
    ('wide', 16): ('dot', 16, 64, 128, 1, 4, 3),
}
# A tuned table from a GPU's sweep (bench_quant_linear.py --fp8 --sweep --table-json PATH) replaces these entries
# at import when HAYABUSA_FP8_TABLE_JSON names it: a device's own tuning, as vLLM's per-GPU kernel config files.
FP8_TABLE_JSON_ENV = "HAYABUSA_FP8_TABLE_JSON"


def load_launch_tables(path: str, tables: dict[str, dict], env: str | None = None,
                       writer: str = "bench_quant_linear.py --fp8 --sweep --table-json PATH",
                       dot_only: tuple[str, ...] = (), shape_keyed: tuple[str, ...] = ()) -> dict[str, int]:
    """Update launch tables in place from the JSON a sweep wrote: {NAME: [[class, bucket, entry], ...], ...} for
    each NAME of ``tables`` (FP8_TABLE / FP8Q_TABLE here, SMALL_M_TABLE in kernels/small_m_linear.py): class
    "deep" | "square" | "wide" (gemm_shape_class), bucket one of FP8_M_BUCKETS, entry [kind, BLOCK_M, BLOCK_N,
    BLOCK_K, SPLIT_K, num_warps, num_stages] (check_fp8_entry), e.g. ["deep", 1, ["gemv", 1, 32, 512, 4, 8, 1]].
    The tables named in ``dot_only`` take "dot" entries only. Those named in ``shape_keyed`` are keyed by one
    layer's exact shape instead, rows [N, K, bucket, entry] with positive ints N, K (any shape: the sweep's own
    layers). Returns how many entries each table took. Nothing changes unless every row is good.

    Raises:
        ValueError: naming the file and the bad row (an unknown top-level key, a table that is not a list, a
            (class, bucket) given twice, a bad entry), or a file that is missing or not JSON; with ``env`` (the
            environment variable that named the file) a HayabusaValidationError naming that variable.
    """
    try:
        return _load_launch_tables(path, tables, writer, dot_only, shape_keyed)
    except ValueError as e:
        if env is None:
            raise
        from hayabusa.errors import HayabusaValidationError

        raise HayabusaValidationError(f"environment variable {env}: {e}", parameter=env, value=path) from None


def _load_launch_tables(path: str, tables: dict[str, dict], writer: str, dot_only: tuple[str, ...],
                        shape_keyed: tuple[str, ...]) -> dict[str, int]:
    names = " / ".join(tables)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a launch table ({type(e).__name__}: {e}); write one with "
                         f"`{writer}`") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a launch table file is a JSON object with {names} lists")
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}: this launch table file has only {names}")
    updates: dict[str, dict] = {}
    for name, table in tables.items():
        new = {}
        rows = data.get(name, [])
        layout = "[N, K, bucket, entry]" if name in shape_keyed else "[class, bucket, entry]"
        if not isinstance(rows, list):
            raise ValueError(f"{path}: {name} must be a list of {layout} rows, got {type(rows).__name__}")
        for row in rows:
            try:
                *key, entry = row
                key, entry = tuple(key), tuple(entry)
                if name in shape_keyed:
                    if len(key) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in key) \
                            or key[2] not in FP8_M_BUCKETS:
                        raise ValueError(f"a row is {layout} with positive ints N, K and a bucket of "
                                         f"{FP8_M_BUCKETS}, got key {list(key)}")
                else:
                    if len(key) != 2 or not isinstance(key[0], str) or isinstance(key[1], bool) \
                            or not isinstance(key[1], int):
                        raise ValueError(f"the shape class must be a string and the M bucket an int, got key "
                                         f"{list(key)}")
                    if key not in table:
                        raise ValueError(f"unknown (shape class, M bucket) {key}")
                if key in new:
                    raise ValueError(f"{key} is given twice")
                check_fp8_entry(entry)
                if name in dot_only and entry[0] != "dot":
                    raise ValueError(f"{name} takes 'dot' launches only, got {entry[0]!r}")
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: bad {name} row {row!r}: {e}") from None
            new[key] = entry
        updates[name] = new
    for name, table in tables.items():
        table.update(updates[name])
    return {k: len(v) for k, v in updates.items()}


def load_fp8_tables(path: str) -> dict[str, int]:
    """load_launch_tables for FP8_TABLE and FP8Q_TABLE (what ``HAYABUSA_FP8_TABLE_JSON`` names)."""
    return load_launch_tables(path, {"FP8_TABLE": FP8_TABLE, "FP8Q_TABLE": FP8Q_TABLE})


def fp8_m_bucket(M: int) -> int:
    """FP8_TABLE's row bucket of M rows: the smallest of FP8_M_BUCKETS >= M (the largest past them)."""
    return next((b for b in FP8_M_BUCKETS if M <= b), FP8_M_BUCKETS[-1])


def check_fp8_entry(entry: tuple) -> None:
    """Check one FP8_TABLE / FP8Q_TABLE entry: (kind "gemv" | "dot", BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
    num_stages), all but kind ints; BLOCK_* and num_warps powers of two, SPLIT_K >= 0 (0: chosen from the SM
    count), num_stages >= 1; gemv: BLOCK_M <= 4 and BLOCK_K >= 16; dot: every tile >= 16.

    Raises:
        ValueError: naming what is wrong and the entry.
    """
    what = (f"FP8_TABLE entry must be (gemv | dot, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K >= 0, num_warps, num_stages "
            f">= 1) with power-of-two tiles and warps (gemv: BLOCK_M <= 4, BLOCK_K >= {_VEC}; dot: tiles >= 16)")
    if not isinstance(entry, tuple) or len(entry) != 7:
        raise ValueError(f"{what}, got {entry!r}")
    kind, bm, bn, bk, split, warps, stages = entry
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
    for name, v in zip(names, entry[1:]):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{what}: {name} must be an int, got {v!r} in {entry}")
    if kind not in ("gemv", "dot") or split < 0 or stages < 1 \
            or any(v < 1 or v & (v - 1) for v in (bm, bn, bk, warps)) \
            or bk < _VEC or (kind == "dot" and min(bm, bn, bk) < 16) or (kind == "gemv" and bm > 4):
        raise ValueError(f"{what}, got {entry}")


def fp8_launch(entry: tuple[str, int, int, int, int, int, int], M: int, N: int, K: int,
               device: torch.device) -> LaunchConfig:
    """The launch of one FP8_TABLE entry for [M, K] x [K, N] (SPLIT_K 0 resolved on the device's SM count).
    Raises ValueError on a malformed entry (unknown kind, tiles not powers of two, GEMV BLOCK_K < 16, dot tiles
    < 16, negative SPLIT_K)."""
    check_fp8_entry(entry)
    kind, bm, bn, bk, split, warps, stages = entry
    if split == 0:
        sms, _ = device_limits(device)
        split = split_k_for(cdiv(M, bm) * cdiv(N, bn), cdiv(K, bk), FP8_AUTO_SPLIT_WAVES * sms)
    return LaunchConfig(kind, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                        num_stages=stages)


def pick_fp8_config(M: int, N: int, K: int, device: torch.device, prequantized: bool = False) -> LaunchConfig:
    """The launch for [M, K] x [K, N] with M <= FP8_SMALL_M_MAX: FP8_TABLE's entry (FP8Q_TABLE's for an x already
    quantized) for (gemm_shape_class(N, K), fp8_m_bucket(M)); host ints and the SM count only (the same every
    call: CUDA-graph safe)."""
    table = FP8Q_TABLE if prequantized else FP8_TABLE
    return fp8_launch(table[(gemm_shape_class(N, K), fp8_m_bucket(M))], M, N, K, device)


_LOCKS: dict[torch.device, torch.Tensor] = {}
# Buffers split_locks grew past: a CUDA graph captured with one still points at it, so it must stay allocated (freed,
# its memory could be handed to another tensor and the graph's counters would read someone else's bytes).
_RETIRED_LOCKS: list[torch.Tensor] = []


def split_locks(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The per-device int32 counters of the fused split-K reduction (zero between launches: each tile's last
    program resets its own), at least `tiles` of them; None while a CUDA graph is being captured and the buffer is
    missing or too small (allocating there would tie it to the graph's pool): that launch reduces with
    splitk_reduce instead, the same sum. One stream at a time uses them (the engine's forward is on one stream). A
    buffer grown past stays allocated (_RETIRED_LOCKS) for the graphs captured with it."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if locks is not None:
            _RETIRED_LOCKS.append(locks)
        locks = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


@dataclass
class SplitKPlan:
    """The grid and split-K workspace of one launch of a kernel that ends in splitk_finish (this module's and
    kernels/small_m_linear.py's): K cut into ``splits`` runs of ``k_per_split`` columns (whole BLOCK_K tiles, no
    empty split); with more than one, the fp32 partials ``part`` [splits, M, N] and, under USE_FUSED_REDUCE, the
    per-tile counters ``locks`` (None: ``finish`` reduces with splitk_reduce's second launch, the same sum)."""
    grid: tuple[int, int, int]
    k_per_split: int
    splits: int
    part: torch.Tensor
    locks: torch.Tensor | None

    @classmethod
    def of(cls, M: int, N: int, K: int, cfg: LaunchConfig, out: torch.Tensor) -> "SplitKPlan":
        """The plan of cfg's tiles and SPLIT_K for [M, K] x [K, N] into ``out`` (also the unused workspace
        pointer without a split)."""
        k_tiles = cdiv(K, cfg.BLOCK_K)
        tiles_per_split = cdiv(k_tiles, max(1, cfg.SPLIT_K))
        splits = cdiv(k_tiles, tiles_per_split)  # no empty split
        grid = (cdiv(M, cfg.BLOCK_M), cdiv(N, cfg.BLOCK_N), splits)
        part, locks = out, out
        if splits > 1:
            part = torch.empty((splits, M, N), dtype=torch.float32, device=out.device)
            locks = split_locks(out.device, grid[0] * grid[1]) if USE_FUSED_REDUCE else None
        return cls(grid, tiles_per_split * cfg.BLOCK_K, splits, part, locks)

    def finish(self, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """After the launch: the second-launch reduction where the kernel could not reduce itself."""
        if self.splits > 1 and self.locks is None:
            splitk_reduce(self.part, bias, out)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           input_scale: torch.Tensor | None, N: int, x_scale: torch.Tensor | None,
           out_dtype: torch.dtype | None) -> None:
    if isinstance(x, torch.Tensor) and x.dtype == FP8_DTYPE:   # quantized by its producer: x_scale [M, 1] with it
        if x.dim() != 2 or x.shape[1] == 0 or (x.stride(1) != 1 and x.shape[0] > 0):
            raise ValueError(f"x must be [M, K > 0] with a unit last stride, got {tuple(x.shape)} strides "
                             f"{x.stride()}")
        if input_scale is not None:
            raise ValueError("input_scale must be None when x is already quantized (its scales are x_scale)")
        if not isinstance(x_scale, torch.Tensor) or x_scale.dtype != torch.float32 \
                or x_scale.numel() != x.shape[0] or not x_scale.is_contiguous() or x_scale.device != x.device:
            got = ((tuple(x_scale.shape), x_scale.dtype, str(x_scale.device)) if isinstance(x_scale, torch.Tensor)
                   else x_scale)
            raise ValueError(f"x_scale must be [M={x.shape[0]}, 1] float32 contiguous on {x.device} when x is "
                             f"{FP8_DTYPE}, got {got!r}")
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype!r}")
    else:
        check_per_token_quant_inputs(x, input_scale, scale_name="input_scale")
        if x_scale is not None:
            raise ValueError(f"x_scale is only for an x already quantized to {FP8_DTYPE}; x is {x.dtype}")
        if out_dtype is not None and out_dtype != x.dtype:
            raise ValueError(f"out_dtype must be None or x's dtype ({x.dtype}) when x is not {FP8_DTYPE} (the "
                             f"output has x's dtype), got {out_dtype!r}")
    K = x.shape[1]
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N', K'] float8_e4m3fn with a unit last stride, got "
                         f"{tuple(weight.shape)} {weight.dtype} strides {weight.stride()}")
    if isinstance(N, bool) or not isinstance(N, int) or not 0 < N <= weight.shape[0]:
        raise ValueError(f"out_features must be an int in 1..{weight.shape[0]} (weight rows), got {N!r}")
    if weight.shape[1] < K:
        raise ValueError(f"weight has {weight.shape[1]} columns, fewer than x's K = {K}")
    if weight_scale.dtype != torch.float32 or weight_scale.dim() != 1 or weight_scale.shape[0] < N \
            or not weight_scale.is_contiguous():
        raise ValueError(f"weight_scale must be [>= {N}] float32 contiguous, got {tuple(weight_scale.shape)} "
                         f"{weight_scale.dtype}")
    y_dtype = out_dtype if x.dtype == FP8_DTYPE else x.dtype
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (N,) or bias.dtype != y_dtype
                             or not bias.is_contiguous()):
        got = (tuple(bias.shape), bias.dtype) if isinstance(bias, torch.Tensor) else bias
        raise ValueError(f"bias must be [N={N}] {y_dtype} contiguous or None, got {got}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def fp8_small_m_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                       out_features: int | None = None, cfg: LaunchConfig | None = None,
                       x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8 W8A8 linear with the activation quantization fused in (module docstring), sized for M <= FP8_SMALL_M_MAX
    (more rows run the largest M bucket's launch: the same result, slower than _scaled_mm there); or,
    when x is already e4m3 (quantized by the kernel that made it: kernels/fused_act_quant.py), the same product of
    x and its x_scale with no quantization step (FP8Q_TABLE's launches).

    Args:
        x: [M, K] float32/float16/bfloat16, unit last stride (any row stride); finite values. M may be 0. Or
            [M, K] float8_e4m3fn with ``x_scale``.
        weight: [N', K'] float8_e4m3fn, unit last stride, N' >= N, K' >= K (columns K.. and rows N.. ignored: the
            zero padding Fp8LinearMethod adds for _scaled_mm).
        weight_scale: [N'' >= N] float32 contiguous, one scale per output channel.
        bias: [N] in the output dtype, contiguous, or None (added in fp32 before the cast).
        input_scale: None (dynamic per-token scales) or a one-element float32 tensor (static), read on the device.
            None when x is e4m3.
        out_features: N (default N').
        cfg: a launch (bench sweeps and tests); default pick_fp8_config's.
        x_scale: [M, 1] (or [M]) float32 contiguous, x's row scales, only with an e4m3 x.
        out_dtype: the output dtype when x is e4m3 (bfloat16 / float16 / float32; default bfloat16); otherwise
            the output has x's dtype, and out_dtype must be None or that dtype.
    Returns:
        [M, N]: fp8_small_m_linear_ref's value up to the fp32 summation order (the same e4m3 x_q and s_x bits as
        per_token_quant_fp8). With the same cfg, a bf16 x and its per_token_quant_fp8 (x_q, x_scale) give the
        same bits: the sums run in the same order.
    Raises:
        ValueError: on a bad shape, dtype, stride or device (the message names the argument).
    No host sync; the grid depends on (M, N, K) only: safe to capture in a CUDA graph. On CPU it needs
    TRITON_INTERPRET=1.
    """
    xq = isinstance(x, torch.Tensor) and x.dtype == FP8_DTYPE
    N = weight.shape[0] if out_features is None else out_features
    _check(x, weight, weight_scale, bias, input_scale, N, x_scale, (out_dtype or torch.bfloat16) if xq else out_dtype)
    out_dtype = (out_dtype or torch.bfloat16) if xq else x.dtype
    M, K = x.shape
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    cfg = cfg or pick_fp8_config(M, N, K, x.device, prequantized=xq)
    if cfg.kind not in ("gemv", "dot"):
        raise ValueError(f"cfg.kind must be 'gemv' or 'dot', got {cfg.kind!r}")
    if cfg.kind == "gemv" and cfg.BLOCK_M not in (1, 2, 4):
        raise ValueError(f"cfg.BLOCK_M of a gemv launch must be 1, 2 or 4, got {cfg.BLOCK_M}")
    dot = cfg.kind == "dot"
    bm = cfg.BLOCK_M
    plan = SplitKPlan.of(M, N, K, cfg, out)
    amax_block = min(next_power_of_2(K), _MAX_AMAX_ELEMS // bm)
    amax_iters = cdiv(K, amax_block)
    common = dict(
        STATIC=input_scale is not None, XQ=xq, HAS_BIAS=bias is not None, SPLIT=plan.splits > 1,
        FUSED_REDUCE=plan.locks is not None, SOFT_ROUND=x.device.type == "cpu", BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        AMAX_BLOCK=amax_block, AMAX_ITERS=amax_iters,
        AMAX_UNROLL=amax_iters * amax_block * bm <= _AMAX_UNROLL_ELEMS * 32 * cfg.num_warps,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, FP8_MANT=_MANT, FP8_EMIN=_EMIN,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x.device))
    scales = x_scale if xq else input_scale if input_scale is not None else out
    args = (x, weight, weight_scale, bias if bias is not None else out, scales,
            out, plan.part, plan.locks if plan.locks is not None else out, M, N, K, plan.k_per_split,
            plan.splits, x.stride(0), weight.stride(0), out.stride(0))
    if dot:
        _fp8_dot_kernel[plan.grid](*args, EVEN_K=K % cfg.BLOCK_K == 0, DOT_FP32=x.device.type == "cpu", BLOCK_M=bm,
                                   **common)
    else:
        _fp8_gemv_kernel[plan.grid](*args, VEC_MASK=K % _VEC == 0, VEC=_VEC, BLOCK_M=bm, **common)
    plan.finish(bias, out)
    return out


def fp8_small_m_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                           out_features: int | None = None) -> torch.Tensor:
    """Plain torch, same arguments and result: per_token_quant_fp8_ref, the e4m3 products summed in fp32, (acc *
    s_x) * s_w (+ bias in fp32), one rounding to x's dtype (fp8_matmul_emulated's numerics, bias before the cast)."""
    N = weight.shape[0] if out_features is None else out_features
    K = x.shape[1]
    xq, sx = per_token_quant_fp8_ref(x, input_scale)
    acc = xq.float() @ weight[:N, :K].float().t()                                         # [M, N] fp32
    y = acc * sx * weight_scale[:N].view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if os.environ.get(FP8_TABLE_JSON_ENV):
    load_launch_tables(os.environ[FP8_TABLE_JSON_ENV], {"FP8_TABLE": FP8_TABLE, "FP8Q_TABLE": FP8Q_TABLE},
                       env=FP8_TABLE_JSON_ENV)


__all__ = ["FP8_M_BUCKETS", "FP8_SMALL_M_MAX", "FP8_TABLE", "FP8Q_TABLE", "fp8_launch", "fp8_m_bucket",
           "fp8_small_m_linear", "fp8_small_m_linear_ref", "load_fp8_tables", "load_launch_tables",
           "pick_fp8_config"]
