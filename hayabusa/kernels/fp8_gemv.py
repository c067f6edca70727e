"""fp8_small_m_linear: FP8 W8A8 for a few rows (decode), the per-token activation quantization fused in (kernel +
launcher + reference).

    y [M, N] = (q(x) [M, K] @ w_q[:N, :K]^T) * s_x [M, 1] * s_w [1, N]   (+ bias), cast to x's dtype

with q(x), s_x exactly per_token_quant_fp8's (kernels/fp8_quant.py): s_x[m] = max(amax(|x[m, :]|) / 448, MIN_SCALE)
(IEEE division) or one static scale; q = e4m3(clamp(x / s_x, -448, 448)), round to nearest even. The engine's
other FP8 path is per_token_quant_fp8 + torch._scaled_mm: two launches per linear, and at M = 1-16 cuBLAS /
CUTLASS's FP8 GEMMs stream the weights far below bandwidth (issue #25: batch-1 decode of a 7B model slower in FP8
than in bf16). Here one launch (two with split-K) reads each e4m3 weight once:

  * every program computes the amax of its rows over the WHOLE row itself (x rows are small, K <= ~19k, and stay
    in L2), then quantizes only its K slice: no separate quantize launch and no x_q round trip through memory;
  * rows <= _GEMV_MAX_M: a GEMV, one program per (row, N tile, K split), fp32 FMAs on the weight tile [BLOCK_K,
    BLOCK_N] converted to fp32 (each product of two e4m3 values is exact in fp32), per-thread partial sums reduced
    once after the K loop; the rows of one weight tile are neighbours in launch order (later rows hit L2), as in
    quant_linear's _wo_gemv_kernel;
  * more rows (up to FP8_SMALL_M_MAX): one 16-row tile per program, tl.dot of fp16 operands: e4m3 values are
    exact in fp16, so the products are exact and the tensor cores only change the fp32 summation order;
  * split-K spreads a narrow N over the SMs: the fp32 partials (already times s_x and s_w) go to a workspace
    [splits, M, N] that quant_linear's splitk_reduce adds in split order (+ bias): deterministic, unlike atomics.

The launch is chosen on the host from (M, N, K, SM count), no autotune (CUDA-graph safe, the same every run):
pick_fp8_config; starting points, retune with ``benchmarks/kernels/bench_quant_linear.py --fp8 --sweep``.
The weight is the layer's stored [N', K'] e4m3 (row-major, K contiguous: what ``_scaled_mm`` takes as ``.t()``;
N', K' >= N, K, zero padding ignored): no second copy.
"""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import tl, triton
from hayabusa.kernels.fp8 import FP8_FORMATS, round_to_fp8_grid
from hayabusa.kernels.fp8_quant import FP8_DTYPE, MIN_SCALE, per_token_quant_fp8_ref
from hayabusa.kernels.per_token_quant import check_per_token_quant_inputs
from hayabusa.kernels.quant_linear import LaunchConfig, device_limits, split_k_for, splitk_epilogue, splitk_reduce

# Rows up to here run this kernel (Fp8LinearMethod.apply on CUDA); more rows: per_token_quant_fp8 + _scaled_mm.
# 16: one tl.dot tile; decode batches of 1-16 are where _scaled_mm is far below bandwidth (issue #25). Not yet
# measured against _scaled_mm at 5-16 rows: `bench_quant_linear.py --fp8` prints the crossover; lower it there.
FP8_SMALL_M_MAX = 16
# Rows up to here: the fp32-FMA GEMV (one program per row); 5..16 rows: the 16-row tl.dot tile.
_GEMV_MAX_M = 4
# x elements one step of the amax prologue holds (BLOCK_M x AMAX_BLOCK): 32 per thread for the 8-warp GEMV
_MAX_AMAX_ELEMS = 8192
# The prologue's steps are unrolled (every load in flight at once) while a thread holds at most this many x
# elements in all (7B at M = 1: K = 3584 -> 16, K = 18944 -> 96); a loop beyond (16-row tiles)
_AMAX_UNROLL_ELEMS = 128
FP8_MAX, _MANT, _EMIN = FP8_FORMATS[FP8_DTYPE]          # 448.0, 3, -6


@triton.jit
def _amax_step(acc, x_ptr, rows, m_mask, stride_xm, K, k0, offs):
    cols = k0 + offs
    xk = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :],
                 other=0.0).to(tl.float32)
    return tl.maximum(acc, tl.abs(xk))


@triton.jit
def _row_scales(x_ptr, rows, m_mask, stride_xm, K, static_scale_ptr, STATIC: tl.constexpr,
                BLOCK_M: tl.constexpr, AMAX_BLOCK: tl.constexpr, AMAX_ITERS: tl.constexpr,
                AMAX_UNROLL: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """s [BLOCK_M] fp32: per_token_quant_fp8's scale of each row, from the amax over all K columns (or static).
    AMAX_UNROLL: the AMAX_ITERS chunks unrolled, every chunk's load in flight at once: the prologue then costs
    about one L2 latency before the weights stream, not one per chunk."""
    if STATIC:
        s = tl.load(static_scale_ptr + tl.zeros([BLOCK_M], dtype=tl.int32))
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
def _fp8_small_m_kernel(x_ptr, w_ptr, sw_ptr, bias_ptr, static_scale_ptr, out_ptr, part_ptr,
                        M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
                        STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                        DOT: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_ROUND: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        AMAX_BLOCK: tl.constexpr, AMAX_ITERS: tl.constexpr, AMAX_UNROLL: tl.constexpr,
                        FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                        FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr):
    # grid (row tiles, N tiles, K splits); row tiles vary fastest: the programs sharing a weight tile run together
    pid_k = tl.program_id(2)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = rows < M
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    s = _row_scales(x_ptr, rows, m_mask, stride_xm, K, static_scale_ptr, STATIC, BLOCK_M, AMAX_BLOCK, AMAX_ITERS,
                    AMAX_UNROLL, FP8_MAX, MIN_SCALE)                                                   # [BM] fp32
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn                             # [1, BN]: W is [N', K']
    if DOT:
        x_rows = x_ptr + rows[:, None] * stride_xm                                        # [BM, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # BLOCK_M == 1: x read as a column [BK, 1] beside the weight tile (no transpose in the loop);
        x_rows = x_ptr + rows[None, :] * stride_xm                                        # [1, 1]
        acc2 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)  # per-thread partial sums, reduced after the loop
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        if EVEN_K:  # every tile whole: no column mask (the compiler drops k_mask)
            w = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :], other=0.0)       # [BK, BN] e4m3
        else:
            w = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if DOT:
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)    # [BM, BK]
            else:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            q = _quantize(x.to(tl.float32), s[:, None], FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
            if DOT_FP32:  # the interpreter (numpy): fp32 operands, exact products as well
                acc = tl.dot(q.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:         # e4m3 values are exact in fp16: exact products, fp32 sums
                acc = tl.dot(q.to(tl.float16), w.to(tl.float16), acc)
        else:
            if EVEN_K:
                x = tl.load(x_rows + offs_k[:, None], mask=m_mask[None, :], other=0.0)    # [BK, 1]
            else:
                x = tl.load(x_rows + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            q = _quantize(x.to(tl.float32), s[None, :], FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
            acc2 += w.to(tl.float32) * q.to(tl.float32)                                   # [BK, BN]
    if not DOT:
        acc = tl.sum(acc2, axis=0)[None, :]                                               # [1, BN]
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * s[:, None] * sw[None, :]            # (acc * s_x) * s_w: fp8_matmul_emulated's order
    splitk_epilogue(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, pid_k, M, N, stride_om,
                    HAS_BIAS, SPLIT)


def pick_fp8_config(M: int, N: int, K: int, device: torch.device) -> LaunchConfig:
    """The launch for [M, K] x [K, N] with M <= FP8_SMALL_M_MAX: host ints and the SM count only.

    Starting points, not yet tuned on the device (bench_quant_linear.py --fp8 --sweep): GEMV 64 n x 128 k tiles
    (8 KB of e4m3 per program and step, as the int8 GEMV), about 4 programs per SM; the 16-row tl.dot tile
    16 x 64 x 128, about 2 programs per SM. Split-K keeps >= 2 K tiles per split.
    """
    sms, _ = device_limits(device)
    if M <= _GEMV_MAX_M:
        split = split_k_for(M * triton.cdiv(N, 64), triton.cdiv(K, 128), 4 * sms)
        return LaunchConfig("gemv", BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, num_warps=8, num_stages=1)
    split = split_k_for(triton.cdiv(M, 16) * triton.cdiv(N, 64), triton.cdiv(K, 128), 2 * sms)
    return LaunchConfig("gemm", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=3)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           input_scale: torch.Tensor | None, N: int) -> None:
    check_per_token_quant_inputs(x, input_scale)
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
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be [N={N}] {x.dtype} contiguous or None, got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def fp8_small_m_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                       out_features: int | None = None, cfg: LaunchConfig | None = None) -> torch.Tensor:
    """FP8 W8A8 linear with the activation quantization fused in (module docstring), for M <= FP8_SMALL_M_MAX.

    Args:
        x: [M, K] float32/float16/bfloat16, unit last stride (any row stride); finite values. M may be 0.
        weight: [N', K'] float8_e4m3fn, unit last stride, N' >= N, K' >= K (columns K.. and rows N.. ignored: the
            zero padding Fp8LinearMethod adds for _scaled_mm).
        weight_scale: [N'' >= N] float32 contiguous, one scale per output channel.
        bias: [N] x's dtype contiguous, or None (added in fp32 before the cast).
        input_scale: None (dynamic per-token scales) or a one-element float32 tensor (static), read on the device.
        out_features: N (default N').
        cfg: a launch (bench sweeps and tests); default pick_fp8_config's.
    Returns:
        [M, N] in x's dtype: fp8_small_m_linear_ref's value up to the fp32 summation order (the same e4m3 x_q and
        s_x bits as per_token_quant_fp8).
    Raises:
        ValueError: on a bad shape, dtype, stride or device (the message names the argument).
    No host sync; the grid depends on (M, N, K) only: safe to capture in a CUDA graph. On CPU it needs
    TRITON_INTERPRET=1.
    """
    N = weight.shape[0] if out_features is None else out_features
    _check(x, weight, weight_scale, bias, input_scale, N)
    M, K = x.shape
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = cfg or pick_fp8_config(M, N, K, x.device)
    dot = cfg.kind == "gemm"
    bm = cfg.BLOCK_M if dot else 1
    k_tiles = triton.cdiv(K, cfg.BLOCK_K)
    tiles_per_split = triton.cdiv(k_tiles, max(1, cfg.SPLIT_K))
    splits = triton.cdiv(k_tiles, tiles_per_split)  # no empty split
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(M, bm), triton.cdiv(N, cfg.BLOCK_N), splits)
    amax_block = min(triton.next_power_of_2(K), _MAX_AMAX_ELEMS // bm)
    amax_iters = triton.cdiv(K, amax_block)
    _fp8_small_m_kernel[grid](
        x, weight, weight_scale, bias if bias is not None else out, input_scale if input_scale is not None else out,
        out, part, M, N, K, tiles_per_split * cfg.BLOCK_K, x.stride(0), weight.stride(0), out.stride(0),
        STATIC=input_scale is not None, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        EVEN_K=K % cfg.BLOCK_K == 0, DOT=dot, DOT_FP32=x.device.type == "cpu", SOFT_ROUND=x.device.type == "cpu",
        BLOCK_M=bm, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        AMAX_BLOCK=amax_block, AMAX_ITERS=amax_iters,
        AMAX_UNROLL=amax_iters * amax_block * bm <= _AMAX_UNROLL_ELEMS * 32 * cfg.num_warps,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, FP8_MANT=_MANT, FP8_EMIN=_EMIN,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        splitk_reduce(part, bias, out)
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


__all__ = ["FP8_SMALL_M_MAX", "fp8_small_m_linear", "fp8_small_m_linear_ref", "pick_fp8_config"]
