"""int8_scaled_mm: INT8 W8A8's matmul, int8 x int8 -> int32 with the dequantization fused into the epilogue
(kernel + launchers + reference).

    y [M, N] = ((acc [M, N] as fp32) * s_x [M, 1]) * s_w [1, N]  (+ bias [N], in fp32),  cast to the output dtype
    acc[m, n] = sum_k xq[m, k] * wq[n, k]                             exact int32 (|acc| <= 128 * 127 * K)

xq [M, K] int8 with per-token (or one static) scales s_x fp32 (kernels/int8_quant.py), wq [N, K] int8 with
per-output-channel scales s_w fp32. Three ways to run it, one result up to the epilogue's fp32 rounding:
  * Triton (CUDA sm80+, or the interpreter): ``_int8_gemm_kernel``, ``tl.dot`` on int8 tiles with an int32
    accumulator (the int8 tensor cores: mma.s8.s32 on Ampere, wgmma on Hopper), the epilogue fused. When the
    output tiles cannot fill the GPU (decode, small M), K is split and the splits add their int32 partial sums
    with atomics into a zeroed int32 workspace: integer addition is exact and order-free, so split-K stays
    deterministic; ``_int8_epilogue_kernel`` then scales once.
  * ``torch._int_mm`` (cuBLASLt int8, CUDA): for M > 16, K >= 16, K and N multiples of 8, from ``INT_MM_MIN_M`` rows
    (None by default: measured slower than the Triton kernel);
    its int32 result goes through the same ``_int8_epilogue_kernel`` (one pass: read int32, write the output).
  * the reference (CPU engine): the products summed in float64 (every partial sum is an integer below 2**53, so
    this *is* the int32 accumulation, bit for bit), then the same fp32 epilogue.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels._triton import cdiv, tl, triton
from hayabusa.kernels.quant_linear import bf16_rne, gemm_shape_class

# From this many rows (tokens) on, the CUDA path multiplies with torch._int_mm (cuBLASLt) instead of the Triton
# kernel; None: never. Measured on the H200 (run N, 2026-12-01, `python benchmarks/kernels/bench_quant_linear.py
# --w8a8`, Qwen2.5-7B linears): _int_mm plus its epilogue was slower than the Triton kernel at every M from 64 to
# 8192 on all four layers (M = 8192: qkv 438 vs 221 us, gate_up 3,815 vs 1,901 us), so it is off. Read at call
# time (tests change it).
INT_MM_MIN_M: int | None = None
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _scale_and_store(acc_f32, rows, offs_n, m_mask, n_mask, sx_ptr, sw_ptr, bias_ptr, out_ptr, stride_om,
                     HAS_BIAS: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """out[rows, offs_n] = (acc * s_x[rows]) * s_w[offs_n] (+ bias), all fp32, then one cast to out's dtype."""
    sx = tl.load(sx_ptr + rows, mask=m_mask, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    y = (acc_f32 * sx[:, None]) * sw[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if BF16_BY_HAND:
        y = bf16_rne(y)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int8_gemm_kernel(xq_ptr, wq_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr, acc_ptr,
                      M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, BF16_BY_HAND: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped launch order: GROUP_M row tiles sweep the N tiles together, so weight tiles are reused from L2
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask, n_mask = rows < M, offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = xq_ptr + rows[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = wq_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]          # [BLOCK_K, BLOCK_N]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0)
        else:
            k_mask = offs_k < k_end
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0)
            w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0)
        acc = tl.dot(x, w, acc, out_dtype=tl.int32)
    if SPLIT:  # int32 partial sums: exact and order-free, so the atomics stay deterministic
        tl.atomic_add(acc_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :],
                      sem="relaxed")
    else:
        _scale_and_store(acc.to(tl.float32), rows, offs_n, m_mask, n_mask, sx_ptr, sw_ptr, bias_ptr, out_ptr,
                         stride_om, HAS_BIAS, BF16_BY_HAND)


@triton.jit
def _int8_epilogue_kernel(acc_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr, M, N, stride_am, stride_om,
                          HAS_BIAS: tl.constexpr, BF16_BY_HAND: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """out = acc [M, N] int32 dequantized (the epilogue of split-K and of the torch._int_mm path): one pass."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask, n_mask = rows < M, offs_n < N
    acc = tl.load(acc_ptr + rows[:, None] * stride_am + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :],
                  other=0)
    _scale_and_store(acc.to(tl.float32), rows, offs_n, m_mask, n_mask, sx_ptr, sw_ptr, bias_ptr, out_ptr,
                     stride_om, HAS_BIAS, BF16_BY_HAND)


# ---------------------------------------------------------------------------------------------------- launch
@dataclass(frozen=True)
class Int8GemmConfig:
    """Tile sizes and requested K splits of one Triton launch (the launcher drops empty splits)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    """SM count (the interpreter gets a small fixed "GPU", so CPU tests see split-K)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# Launches of _int8_gemm_kernel, keyed by (M bucket (int8_m_bucket), shape class (quant_linear.gemm_shape_class:
# "square" qkv / o, "wide" gate_up, "deep" down)) -> (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages);
# SPLIT_K 0 = split K only when the output tiles do not fill the SMs (to about two programs per SM, each split >= 2
# K tiles, at most 16), else the number of K splits asked for. _INT8_BEFORE_TABLE is the launch this module used
# before the table (run N2, 2026-12-01: the same for every shape class); buckets 512 and 8192 still use it.
# Buckets 16..256 measured on the H200 (2026-12-03, commit 834bf9f, `python benchmarks/kernels/bench_quant_linear.py
# --sweep-w8a8 --budget-s 170`, Qwen2.5-7B layers, CUDA-graph medians; benchmarks/results/
# 2026-12-03_h200_834bf9f.w8a8_sweep.json): per (class, M) the candidate with the least us summed over the class's
# layers, kept at the old launch where that was faster (128 square: 26.0 old vs 26.7 for (64, 64, 128, 0, 4, 4),
# which splits o's K 3 ways: 16.1 us; 32 deep: 25.8 vs 26.0). Summed us at M = 16 / 32 / 64 / 128 / 256, old -> new:
#   square (qkv + o): 16.6 22.3 28.8 26.0 28.6 -> 16.6 19.4 25.3 26.0 23.9   (bf16 cuBLAS 15.7 17.1 16.2 18.3 25.1)
#   wide (gate_up):   36.3 39.9 40.2 55.8 87.8 -> 35.8 38.3 37.9 50.7 77.7   (bf16 69.6 71.2 70.2 73.0 113.1)
#   deep (down):      23.4 25.8 29.5 59.0 60.8 -> 23.4 25.8 29.5 35.4 51.7   (bf16 39.5 39.5 40.9 44.6 61.9)
# So for the square class int8 W8A8 is still slower than bf16 cuBLAS up to M = 128 (o at M = 64: best 12.5 us vs bf16
# 7.8; o at M = 128: old launch 12.9, best candidate 16.1 vs bf16 8.5), about even at 256; wide is 1.4-1.9x and deep
# 1.2-1.7x faster than bf16. The int32 accumulation is exact, so any entry gives the same output bits
# (tests/kernels/test_int8_w8a8.py: test_every_table_launch_is_bit_exact; the sweep also compared every candidate's
# output bits with the old launch's on the GPU: none differed).
INT8_M_BUCKETS = (16, 32, 64, 128, 256, 512, 8192)
INT8_SHAPE_CLASSES = ("square", "wide", "deep")
_INT8_BEFORE_TABLE = {16: (16, 64, 128, 0, 4, 4), 32: (64, 64, 128, 0, 4, 4), 64: (64, 64, 128, 0, 4, 4),
                      128: (64, 128, 128, 1, 4, 4), 256: (64, 128, 128, 1, 4, 4), 512: (64, 128, 128, 1, 4, 4),
                      8192: (128, 128, 128, 1, 8, 3)}
INT8_GEMM_TABLE: dict[tuple[int, str], tuple[int, int, int, int, int, int]] = {
    (16, 'deep'): (16, 64, 128, 0, 4, 4),
    (16, 'square'): (16, 64, 128, 0, 4, 4),
    (16, 'wide'): (16, 64, 256, 0, 4, 4),
    (32, 'deep'): (64, 64, 128, 0, 4, 4),
    (32, 'square'): (16, 64, 256, 0, 4, 4),
    (32, 'wide'): (32, 64, 128, 0, 4, 4),
    (64, 'deep'): (64, 64, 128, 0, 4, 4),
    (64, 'square'): (32, 64, 256, 0, 4, 4),
    (64, 'wide'): (64, 128, 128, 0, 8, 3),
    (128, 'deep'): (64, 64, 128, 0, 4, 4),
    (128, 'square'): (64, 128, 128, 1, 4, 4),
    (128, 'wide'): (64, 128, 128, 0, 8, 3),
    (256, 'deep'): (64, 64, 128, 0, 4, 4),
    (256, 'square'): (64, 64, 128, 0, 4, 4),
    (256, 'wide'): (128, 128, 128, 0, 8, 3),
    (512, 'deep'): (64, 128, 128, 1, 4, 4),
    (512, 'square'): (64, 128, 128, 1, 4, 4),
    (512, 'wide'): (64, 128, 128, 1, 4, 4),
    (8192, 'deep'): (128, 128, 128, 1, 8, 3),
    (8192, 'square'): (128, 128, 128, 1, 8, 3),
    (8192, 'wide'): (128, 128, 128, 1, 8, 3),
}


def int8_m_bucket(M: int) -> int:
    """The INT8_GEMM_TABLE row bucket of M rows: the smallest of INT8_M_BUCKETS >= M (the last one past them)."""
    return next((b for b in INT8_M_BUCKETS if M <= b), INT8_M_BUCKETS[-1])


def int8_table_launch(entry: tuple[int, int, int, int, int, int], M: int, N: int, K: int,
                      device: torch.device) -> Int8GemmConfig:
    """The launch of one INT8_GEMM_TABLE entry (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for
    [M, K] x [K, N] on device: SPLIT_K 0 resolved from the tile count and the SM count (see INT8_GEMM_TABLE).

    Raises:
        HayabusaValidationError (a ValueError, parameter "entry"): not 6 ints, tiles not powers of two >= 16,
            SPLIT_K < 0, num_warps not 1 / 2 / 4 / 8 / 16 or num_stages < 1 (the message quotes the entry)."""
    if len(entry) != 6:
        raise HayabusaValidationError(f"INT8_GEMM_TABLE entry needs 6 ints (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, "
                                      f"num_warps, num_stages), got {entry!r}", parameter="entry", value=entry)
    bm, bn, bk, split, warps, stages = entry
    if min(bm, bn, bk) < 16 or any(v & (v - 1) for v in (bm, bn, bk)) or split < 0 \
            or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise HayabusaValidationError(f"INT8_GEMM_TABLE entry needs power-of-two tiles >= 16, SPLIT_K >= 0, "
                                      f"num_warps in 1..16 (a power of two) and num_stages >= 1, got {entry!r}",
                                      parameter="entry", value=entry)
    if split == 0:
        sms = _num_sms(device)
        tiles = cdiv(M, bm) * cdiv(N, bn)
        split = 1 if tiles >= sms else max(1, min(16, cdiv(K, bk) // 2, cdiv(2 * sms, tiles)))
    return Int8GemmConfig(bm, bn, bk, split, warps, stages)


def pick_int8_config(M: int, N: int, K: int, device: torch.device) -> Int8GemmConfig:
    """The launch for [M, K] x [K, N]: INT8_GEMM_TABLE's entry for (M bucket, shape class), resolved for the
    device's SM count (int8_table_launch). Host ints and the SM count only (CUDA-graph safe, the same every run).
    K is split only where the entry asks (SPLIT_K 0: while the output tiles do not fill the SMs), which the
    measured table keeps to small M and few tiles: on the H200 (2026-12-03) the 7B down at M = 128 took 35.4 us with
    64 x 64 tiles split 3 ways against 59.0 us unsplit 64 x 128 tiles, while o at M = 128 took 16.1 us split and 12.9
    unsplit (run N: 128-row tiles split 5 ways, 104 us for o at M = 256)."""
    return int8_table_launch(INT8_GEMM_TABLE[(int8_m_bucket(M), gemm_shape_class(N, K))], M, N, K, device)


def _bf16_by_hand(out: torch.Tensor) -> bool:
    return out.dtype == torch.bfloat16 and out.device.type == "cpu"


def _epilogue(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor) -> torch.Tensor:
    M, N = out.shape
    _int8_epilogue_kernel[(cdiv(M, 32), cdiv(N, 128))](
        acc, sx, sw, bias if bias is not None else out, out, M, N, acc.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BF16_BY_HAND=_bf16_by_hand(out), BLOCK_M=32, BLOCK_N=128, num_warps=4)
    return out


def int8_gemm_triton(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype,
                     cfg: Int8GemmConfig | None = None) -> torch.Tensor:
    """The Triton path (inputs already checked; CUDA, or the interpreter on CPU). Allocates the output and, with
    split-K, a zeroed int32 workspace [M, N]; the grid depends on (M, N, K) only, so a captured graph stays valid."""
    M, K = xq.shape
    N = wq.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    cfg = cfg or pick_int8_config(M, N, K, xq.device)
    k_tiles = cdiv(K, cfg.BLOCK_K)
    tiles_per_split = cdiv(k_tiles, max(1, cfg.SPLIT_K))
    splits = cdiv(k_tiles, tiles_per_split)  # no empty split
    acc = torch.zeros((M, N), dtype=torch.int32, device=xq.device) if splits > 1 else out
    grid = (cdiv(M, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N), splits)
    _int8_gemm_kernel[grid](
        xq, wq, sx, sw, bias if bias is not None else out, out, acc,
        M, N, K, tiles_per_split * cfg.BLOCK_K, xq.stride(0), wq.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, EVEN_K=K % cfg.BLOCK_K == 0, BF16_BY_HAND=_bf16_by_hand(out),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _epilogue(acc, sx, sw, bias, out)
    return out


def int_mm_usable(M: int, N: int, K: int) -> bool:
    """torch._int_mm's shape rules (cuBLASLt int8): more than 16 rows, K >= 16, K and N multiples of 8."""
    return M > 16 and K >= 16 and K % 8 == 0 and N % 8 == 0


def int8_gemm_int_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The torch._int_mm path (CUDA; int_mm_usable shapes; inputs already checked): cuBLASLt's int32 product of
    xq and wq^T (a column-major view of the contiguous [N, K] weight), then the one-pass Triton epilogue."""
    acc = torch._int_mm(xq, wq.t())                                   # [M, N] int32
    out = torch.empty(acc.shape, dtype=out_dtype, device=xq.device)
    return _epilogue(acc, sx, sw, bias, out)


# ---------------------------------------------------------------------------------------------------- public
def int8_scaled_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """y = ((xq @ wq^T as int32, as fp32) * sx) * sw (+ bias), cast to out_dtype (module docstring).

    CUDA: torch._int_mm + the Triton epilogue from INT_MM_MIN_M rows on (when its shape rules hold), else the
    Triton kernel. CPU: the reference.

    Args:
        xq: [M, K] int8, stride 1 on K. sx: [M, 1] float32, contiguous.
        wq: [N, K] int8, contiguous. sw: [N] float32, contiguous.
        bias: [N] (any float dtype; added in fp32) or None.
        out_dtype: float16, bfloat16 or float32.
    Returns:
        [M, N] out_dtype.
    Raises:
        ValueError: on a shape, dtype or device mismatch (the message names the argument).
    """
    _check(xq, sx, wq, sw, bias, out_dtype)
    if not xq.is_cuda:
        return int8_scaled_mm_ref(xq, sx, wq, sw, bias, out_dtype)
    M, K = xq.shape
    if INT_MM_MIN_M is not None and M >= INT_MM_MIN_M and int_mm_usable(M, wq.shape[0], K):
        return int8_gemm_int_mm(xq, sx, wq, sw, bias, out_dtype)
    return int8_gemm_triton(xq, sx, wq, sw, bias, out_dtype)


def int8_scaled_mm_ref(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Plain-torch int8_scaled_mm, any device; the CPU engine's path. The int8 products are summed in float64:
    every partial sum is an integer of magnitude < 2**53, so the sum is exactly the GPU's int32 accumulator."""
    # the exact integer sum, then rounded to fp32 (nearest even) as the kernels' int32 -> fp32 conversion does
    acc = (xq.double() @ wq.double().t()).float()
    y = (acc * sx.float().reshape(-1, 1)) * sw.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _check(xq, sx, wq, sw, bias, out_dtype) -> None:
    if xq.dtype != torch.int8 or xq.dim() != 2 or (xq.stride(1) != 1 and xq.shape[0] > 0):
        raise ValueError(f"xq must be [M, K] int8 with unit stride on K, got {tuple(xq.shape)} {xq.dtype}")
    M, K = xq.shape
    if wq.dtype != torch.int8 or wq.dim() != 2 or wq.shape[1] != K or not wq.is_contiguous():
        raise ValueError(f"wq must be [N, K={K}] int8, contiguous, got {tuple(wq.shape)} {wq.dtype}")
    N = wq.shape[0]
    if sx.shape != (M, 1) or sx.dtype != torch.float32 or not sx.is_contiguous():
        raise ValueError(f"sx must be [M={M}, 1] float32 contiguous, got {tuple(sx.shape)} {sx.dtype}")
    if sw.shape != (N,) or sw.dtype != torch.float32 or not sw.is_contiguous():
        raise ValueError(f"sw must be [N={N}] float32 contiguous, got {tuple(sw.shape)} {sw.dtype}")
    if bias is not None and (bias.shape != (N,) or not bias.dtype.is_floating_point):
        raise ValueError(f"bias must be [N={N}] float or None, got {tuple(bias.shape)} {bias.dtype}")
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float16/bfloat16/float32, got {out_dtype}")
    for name, t in (("sx", sx), ("wq", wq), ("sw", sw), ("bias", bias)):
        if t is not None and t.device != xq.device:
            raise ValueError(f"{name} is on {t.device} but xq is on {xq.device}")


__all__ = ["int8_scaled_mm", "int8_scaled_mm_ref", "int8_gemm_triton", "int8_gemm_int_mm", "int_mm_usable",
           "pick_int8_config", "Int8GemmConfig", "INT_MM_MIN_M"]
