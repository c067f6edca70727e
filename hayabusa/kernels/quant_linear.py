"""Weight-only quantized linear layers, W8A16 and W4A16: kernels + launchers (torch references and quantizers:
hayabusa.kernels.quant_ref).

int8 (per output channel, symmetric): qweight [N, K] int8, scales [N]; W[n, k] = qweight[n, k] * scales[n].
int4 (grouped along K, asymmetric): qweight [K // 8, N] int32, scales and zeros [K // G, N];
W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]. The packing is GPTQ's (Frantar et al.,
arXiv:2210.17323: eight consecutive input rows per int32, low nibble first, unsigned); AWQ (Lin et al.,
arXiv:2306.00978) packs along N in an interleaved order and GPTQ checkpoints store zeros packed (and off by one in
the v1 format): their loaders convert to this layout once, at load time.

    qweight[i, n] (int32):  bits 31..28 | 27..24 | ... | 7..4      | 3..0
                            k = 8i + 7  | 8i + 6 | ... | k = 8i + 1 | k = 8i

Three kernels, launch chosen on the host from (M, N, K, G), x's dtype and the device's SM count and shared memory (no
autotune: the launch must be CUDA-graph safe and the same every run; retune pick_config with bench_quant_linear.py
--sweep, and GEMM_T_TABLE with its --sweep-gemm):
- GEMV (M <= _GEMV_MAX_M, decode): bandwidth-bound, and at 4.8 TB/s an H200 has ~3.5 instructions per int4 weight,
  so dequantization avoids int->float conversions (1/8 of the FMA rate): int4 nibbles become 1 + q/16 with one
  shift and one LOP3 (see _int4_gemv_tile), int8 bytes 2**23 + q + 128 with one OR. One program per (row, N tile,
  K split); fp32 FMAs; split-K spreads a narrow N over all SMs, partial sums go to an fp32 workspace that a second
  kernel adds in a fixed order (deterministic, unlike atomics: greedy decoding stays reproducible).
- GEMM (prefill, batches): tl.dot of activation tiles against the weight tile dequantized in registers to the
  activation dtype as exact integers (q - zero, or q), fp32 accumulation; the scale multiplies the fp32 partial sum
  once per K tile (int4: BLOCK_K divides G, so a tile lies in one group) or once at the end (int8). Same split-K
  when the tiles cannot fill the GPU. Serves fp32 x, and M > 256.
- Swapped GEMM "gemm_t" (fp16 / bf16 x, 4 < M <= 256; the small-M form of vLLM's Machete,
  csrc/quantization/machete): out^T [N, M] = Wdeq [N, K] @ x^T [K, M], so the wide N fills the MMA's M side
  (Hopper's wgmma needs 64 rows there: the original GEMM at 16-row tiles compiles to mma.sync).
  Nibbles become x's dtype directly: q | 0x4300 is the bf16 128 + q (fp16: q | 0x6400 = 1024 + q), minus
  (128 + zero) in bf16, exact: one shift, one LOP3 and one subtract per weight, no int -> float conversion; int8
  fp16 is one LOP3 ((q & 0xFF) ^ 0x6480 = 1152 + q), int8 bf16 (7 mantissa bits: 256 values do not fit) the fp32
  OR of _int_tile and one conversion. The tl.dot operands are the same exact integers as the original GEMM's, the
  scale applied the same way: only the MMA's summation order differs. Tiles come from GEMM_T_TABLE, keyed by
  (scheme, M bucket, shape class).
From DEQUANT_GEMM_MIN_M rows on (prefill, large batches) neither runs: the matmul is compute-bound there and
cuBLAS's bf16/fp16 GEMM is much faster than the tl.dot kernel, so one Triton kernel (_dequant_kernel) writes W
[N, K] in x's dtype (each element (q - zero) * scale in fp32, rounded once: exactly dequantize_int*_to_ref) and
F.linear multiplies. vLLM's AWQ method does the same from 256 tokens on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hayabusa.envs import env_flag
from hayabusa.kernels._triton import cdiv, tl, triton
from hayabusa.kernels.pdl import HOPPER, capability_at_least
from hayabusa.kernels.quant_ref import (  # noqa: F401  (re-exported: callers import the quantizers from here)
    dequantize_int4, dequantize_int4_to_ref, dequantize_int8, dequantize_int8_to_ref, int4_weight_only_linear_ref,
    int8_weight_only_linear_ref, pack_int4, quantize_int4_grouped, quantize_int8_per_channel, unpack_int4,
)
from hayabusa.kernels.quant_ref import FLOAT_DTYPES, check_group_size

_GEMV_MAX_M = 4     # GEMV up to here (rows after the first re-read the weights from L2), then 16-row tl.dot
_MAX_SPLIT_K = 64
# From this many rows (tokens) on, the CUDA path dequantizes W into a temporary [N, K] tensor of x's dtype (one
# Triton kernel: reads the packed weight, writes 2 N K bytes for bf16) and calls F.linear (cuBLAS) instead of the
# fused Triton GEMM. The dequantization costs about one bf16 weight read and write, shared by all M rows; the fused
# GEMM's tl.dot falls far behind cuBLAS once M fills the tensor cores. 256 is vLLM's AWQ heuristic
# (vllm/model_executor/layers/quantization/awq.py, AWQLinearMethod.apply: FP16_MATMUL_HEURISTIC_CONDITION =
# x.shape[:-1].numel() >= 256 -> ops.awq_dequantize + torch.matmul). Measured on an H200 (BENCHMARKS.md, run K,
# `python benchmarks/kernels/bench_quant_linear.py --dequant`, qwen2.5-7b shapes): for int8 the fused kernel keeps
# the large projections (gate_up, down) up to M = 256-512, so int8 keeps 256; for int4 (group 128) dequantize +
# cuBLAS wins on every projection from M = 64 (gate_up M = 128: 175 against 239 us; down: 99 against 175 us), so
# int4 switches from DEQUANT_GEMM_MIN_M_INT4. Both are read at call time (tests lower them); int4 uses the smaller.
DEQUANT_GEMM_MIN_M = 256
DEQUANT_GEMM_MIN_M_INT4 = 64
_DEQUANT_TILE = 8192  # weight elements per dequantization program (64 x 128 for int8 and int4 with G = 128)


# ----------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _f32_plus_2p23(u):
    """int32 u in [0, 2**23) -> float32 2**23 + u, exactly, with one OR instead of an int->float conversion."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_int4_tile(qw_ptr, k0, offs_n, n_mask, N, BLOCK_K: tl.constexpr, OR_BITS: tl.constexpr = 0):
    """Packed rows k0 // 8 .. (k0 + BLOCK_K) // 8 of qweight, each int32 loaded once, unpacked in registers to
    nibbles u^T [BLOCK_N, BLOCK_K] (k on the last axis): u^T[n, 8i + j] = plane j of word i. Three rounds of
    interleave (2m + b <- b ? second[m] : first[m]) put plane j at 8i + j: b = j % 2, then j // 2 % 2, then j // 4.
    OR_BITS (< 2**16, above bit 3) is OR-ed into every nibble: one shift and one LOP3 (AND-OR) per nibble.
    """
    offs_i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    q = tl.load(qw_ptr + offs_i[None, :] * N + offs_n[:, None], mask=n_mask[:, None], other=0)  # [BN, BK // 8]
    p0, p1, p2, p3 = q & 0xF | OR_BITS, (q >> 4) & 0xF | OR_BITS, (q >> 8) & 0xF | OR_BITS, (q >> 12) & 0xF | OR_BITS
    p4, p5, p6, p7 = ((q >> 16) & 0xF | OR_BITS, (q >> 20) & 0xF | OR_BITS, (q >> 24) & 0xF | OR_BITS,
                      (q >> 28) & 0xF | OR_BITS)
    even = tl.interleave(tl.interleave(p0, p4), tl.interleave(p2, p6))
    odd = tl.interleave(tl.interleave(p1, p5), tl.interleave(p3, p7))
    return tl.interleave(even, odd)


@triton.jit
def _int_tile(qw_ptr, zeros_ptr, k0, offs_k, offs_n, n_mask, k_mask, N, K,
              INT4: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr):
    """Weight tile [BLOCK_K, BLOCK_N] as exact fp32 integers: q - zero (int4, one group) or q (int8)."""
    if INT4:
        u = tl.trans(_unpack_int4_tile(qw_ptr, k0, offs_n, n_mask, N, BLOCK_K=offs_k.shape[0]))  # [BK, BN]
        z = tl.load(zeros_ptr + (k0 // GROUP_SIZE) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        return _f32_plus_2p23(u) - (z + 8388608.0)[None, :]
    else:
        ptrs = qw_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]  # qweight is [N, K]: K is contiguous
        if EVEN_K:
            q = tl.load(ptrs, mask=n_mask[None, :], other=0)
        else:
            q = tl.load(ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0)
        return _f32_plus_2p23(q.to(tl.int32) + 128) - 8388736.0  # 2**23 + 128


@triton.jit
def _int4_gemv_tile(qw_ptr, zeros_ptr, scales_ptr, x_row, stride_xk, k0, offs_i, offs_n, n_mask, N, one_bits,
                    GROUP_SIZE: tl.constexpr):
    """One int4 GEMV tile, sum over its k of x * (q - zero) * scale, left per packed row: [BLOCK_K // 8, BLOCK_N].

    Each packed int32 is loaded once; its nibble plane j meets x[k0 + 8i + j]. Decode is ALU-bound at 4.8 TB/s
    unless a nibble costs ~3 instructions, so a nibble becomes the float 1 + q/16 with one shift and one
    AND-OR (q lands in the top mantissa bits of 1.0: no int->float conversion, no zero subtraction) and one FMA:
        t[i] = sum_j x_j (1 + q_j / 16)   =>   sum_j x_j (q_j - zero) = 16 t[i] - (16 + zero) sum_j x_j
    The offset is 1, not 2**23, so the subtraction keeps ~22 bits. one_bits = 0x3F800000 (1.0f) arrives as a
    run-time argument: in a register, ptxas fuses the AND and the OR into one LOP3 (it takes one immediate).
    """
    #  q[i, n] = | nibble 7 | ... | nibble 0 |  -> nibble j shifted to bits 19..22 (mantissa top) | 0x3F800000
    q = tl.load(qw_ptr + (k0 // 8 + offs_i)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    x_i = x_row + (k0 + 8 * offs_i) * stride_xk
    x0 = tl.load(x_i).to(tl.float32)
    t = ((q << 19) & 0x00780000 | one_bits).to(tl.float32, bitcast=True) * x0[:, None]
    xsum = x0
    for j in tl.static_range(1, 8):
        xj = tl.load(x_i + j * stride_xk).to(tl.float32)
        if j <= 4:
            qj = q << (19 - 4 * j)
        else:
            qj = q >> (4 * j - 19)
        t += (qj & 0x00780000 | one_bits).to(tl.float32, bitcast=True) * xj[:, None]
        xsum += xj
    g = k0 // GROUP_SIZE
    s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return t * (16.0 * s)[None, :] - xsum[:, None] * (s * (16.0 + z))[None, :]


@triton.jit
def splitk_epilogue(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """acc [BM, BN] fp32 -> out (+ bias, cast), or the fp32 partial of split pid_k (workspace [splits, M, N])."""
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + (pid_k * M + rows)[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wo_gemv_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr,
                    M, N, K, k_per_split, stride_xm, stride_xk, stride_om, one_bits,
                    INT4: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid (M, N tiles, splits): the rows of one weight tile are neighbours in launch order, so rows after the
    # first find the tile in L2
    m = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    # per-thread partial sums, reduced across threads once after the loop (not once per tile)
    if INT4:
        acc2 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if INT4:  # BLOCK_K divides G and K: no K mask, one group per tile
            acc2 += _int4_gemv_tile(qw_ptr, zeros_ptr, scales_ptr, x_row, stride_xk, k0,
                                    tl.arange(0, BLOCK_K // 8), offs_n, n_mask, N, one_bits, GROUP_SIZE)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            if EVEN_K:
                x = tl.load(x_row + offs_k * stride_xk).to(tl.float32)
            else:
                x = tl.load(x_row + offs_k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
            w = _int_tile(qw_ptr, zeros_ptr, k0, offs_k, offs_n, n_mask, k_mask, N, K, INT4, GROUP_SIZE, EVEN_K)
            acc2 += w * x[:, None]
    acc = tl.sum(acc2, axis=0)
    if not INT4:
        acc *= tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    rows = m.to(tl.int64) + tl.arange(0, 1)
    splitk_epilogue(acc[None, :], rows, rows < M, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, pid_k, M, N,
                    stride_om, HAS_BIAS, SPLIT)


@triton.jit
def _wo_gemm_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr,
                    M, N, K, k_per_split, stride_xm, stride_xk, stride_om,
                    INT4: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # grouped launch order: GROUP_M row tiles sweep the N tiles together, so weight tiles are reused from L2
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rows < M, offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _int_tile(qw_ptr, zeros_ptr, k0, offs_k, offs_n, n_mask, k_mask, N, K, INT4, GROUP_SIZE, EVEN_K)
        if DOT_FP32:  # the CPU interpreter (numpy) computes a bf16 tl.dot on raw bits: give it fp32 operands
            x = x.to(tl.float32)
        else:
            w = w.to(x_ptr.dtype.element_ty)  # integers in [-127, 127]: exact in fp16 and bf16
        if INT4:
            s = tl.load(scales_ptr + (k0 // GROUP_SIZE) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if not INT4:
        acc *= tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    splitk_epilogue(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                    HAS_BIAS, SPLIT)


@triton.jit
def int4_tile_t(qw_ptr, zeros_ptr, k0, offs_n, n_mask, N, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
                 MAGIC: tl.constexpr, BY_HAND: tl.constexpr):
    """Weight tile W^T [BLOCK_N, BLOCK_K] as the exact integers q - zero in x's dtype, one group. A nibble OR-ed
    with MAGIC is the float 2**e + q (bf16 0x4300 = 128 + q, fp16 0x6400 = 1024 + q: the nibble fills the low
    mantissa bits), so q - zero = (2**e + q) - (2**e + zero), both exact, by one shift, one LOP3 and one subtract
    per weight: no int -> float conversion. BY_HAND (interpreter, bf16): the same bits read as fp32 (bf16 is the top
    half of an fp32), subtracted in fp32: the interpreter's bf16 arithmetic works on raw bits."""
    z = tl.load(zeros_ptr + (k0 // GROUP_SIZE) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    off = z + (128.0 if MAGIC == 0x4300 else 1024.0)                                       # [BN] 2**e + zero
    u = _unpack_int4_tile(qw_ptr, k0, offs_n, n_mask, N, BLOCK_K=BLOCK_K, OR_BITS=MAGIC)   # [BN, BK] int32
    if BY_HAND:
        return (u << 16).to(tl.float32, bitcast=True) - off[:, None]
    w = u.to(tl.int16).to(zeros_ptr.dtype.element_ty, bitcast=True)
    return w - off.to(zeros_ptr.dtype.element_ty)[:, None]


@triton.jit
def _int8_tile_t(qw_ptr, offs_k, offs_n, n_mask, k_mask, K, MAGIC: tl.constexpr, EVEN_K: tl.constexpr,
                 BY_HAND: tl.constexpr, DTYPE: tl.constexpr):
    """Weight tile W^T [BLOCK_N, BLOCK_K] as the exact integers q in DTYPE (qweight [N, K], K contiguous). fp16:
    (q + 128) | 0x6400 is the half 1024 + q + 128 (one LOP3 on the sign-extended byte), minus 1152. bf16 keeps 7
    mantissa bits, too few for 256 values: 2**23 + q + 128 in fp32 by one OR (as _int_tile), then one rounding-free
    conversion (BY_HAND, the interpreter: left in fp32)."""
    ptrs = qw_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    if EVEN_K:
        q = tl.load(ptrs, mask=n_mask[:, None], other=0)
    else:
        q = tl.load(ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
    if MAGIC == 0x6400:
        return ((q.to(tl.int16) & 0xFF) ^ 0x6480).to(tl.float16, bitcast=True) - 1152.0
    w = _f32_plus_2p23(q.to(tl.int32) + 128) - 8388736.0  # 2**23 + 128
    if BY_HAND:
        return w
    return w.to(DTYPE)


@triton.jit
def _wo_gemm_t_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr,
                      M, N, K, k_per_split, stride_xm, stride_xk, stride_om,
                      INT4: tl.constexpr, GROUP_SIZE: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      MAGIC: tl.constexpr, BY_HAND: tl.constexpr):
    """The GEMM with swapped operands, for fp16 / bf16 x at M = 5-256 (Machete's small-M form):
        out^T [N, M] = Wdeq [N, K] @ x^T [K, M]
    The wide N sits on the MMA's M side (64-256 rows) and the few tokens on its N side (>= 16): compiled for sm_90
    by Triton 3.6 the first GEMM_T_TABLE tiles are warpgroup MMAs (wgmma; the original GEMM at 16 rows: mma.sync), with
    x^T and the packed weights in cp.async pipelines. The dequantized tile is the A operand, which wgmma can read
    from registers; Triton 3.6 still passes it through shared memory to reach the operand layout (the nibble
    interleave's layout is not it), as the original GEMM does for its B operand.
    Weights are exact integers in x's dtype (see int4_tile_t, _int8_tile_t); the group scale multiplies the fp32
    partial sum per K tile (int4: BLOCK_K divides G) or the sum at the end (int8), as in _wo_gemm_kernel."""
    # launch order: the M tiles of one N tile are neighbours, so a weight tile comes from HBM once, then from L2
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_n, pid_m = pid // num_m, pid % num_m
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rows < M, offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)                                   # out^T tile
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        xt_ptrs = x_ptr + rows[None, :] * stride_xm + offs_k[:, None] * stride_xk           # x^T [BK, BM]
        if EVEN_K:
            xt = tl.load(xt_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            xt = tl.load(xt_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        if BY_HAND:  # the interpreter (numpy) computes a bf16 tl.dot on raw bits: fp32 operands
            xt = xt.to(tl.float32)
        if INT4:
            w = int4_tile_t(qw_ptr, zeros_ptr, k0, offs_n, n_mask, N, GROUP_SIZE, BLOCK_K, MAGIC, BY_HAND)
            s = tl.load(scales_ptr + (k0 // GROUP_SIZE) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.dot(w, xt) * s[:, None]
        else:
            w = _int8_tile_t(qw_ptr, offs_k, offs_n, n_mask, k_mask, K, MAGIC, EVEN_K, BY_HAND,
                             x_ptr.dtype.element_ty)
            acc = tl.dot(w, xt, acc)
    if not INT4:
        acc *= tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    splitk_epilogue(tl.trans(acc), rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                    HAS_BIAS, SPLIT)


@triton.jit
def splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, num_splits, stride_om,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m, :] = sum over splits of part[s, m, :] in split order (+ bias): the deterministic second pass."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = tl.load(part_ptr + m * N + offs_n, mask=mask, other=0.0)
    for s in range(1, num_splits):
        acc += tl.load(part_ptr + (s * M + m) * N + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bf16_rne(w):
    """fp32 -> bf16 rounded to nearest even by integer arithmetic (finite w). Only for the interpreter: Triton
    3.6's truncates in .to(tl.bfloat16) (cast_impl drops the rounding mode), the GPU's cvt.rn rounds correctly.
    Shared by the dequantize, INT8 W8A8 and small-M kernels."""
    b = w.to(tl.uint32, bitcast=True)
    b += 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_kernel(qw_ptr, scales_ptr, zeros_ptr, out_ptr, N, K,
                    INT4: tl.constexpr, GROUP_SIZE: tl.constexpr, BF16_BY_HAND: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] (nn.Linear's orientation, K contiguous) = (q - zero) * scale (int4) or q * scale (int8), one
    [BLOCK_N, BLOCK_K] tile per program. q - zero is exact in fp32 (2**23 + u by one OR, as in _int_tile), and so
    is its product with an fp16/bf16 scale (at most 7 + 11 significant bits): the one rounding is the store's (fp32:
    the multiply's), as in dequantize_int*_to_ref."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    if INT4:  # BLOCK_K divides G (and so K): one group per tile, no K mask
        u = _unpack_int4_tile(qw_ptr, k0, offs_n, n_mask, N, BLOCK_K=BLOCK_K)                 # [BN, BK] int32
        g = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = (_f32_plus_2p23(u) - (z + 8388608.0)[:, None]) * s[:, None]
        mask = n_mask[:, None]
    else:
        mask = n_mask[:, None] & (offs_k < K)[None, :]
        q = tl.load(qw_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0)
        s = tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = (_f32_plus_2p23(q.to(tl.int32) + 128) - 8388736.0) * s[:, None]
    if BF16_BY_HAND:
        w = bf16_rne(w)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask)


# ---------------------------------------------------------------------------------------------------- launcher
@dataclass(frozen=True)
class LaunchConfig:
    """One launch: kernel kind ("gemv" | "gemm" | "gemm_t": the swapped-operand GEMM, fp16 / bf16 x only), tile
    sizes, requested K splits (the launcher drops empty ones)."""
    kind: str
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    BLOCK_M: int = 1
    num_warps: int = 4
    num_stages: int = 2


# Launches of _wo_gemm_t_kernel (fp16 / bf16 x, _GEMV_MAX_M < M <= 256), keyed by (scheme "int8" | "int4", M
# bucket (gemm_m_bucket), shape class (gemm_shape_class)) -> (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
# num_stages); SPLIT_K 0 = as many K splits as fill the SMs (_split_k); int4 caps BLOCK_K at the group's largest
# power-of-two divisor. UNMEASURED: best guesses from Machete's small-M tiles (N on the MMA's M side, 128 wide; the
# token tile as small as M allows, >= 16 for tl.dot; 3-4 stages), the same for every shape class. Replace with the
# literal that `python benchmarks/kernels/bench_quant_linear.py --sweep-gemm` prints after a GPU run.
GEMM_M_BUCKETS = (16, 32, 64, 128, 256)
# gemm_t is off by default: with the unmeasured guesses below it was slower than the original GEMM on the H200 (run AF,
# 2026-12-02, `bench_quant_linear.py --m 16,64,256`, 7b layers, us: int8 gate_up M=64 106.7 vs 82.3 (run K), int4
# gate_up M=16 161.9 vs 147.2; faster only at int4 M=64, 164 vs 187.8). HAYABUSA_WO_GEMM_T=1 (read at import) or
# USE_GEMM_T = True (read per call) turns it on, for the --sweep-gemm run that fills GEMM_T_TABLE.
USE_GEMM_T = env_flag("HAYABUSA_WO_GEMM_T", False)
# Batched decode (2 <= M <= 16 rows, fp16 / bf16 x) on kernels/wo_small_m.py's kernel (small_m_linear's 16-row
# tl.dot loop, nibble slabs dequantized by the magic number): measured 1.4-3.5x faster than the GEMV / GEMM it
# replaces on the H200 (wo_small_m's docstring), so on by default on CUDA devices of compute capability 9.0+ (where
# its table was measured; USE_WO_SMALL_M None). HAYABUSA_WO_SMALL_M=0 / =1 (read at import) or USE_WO_SMALL_M =
# False / True (read per call: tests) turns it off / on for any CUDA device (the CPU path is the torch reference).
USE_WO_SMALL_M: bool | None = (env_flag("HAYABUSA_WO_SMALL_M", False) if "HAYABUSA_WO_SMALL_M" in os.environ
                               else None)
# That kernel, as kernels/wo_small_m.py registers it when imported (register_small_m_kernel): (applies(x, N,
# group_size) -> bool, linear(x, qweight, scales, zeros, group_size, bias) -> y). A registration, not an import
# here: wo_small_m builds on this module's launch configs and tiles, so importing it from here would close a circle.
# quantization/packed.quant_kernels, through which every weight-only method reaches these kernels, imports both.
_SMALL_M_KERNEL: tuple | None = None


def register_small_m_kernel(applies, linear) -> None:
    """Set the kernel _kernel_linear sends 2-16 rows (17-256 with HAYABUSA_WO_MID_M, where measured to win) to where
    wo_small_m_enabled (kernels/wo_small_m.py calls it; its ``applies`` decides)."""
    global _SMALL_M_KERNEL
    _SMALL_M_KERNEL = (applies, linear)
GEMM_SHAPE_CLASSES = ("square", "wide", "deep")
_GEMM_T_GUESS = {16: (16, 128, 128, 0, 4, 4), 32: (32, 128, 128, 0, 4, 4), 64: (64, 128, 64, 0, 4, 4),
                 128: (128, 128, 64, 0, 8, 3), 256: (128, 128, 64, 0, 8, 3)}
GEMM_T_TABLE: dict[tuple[str, int, str], tuple[int, int, int, int, int, int]] = {
    (scheme, bucket, shape): _GEMM_T_GUESS[bucket]
    for scheme in ("int8", "int4") for bucket in GEMM_M_BUCKETS for shape in GEMM_SHAPE_CLASSES}


def gemm_m_bucket(M: int) -> int:
    """The GEMM_T_TABLE row bucket of M rows: the smallest of GEMM_M_BUCKETS >= M (the largest past them)."""
    return next((b for b in GEMM_M_BUCKETS if M <= b), GEMM_M_BUCKETS[-1])


def gemm_shape_class(N: int, K: int) -> str:
    """The GEMM_T_TABLE shape class of a [K] -> [N] linear: "wide" (N >= 4K: an MLP's gate_up, many N tiles),
    "deep" (K >= 4N: its down projection, few N tiles and a long K) or "square" (attention's qkv and o)."""
    return "wide" if N >= 4 * K else "deep" if K >= 4 * N else "square"


def wo_small_m_enabled(device: torch.device) -> bool:
    """USE_WO_SMALL_M when set (HAYABUSA_WO_SMALL_M, or a test), else a CUDA device of compute capability 9.0+."""
    return USE_WO_SMALL_M if USE_WO_SMALL_M is not None else capability_at_least(device, HOPPER)


@functools.lru_cache(maxsize=8)
def device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory a block may opt into, bytes). The interpreter gets a small fixed "GPU", so CPU
    tests see split-K."""
    if device.type != "cuda":
        return 4, 99 * 1024
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 99 * 1024)


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def split_k_for(num_tiles: int, k_tiles: int, target_programs: int) -> int:
    """K splits so that num_tiles * splits reaches target_programs, each split keeping >= 2 K tiles."""
    if num_tiles >= target_programs:
        return 1
    return max(1, min(_MAX_SPLIT_K, k_tiles // 2, cdiv(target_programs, num_tiles)))


def _gemm_stages(bm: int, bn: int, bk: int, x_bytes: int, w_bits: int, smem: int) -> int:
    """Deepest pipeline (<= 3) whose buffers fit: per stage the x tile, the packed weight tile and the dequantized
    tile that tl.dot reads from shared memory (what Triton 3.6 allocates for sm_80/89/90, within a few KB)."""
    per_stage = bm * bk * x_bytes + bk * bn * w_bits // 8 + bk * bn * x_bytes
    for stages in (3, 2):
        if stages * per_stage + bk * bn * x_bytes <= smem:
            return stages
    return 1


def pick_config(M: int, N: int, K: int, group_size: int | None, device: torch.device,
                x_bytes: int = 2) -> LaunchConfig:
    """The launch for [M, K] x [K, N]; int4 when group_size is given; x_bytes 2 = fp16 / bf16 x, 4 = fp32. Host
    ints and device properties only.

    GEMV (M <= _GEMV_MAX_M): about 4 programs per SM, 8 KB of weights per program and step (int4 128 k x 128 n,
    int8 128 k x 64 n). With USE_GEMM_T, fp16 / bf16 x up to M = 256: the swapped-operand GEMM (_wo_gemm_t_kernel)
    with the tiles of GEMM_T_TABLE (see there: unmeasured until the sweep's table is pasted). Otherwise (fp32 x,
    larger M) the original GEMM: 128-row tiles for prefill, 16-64 rows with split-K when the tiles do not fill the
    SMs. int4 K tiles stay inside one group (tl.dot also needs K >= 16).
    """
    sms, smem = device_limits(device)
    k_cap = pow2_divisor(group_size, 128) if group_size is not None else 128
    if M <= _GEMV_MAX_M or k_cap < 16:
        bn, bk, warps = (128, k_cap, 4) if group_size is not None else (64, 128, 8)
        split = split_k_for(M * cdiv(N, bn), cdiv(K, bk), 4 * sms)
        return LaunchConfig("gemv", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=1)
    if USE_GEMM_T and x_bytes == 2 and M <= GEMM_M_BUCKETS[-1]:
        scheme = "int8" if group_size is None else "int4"
        entry = GEMM_T_TABLE[(scheme, gemm_m_bucket(M), gemm_shape_class(N, K))]
        return gemm_t_launch(entry, M, N, K, group_size, device)
    bm = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    bn, bk = 128, min(k_cap, 64)
    split = split_k_for(cdiv(M, bm) * cdiv(N, bn), cdiv(K, bk), sms)
    stages = _gemm_stages(bm, bn, bk, x_bytes, 4 if group_size is not None else 8, smem)
    return LaunchConfig("gemm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                        num_warps=8 if bm == 128 else 4, num_stages=stages)


def gemm_t_launch(entry: tuple[int, int, int, int, int, int], M: int, N: int, K: int, group_size: int | None,
                  device: torch.device) -> LaunchConfig:
    """The gemm_t launch of one GEMM_T_TABLE entry (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for
    [M, K] x [K, N]: int4's BLOCK_K capped at the group's largest power-of-two divisor (a K tile lies in one group),
    SPLIT_K 0 resolved to as many K splits as fill the device's SMs. Raises ValueError on a malformed entry."""
    bm, bn, bk, split, warps, stages = entry
    if min(bm, bn, bk) < 16 or split < 0 or any(v & (v - 1) for v in (bm, bn, bk)):
        raise ValueError(f"gemm_t entry needs power-of-two tiles >= 16 and SPLIT_K >= 0, got {entry}")
    if group_size is not None:
        bk = min(bk, pow2_divisor(group_size, 128))
    if split == 0:
        split = split_k_for(cdiv(M, bm) * cdiv(N, bn), cdiv(K, bk), device_limits(device)[0])
    return LaunchConfig("gemm_t", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                        num_stages=stages)


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            bias: torch.Tensor | None, N: int, group_size: int | None, cfg: LaunchConfig | None) -> torch.Tensor:
    """Run the Triton kernels (inputs already checked). Allocates the output and, with split-K, an fp32
    workspace [splits, M, N]; the grid depends on (M, N, K, G) only, so a captured CUDA graph stays valid."""
    M, K = x.shape
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    int4 = group_size is not None
    cfg = cfg or pick_config(M, N, K, group_size, x.device, x.element_size())
    k_tiles = cdiv(K, cfg.BLOCK_K)
    tiles_per_split = cdiv(k_tiles, max(1, cfg.SPLIT_K))
    splits = cdiv(k_tiles, tiles_per_split)  # no empty split
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    args = (x, qweight, scales, zeros if int4 else scales, bias if bias is not None else out, out, part,
            M, N, K, tiles_per_split * cfg.BLOCK_K, x.stride(0), x.stride(1), out.stride(0))
    flags = dict(INT4=int4, GROUP_SIZE=group_size or 1, EVEN_K=K % cfg.BLOCK_K == 0, HAS_BIAS=bias is not None,
                 SPLIT=splits > 1, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)
    if cfg.kind == "gemv":
        _wo_gemv_kernel[(M, cdiv(N, cfg.BLOCK_N), splits)](*args, 0x3F800000, **flags)
    elif cfg.kind == "gemm_t":
        assert x.dtype in (torch.float16, torch.bfloat16), "gemm_t takes fp16 / bf16 activations"
        grid = (cdiv(M, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N), splits)
        _wo_gemm_t_kernel[grid](*args, **flags, BLOCK_M=cfg.BLOCK_M,
                                MAGIC=0x6400 if x.dtype == torch.float16 else 0x4300,
                                BY_HAND=x.dtype == torch.bfloat16 and x.device.type == "cpu")
    else:
        grid = (cdiv(M, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N), splits)
        _wo_gemm_kernel[grid](*args, **flags, BLOCK_M=cfg.BLOCK_M, GROUP_M=8,
                              DOT_FP32=x.dtype == torch.bfloat16 and x.device.type == "cpu",
                              DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    if splits > 1:
        splitk_reduce(part, bias, out)
    return out


def splitk_reduce(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] (unit last stride) = the fp32 partials part [splits, M, N] summed in split order (+ bias [N]),
    cast to out's dtype: splitk_reduce_kernel, the second pass of a split-K launch (also kernels/fp8_gemv.py's)."""
    splits, M, N = part.shape
    splitk_reduce_kernel[(M, cdiv(N, 512))](
        part, bias if bias is not None else out, out, M, N, splits, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=512, num_warps=4)


def _dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Run _dequant_kernel (inputs already checked): W [N, K] in dtype; int4 when group_size is given. Allocates
    the output only; the grid depends on (N, K, G) only, so a captured CUDA graph stays valid."""
    int4 = group_size is not None
    N, K = (qweight.shape[1], qweight.shape[0] * 8) if int4 else qweight.shape
    out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    bk = pow2_divisor(group_size, 128) if int4 else 128   # int4: a tile lies in one group (G % 8 == 0: bk >= 8)
    bn = _DEQUANT_TILE // bk
    _dequant_kernel[(cdiv(N, bn), cdiv(K, bk))](
        qweight, scales, zeros if int4 else scales, out, N, K, INT4=int4, GROUP_SIZE=group_size or 1,
        BF16_BY_HAND=dtype == torch.bfloat16 and qweight.device.type == "cpu", BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4)
    return out


def _kernel_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   bias: torch.Tensor | None, N: int, group_size: int | None) -> torch.Tensor:
    """The CUDA path (inputs already checked; runs on CPU under the interpreter): from DEQUANT_GEMM_MIN_M rows on,
    W dequantized to x's dtype by one kernel, then F.linear (cuBLAS); below, the fused Triton GEMV / GEMM; with
    wo_small_m_enabled, fp16 / bf16 x of wo_small_m.WO_SMALL_M_MIN_M..WO_SMALL_M_MAX rows (..WO_MID_M_MAX with
    HAYABUSA_WO_MID_M, at wo_small_m.WO_MID_M_WINS's keys; unit last stride) takes kernels/wo_small_m.py's tl.dot
    kernel instead."""
    threshold = DEQUANT_GEMM_MIN_M if group_size is None else min(DEQUANT_GEMM_MIN_M, DEQUANT_GEMM_MIN_M_INT4)
    if _SMALL_M_KERNEL is not None and x.shape[0] > 1 and x.stride(1) == 1 and wo_small_m_enabled(x.device) \
            and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        applies, linear = _SMALL_M_KERNEL
        if applies(x, N, group_size):
            return linear(x, qweight, scales, zeros, group_size, bias)
    if x.shape[0] >= threshold:
        return F.linear(x, _dequantize(qweight, scales, zeros, group_size, x.dtype), bias)
    return _launch(x, qweight, scales, zeros, bias, N, group_size, None)


# -------------------------------------------------------------------------------------------------- validation
def _check_common(x: torch.Tensor, named: dict[str, torch.Tensor | None], N: int) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be [M, K] float16/bfloat16/float32, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError("x has K = 0 input features")
    bias = named.get("bias")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N={N}] {x.dtype} or None, got {tuple(bias.shape)} {bias.dtype}")
    check_on_device_contiguous(x, named)


def check_on_device_contiguous(x: torch.Tensor, named: dict[str, torch.Tensor | None]) -> None:
    """Every tensor of ``named`` (None skipped) on x's device and contiguous; else ValueError naming it."""
    for name, t in named.items():
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _check_int8(x, qweight, scales, bias) -> None:
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be [N, K] int8, got {tuple(qweight.shape)} {qweight.dtype}")
    N = qweight.shape[0]
    _check_common(x, dict(qweight=qweight, scales=scales, bias=bias), N)
    if qweight.shape[1] != x.shape[1]:
        raise ValueError(f"qweight is [N, K] = {tuple(qweight.shape)} but x has K = {x.shape[1]}")
    if scales.shape != (N,) or scales.dtype != x.dtype:
        raise ValueError(f"scales must be [N={N}] {x.dtype} (x's dtype), got {tuple(scales.shape)} {scales.dtype}")


def _check_int4(x, qweight, scales, zeros, group_size, bias) -> None:
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be [K // 8, N] int32, got {tuple(qweight.shape)} {qweight.dtype}")
    N = qweight.shape[1]
    _check_common(x, dict(qweight=qweight, scales=scales, zeros=zeros, bias=bias), N)
    K = x.shape[1]
    if K % 8 != 0 or qweight.shape[0] != K // 8:
        raise ValueError(f"qweight must be [K // 8, N] with K = {K} (a multiple of 8), got {tuple(qweight.shape)}")
    check_group_size(K, group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != (K // group_size, N) or t.dtype != x.dtype:
            raise ValueError(f"{name} must be [K // group_size, N] = [{K // group_size}, {N}] {x.dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}")



# ------------------------------------------------------------------------------------------------ public linears
def int8_weight_only_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias with W = qweight * scales[:, None] (W8A16; Triton on CUDA, the reference on CPU).

    On CUDA, M < DEQUANT_GEMM_MIN_M (256, vLLM's AWQ threshold) runs the fused Triton GEMV / GEMM (2-16 fp16 / bf16
    rows, 2-256 with HAYABUSA_WO_MID_M: kernels/wo_small_m.py, USE_WO_SMALL_M); from there on W is dequantized to
    x's dtype (dequantize_int8_to, a temporary [N, K]) and F.linear (cuBLAS) multiplies.

    Args:
        x: [M, K] float16/bfloat16/float32, any strides; M may be 0.
        qweight: [N, K] int8, contiguous (from quantize_int8_per_channel).
        scales: [N], x's dtype.
        bias: [N], x's dtype, or None.
    Returns:
        [M, N] in x's dtype (fp32 accumulation; on the cuBLAS path W is first rounded to x's dtype).
    Raises:
        ValueError: on a shape, dtype, contiguity or device mismatch (the message names the argument).
    """
    _check_int8(x, qweight, scales, bias)
    if x.is_cuda:
        return _kernel_linear(x, qweight, scales, None, bias, qweight.shape[0], None)
    return int8_weight_only_linear_ref(x, qweight, scales, bias)


def int4_weight_only_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W + bias with W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n] (W4A16, GPTQ packing).

    On CUDA, M < DEQUANT_GEMM_MIN_M_INT4 (64, measured: see the constant) runs the fused Triton GEMV / GEMM (2-16
    fp16 / bf16 rows, 2-256 with HAYABUSA_WO_MID_M: kernels/wo_small_m.py, USE_WO_SMALL_M); from there on W is
    dequantized to x's dtype (dequantize_int4_to, a temporary [N, K]) and F.linear (cuBLAS) multiplies.

    Args:
        x: [M, K] float16/bfloat16/float32, any strides; K a multiple of 8 and of group_size.
        qweight: [K // 8, N] int32, contiguous; the int32 at [i, n] holds k = 8i + j in bits 4j..4j+3.
        scales, zeros: [K // G, N], x's dtype; zeros hold integers 0..15.
        group_size: G, consecutive k sharing a scale and zero: 32, 64, 128, or K (any multiple of 8 dividing K).
        bias: [N], x's dtype, or None.
    Returns:
        [M, N] in x's dtype (fp32 accumulation; on the cuBLAS path W is first rounded to x's dtype).
    Raises:
        ValueError: on a shape, dtype, contiguity, device or group-size mismatch (the message names the argument).
    """
    _check_int4(x, qweight, scales, zeros, group_size, bias)
    if x.is_cuda:
        return _kernel_linear(x, qweight, scales, zeros, bias, qweight.shape[1], group_size)
    return int4_weight_only_linear_ref(x, qweight, scales, zeros, group_size, bias)


def dequantize_int8_to(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = qweight * scales[:, None] as a new [N, K] tensor of dtype, by one Triton kernel (CUDA, or the
    interpreter on CPU); bit for bit dequantize_int8_to_ref (the fp32 product rounded to dtype;
    exact before that rounding for fp16/bf16 scales).

    Args:
        qweight: [N, K] int8, contiguous. scales: [N] float, contiguous, on qweight's device.
        dtype: float16, bfloat16 or float32.
    Raises:
        ValueError: on a shape, dtype, contiguity or device mismatch (the message names the argument).
    """
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be [N, K] int8, got {tuple(qweight.shape)} {qweight.dtype}")
    _check_dequant(qweight, dict(scales=scales), (qweight.shape[0],), dtype)
    return _dequantize(qweight, scales, None, None, dtype)


def dequantize_int4_to(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] (nn.Linear's orientation) with W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n], as a new
    tensor of dtype, by one Triton kernel (CUDA, or the interpreter on CPU) reading the packed layout of
    int4_weight_only_linear; bit for bit dequantize_int4_to_ref (computed in fp32, rounded to dtype;
    exact before that rounding for fp16/bf16 scales).

    Args:
        qweight: [K // 8, N] int32, contiguous. scales, zeros: [K // G, N] float, contiguous, on qweight's device.
        group_size: G, a multiple of 8 dividing K. dtype: float16, bfloat16 or float32.
    Raises:
        ValueError: on a shape, dtype, contiguity, device or group-size mismatch (the message names the argument).
    """
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be [K // 8, N] int32, got {tuple(qweight.shape)} {qweight.dtype}")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    check_group_size(K, group_size)
    _check_dequant(qweight, dict(scales=scales, zeros=zeros), (K // group_size, N), dtype)
    return _dequantize(qweight, scales, zeros, group_size, dtype)


def _check_dequant(qweight: torch.Tensor, named: dict[str, torch.Tensor], shape: tuple[int, ...],
                   dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be float16/bfloat16/float32, got {dtype}")
    if not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous, got strides {qweight.stride()}")
    for name, t in named.items():
        if t.shape != shape or t.dtype not in FLOAT_DTYPES or not t.is_contiguous():
            raise ValueError(f"{name} must be {list(shape)} float and contiguous, got {tuple(t.shape)} {t.dtype}")
        if t.device != qweight.device:
            raise ValueError(f"{name} is on {t.device} but qweight is on {qweight.device}")
