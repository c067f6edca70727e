"""small_m_linear: an unquantized (bf16 / fp16) linear for a few rows (decode), streaming the weight once (kernel +
launcher + reference).

    y [M, N] = x [M, K] @ w[:N, :K]^T (+ bias), fp32 accumulation, one rounding to x's dtype

Why (issue #25): at batch-1 decode a linear reads its whole weight to make one row, so its time is the weight's
bytes over the bandwidth it streams at. cuBLAS's GEMMs at M = 1 reach 3.6-3.9 TB/s on a 7B model's gate_up / down /
lm_head but 2.8-3.0 TB/s on qkv / o (the project's W3 profile, BENCHMARKS.md "Where the time goes"), and on the
0.5B shape they stream far below bandwidth (0.61 ms of GEMMs a step against 0.23 ms of weight bytes at copy speed).
The FP8 path's kernel for an x quantized by its producer (kernels/fp8_gemv.py, the XQ launch: one 16-row tl.dot
tile per program, 15 rows masked at batch 1, split-K reduced by each tile's last program) streamed e4m3 weights at
95-97 % of a same-size copy on gate_up at M = 1-16 (2026-12-03). This is that kernel for float weights: the same
tile loop and the same fused split-K reduction (fp8_gemv.splitk_finish), bf16 / fp16 operands into tl.dot.

Numerics: tl.dot's products of bf16 / fp16 values are exact in fp32 and summed in fp32, as cuBLAS's; only the order
of the sums differs (the K split and the MMA's), so a row differs from F.linear by fp32 rounding before the one
cast: not bit-identical, and greedy decoding can part from cuBLAS's after many tokens (a measured fidelity bound,
below). On by default on Hopper (compute capability 9.0+, where the tables were measured), off elsewhere;
``HAYABUSA_SMALL_M_LINEAR=0`` / ``=1`` (read by the model loader) turns it off / on on any CUDA device. Measured on
an H200 (2026-12-04, BENCHMARKS.md "Twentieth session"): with HAYABUSA_PDL, W3 4.26 against 4.59 ms/token on the 7b
shape and 0.92 against 1.06 on the 0.5b shape; stories260K's greedy ids identical on and off, logprobs within 0.061
nats; the engine's CUDA suite (greedy against HF, graphs against eager, speculative decoding, every model) 82 of 82
passed with it and PDL on (session 21).

small_m_silu_linear fuses an MLP's gate_up projection with its SiLU-and-mul (one launch instead of two; the MLP asks
through the Linear method's ``apply_silu_and_mul``): a program holds BLOCK_N gate and BLOCK_N up columns, sums each
as the plain kernel does, rounds both to the model dtype and applies activation.silu_and_mul's operations, so the
result has the bits of the two launches. Only without a K split: the tables' launches for a whole model's gate_up
("wide", N >= 4K) have none; a narrower one's (e.g. a 7B's 4-way tensor-parallel shard, "square") split K, and such
an MLP runs the two launches.

Launches: SMALL_M_SHAPES keyed by a timed layer's (N, K, M bucket), else SMALL_M_TABLE keyed by (shape class, M
bucket) as FP8Q_TABLE, entries checked by fp8_gemv.check_fp8_entry ("dot" only); no autotune (CUDA-graph safe, the
same every run). Retune with ``benchmarks/kernels/bench_small_m_linear.py --sweep --table-json PATH``, loaded by
``HAYABUSA_SMALL_M_TABLE_JSON``.
"""

from __future__ import annotations

import os

import torch

from hayabusa.envs import env_flag
from hayabusa.kernels._triton import cdiv, tl, triton
from hayabusa.kernels.pdl import HOPPER, capability_at_least, pdl_kwargs, pdl_wait
from hayabusa.kernels.fp8_gemv import (
    FP8_M_BUCKETS, SplitKPlan, dot_tile_setup, fp8_launch, fp8_m_bucket, load_launch_tables, load_w_tile,
    load_x_tile, splitk_finish,
)
from hayabusa.kernels.quant_linear import LaunchConfig, bf16_rne, gemm_shape_class

# Rows up to here take the kernel when the switch is on; more rows: F.linear (cuBLAS), which fills its tensor-core
# tiles from there. One 16-row tl.dot tile, as the FP8 XQ launches.
SMALL_M_MAX = 16
SMALL_M_SWITCH = "HAYABUSA_SMALL_M_LINEAR"
SMALL_M_TABLE_JSON_ENV = "HAYABUSA_SMALL_M_TABLE_JSON"
# The fused gate_up + SiLU-and-mul launch runs only where the gate_up launch is at least this wide (its halves: 32
# columns each). Measured on an H200 (2026-12-04, commit 9c76d06, `bench_small_m_linear.py --layers gate_up`), us,
# fused / two launches: 7b gate_up M=1 64.1 / 66.3, M=16 64.9 / 67.7 (BLOCK_N 64 -> 32); 0.5b 5.4-5.7 / 6.9-7.0 at
# M = 1, 4, 16 (64 -> 32); but 7b M=4, whose launch is 32 wide (16-column halves), 84.4 / 66.5.
FUSED_SILU_MIN_BLOCK_N = 64
_DTYPES = (torch.bfloat16, torch.float16)

# (shape class, M bucket) -> (kind, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); SPLIT_K 0 = from the
# SM count (fp8_gemv.fp8_launch). For layer shapes SMALL_M_SHAPES lacks. Measured on an H200 (2026-12-04, commit
# 87f03ee, `bench_small_m_linear.py --sweep` over the 7b and 0.5b shapes): per class and bucket the launch with the
# least time summed over its layers (bench_small_m_linear.class_cost).
SMALL_M_TABLE: dict[tuple[str, int], tuple[str, int, int, int, int, int, int]] = {
    ('deep', 1): ('dot', 16, 32, 64, 8, 4, 3),
    ('deep', 4): ('dot', 16, 32, 64, 8, 4, 3),
    ('deep', 16): ('dot', 16, 32, 64, 8, 4, 3),
    ('square', 1): ('dot', 16, 64, 64, 8, 4, 3),
    ('square', 4): ('dot', 16, 64, 64, 8, 4, 3),
    ('square', 16): ('dot', 16, 32, 64, 8, 4, 3),
    ('wide', 1): ('dot', 16, 64, 128, 1, 4, 3),
    ('wide', 4): ('dot', 16, 64, 128, 1, 4, 3),
    ('wide', 16): ('dot', 16, 64, 128, 1, 4, 3),
}
# (N, K, M bucket) -> launch, for the layers the sweep timed: each one's fastest candidate, CUDA-graph replay medians
# from the same run (one class-wide launch was up to 20 % slower on the 7b qkv / o). Qwen2.5-7B and -0.5B shapes.
SMALL_M_SHAPES: dict[tuple[int, int, int], tuple[str, int, int, int, int, int, int]] = {
    (4608, 3584, 1): ('dot', 16, 64, 128, 8, 4, 3),  # 7b qkv: 9.0 us, cuBLAS 8.7
    (4608, 3584, 4): ('dot', 16, 64, 128, 8, 4, 3),  # 7b qkv: 9.0 us, cuBLAS 8.3
    (4608, 3584, 16): ('dot', 16, 64, 128, 8, 8, 3),  # 7b qkv: 9.7 us, cuBLAS 7.7
    (3584, 3584, 1): ('dot', 16, 64, 128, 8, 4, 3),  # 7b o: 7.6 us, cuBLAS 9.0
    (3584, 3584, 4): ('dot', 16, 64, 128, 4, 4, 3),  # 7b o: 7.6 us, cuBLAS 8.8
    (3584, 3584, 16): ('dot', 16, 64, 128, 4, 4, 3),  # 7b o: 8.1 us, cuBLAS 8.0
    (37888, 3584, 1): ('dot', 16, 64, 64, 1, 4, 3),  # 7b gate_up: 64.4 us, cuBLAS 70.9
    (37888, 3584, 4): ('dot', 16, 32, 64, 1, 4, 3),  # 7b gate_up: 64.8 us, cuBLAS 71.0
    (37888, 3584, 16): ('dot', 16, 64, 64, 1, 4, 3),  # 7b gate_up: 65.9 us, cuBLAS 71.9
    (3584, 18944, 1): ('dot', 16, 64, 128, 8, 4, 3),  # 7b down: 36.4 us, cuBLAS 39.1
    (3584, 18944, 4): ('dot', 16, 64, 128, 8, 4, 3),  # 7b down: 36.8 us, cuBLAS 39.9
    (3584, 18944, 16): ('dot', 16, 64, 128, 4, 4, 3),  # 7b down: 37.8 us, cuBLAS 39.4
    (152064, 3584, 1): ('dot', 16, 32, 128, 1, 4, 4),  # 7b lm_head: 246.6 us, cuBLAS 258.4
    (152064, 3584, 4): ('dot', 16, 32, 128, 1, 4, 4),  # 7b lm_head: 249.0 us, cuBLAS 260.0
    (152064, 3584, 16): ('dot', 16, 64, 128, 1, 4, 3),  # 7b lm_head: 255.7 us, cuBLAS 263.4
    (1152, 896, 1): ('dot', 16, 64, 128, 16, 8, 3),  # 05b qkv: 4.1 us, cuBLAS 3.7
    (1152, 896, 4): ('dot', 16, 64, 128, 16, 8, 3),  # 05b qkv: 4.2 us, cuBLAS 3.7
    (1152, 896, 16): ('dot', 16, 32, 64, 4, 4, 3),  # 05b qkv: 4.2 us, cuBLAS 3.5
    (896, 896, 1): ('dot', 16, 64, 128, 16, 8, 3),  # 05b o: 4.0 us, cuBLAS 4.3
    (896, 896, 4): ('dot', 16, 64, 128, 16, 8, 3),  # 05b o: 4.0 us, cuBLAS 4.3
    (896, 896, 16): ('dot', 16, 64, 128, 16, 8, 3),  # 05b o: 4.1 us, cuBLAS 3.5
    (9728, 896, 1): ('dot', 16, 64, 64, 1, 4, 3),  # 05b gate_up: 5.6 us, cuBLAS 5.0
    (9728, 896, 4): ('dot', 16, 64, 64, 1, 4, 3),  # 05b gate_up: 5.7 us, cuBLAS 4.9
    (9728, 896, 16): ('dot', 16, 64, 128, 1, 4, 3),  # 05b gate_up: 5.6 us, cuBLAS 4.8
    (896, 4864, 1): ('dot', 16, 32, 128, 8, 4, 4),  # 05b down: 5.9 us, cuBLAS 6.5
    (896, 4864, 4): ('dot', 16, 32, 128, 8, 4, 4),  # 05b down: 5.9 us, cuBLAS 6.6
    (896, 4864, 16): ('dot', 16, 32, 128, 8, 4, 4),  # 05b down: 6.1 us, cuBLAS 6.7
    (151936, 896, 1): ('dot', 16, 64, 128, 1, 4, 3),  # 05b lm_head: 64.4 us, cuBLAS 67.5
    (151936, 896, 4): ('dot', 16, 64, 128, 1, 4, 3),  # 05b lm_head: 66.0 us, cuBLAS 68.9
    (151936, 896, 16): ('dot', 16, 64, 128, 1, 4, 3),  # 05b lm_head: 68.5 us, cuBLAS 71.2
}


# Compute capability from which the kernels are on when HAYABUSA_SMALL_M_LINEAR is unset: where the tables were
# measured (Hopper: the H200 of BENCHMARKS.md). Older GPUs take them with HAYABUSA_SMALL_M_LINEAR=1.
SMALL_M_DEFAULT_CAPABILITY = HOPPER


def small_m_enabled(device: torch.device | None = None) -> bool:
    """Whether the small-M kernels serve ``device``: ``HAYABUSA_SMALL_M_LINEAR`` when set (1 / 0, on any device);
    unset, a CUDA device of compute capability >= SMALL_M_DEFAULT_CAPABILITY (False for None or any other device).
    Raises HayabusaValidationError on a value that is not a switch, on every device."""
    if SMALL_M_SWITCH in os.environ:
        return env_flag(SMALL_M_SWITCH, False)
    return device is not None and capability_at_least(device, SMALL_M_DEFAULT_CAPABILITY)


@triton.jit
def dot_acc(x, w, acc, DOT_FP32: tl.constexpr):
    """acc + x [BM, BK] @ w [BK, BN]: bf16 / fp16 operands (exact products, fp32 sums on the tensor cores), or, in
    the interpreter (numpy), fp32 operands with the same exact products."""
    if DOT_FP32:
        acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _small_m_dot_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
                        M, N, K, k_per_split, splits, stride_xm, stride_wn, stride_om,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    pid_m, pid_n, pid_k, rows, m_mask, offs_n, n_mask, k_start, k_end, w_cols, x_rows = dot_tile_setup(
        x_ptr, w_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_loop = k_start
    if PDL:
        # kernels/pdl.py: this program's first weight tile is loaded BEFORE waiting for the previous kernel (no
        # kernel of the step writes weights: CUTLASS example 63's weight prefetch), so the weights start streaming
        # while that kernel ends; x, the split-K workspace and the counters only after the wait. Every split has
        # at least one tile, and the tiles are summed in the same order as without PDL: the same bits.
        offs_k = k_start + tl.arange(0, BLOCK_K)
        w = load_w_tile(w_cols, offs_k, k_end, n_mask, EVEN_K)
        pdl_wait(PDL)
        acc = dot_acc(load_x_tile(x_rows, offs_k, k_end, m_mask, EVEN_K), w, acc, DOT_FP32)
        k_loop = k_start + BLOCK_K
    for k0 in range(k_loop, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = load_w_tile(w_cols, offs_k, k_end, n_mask, EVEN_K)                               # [BK, BN]
        x = load_x_tile(x_rows, offs_k, k_end, m_mask, EVEN_K)                               # [BM, BK]
        acc = dot_acc(x, w, acc, DOT_FP32)
    splitk_finish(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, lock_ptr,
                   pid_m * tl.num_programs(1) + pid_n, pid_k, splits, M, N, stride_om, HAS_BIAS, SPLIT,
                   FUSED_REDUCE)


@triton.jit
def _to_dtype(v, dtype: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """fp32 -> dtype rounded to nearest even (BF16_BY_HAND: by integer arithmetic, for the interpreter, whose bf16
    cast truncates)."""
    if BF16_BY_HAND:
        r = bf16_rne(v)
    else:
        r = v.to(dtype)
    return r


@triton.jit
def _small_m_silu_dot_kernel(x_ptr, w_ptr, out_ptr, M, D, K, stride_xm, stride_wn, stride_om,
                             EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_HAND: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PDL: tl.constexpr = False):
    """out [M, D] = silu(x @ w[:D]^T) * (x @ w[D:2D]^T): an MLP's gate_up projection and SiLU-and-mul in one launch,
    grid (row tiles, D tiles), no K split. A program holds BLOCK_N gate columns and the same BLOCK_N up columns;
    each product is summed as _small_m_dot_kernel sums it (the same BLOCK_K loop), rounded to out's dtype, then
    combined by activation._silu_and_mul_kernel's operations: the same bits as the two launches."""
    pid_m, pid_n, pid_k, rows, m_mask, offs_n, n_mask, k_start, k_end, w_gate, x_rows = dot_tile_setup(
        x_ptr, w_ptr, M, D, K, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N)
    # tl.cast, not D.to: on the GPU an int argument equal to 1 arrives as a constexpr (a Python int)
    w_up = w_gate + tl.cast(D, tl.int64) * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_loop = 0
    if PDL:  # as _small_m_dot_kernel: the first weight tiles before the wait, x after it
        offs_k = tl.arange(0, BLOCK_K)
        wg = load_w_tile(w_gate, offs_k, K, n_mask, EVEN_K)
        wu = load_w_tile(w_up, offs_k, K, n_mask, EVEN_K)
        pdl_wait(PDL)
        x = load_x_tile(x_rows, offs_k, K, m_mask, EVEN_K)
        acc_g = dot_acc(x, wg, acc_g, DOT_FP32)
        acc_u = dot_acc(x, wu, acc_u, DOT_FP32)
        k_loop = BLOCK_K
    for k0 in range(k_loop, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_x_tile(x_rows, offs_k, K, m_mask, EVEN_K)
        acc_g = dot_acc(x, load_w_tile(w_gate, offs_k, K, n_mask, EVEN_K), acc_g, DOT_FP32)
        acc_u = dot_acc(x, load_w_tile(w_up, offs_k, K, n_mask, EVEN_K), acc_u, DOT_FP32)
    dtype = out_ptr.dtype.element_ty
    g = _to_dtype(acc_g, dtype, BF16_BY_HAND).to(tl.float32)
    u = _to_dtype(acc_u, dtype, BF16_BY_HAND).to(tl.float32)
    s = _to_dtype(g / (1.0 + tl.exp(-g)), dtype, BF16_BY_HAND).to(tl.float32)
    y = _to_dtype(s * u, dtype, BF16_BY_HAND)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


def pick_small_m_config(M: int, N: int, K: int, device: torch.device) -> LaunchConfig:
    """The launch for [M, K] x [K, N] at M's bucket (the smallest FP8_M_BUCKETS entry >= M; the largest past
    them): SMALL_M_SHAPES's for a layer shape the sweep timed, else SMALL_M_TABLE's for its shape class. Host ints
    and the SM count only, so the same every call (CUDA-graph safe)."""
    bucket = fp8_m_bucket(M)
    entry = SMALL_M_SHAPES.get((N, K, bucket)) or SMALL_M_TABLE[(gemm_shape_class(N, K), bucket)]
    return fp8_launch(entry, M, N, K, device)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, N: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.dim() != 2 or x.shape[1] == 0 \
            or (x.stride(1) != 1 and x.shape[0] > 0):
        got = (tuple(x.shape), x.dtype, x.stride()) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [M, K > 0] bfloat16 or float16 with a unit last stride, got {got}")
    if not isinstance(weight, torch.Tensor) or weight.dtype != x.dtype or weight.dim() != 2 \
            or weight.stride(1) != 1:
        got = ((tuple(weight.shape), weight.dtype, weight.stride()) if isinstance(weight, torch.Tensor)
               else type(weight).__name__)
        raise ValueError(f"weight must be [N', K'] {x.dtype} (x's dtype) with a unit last stride, got {got}")
    if weight.shape[1] < x.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} columns, fewer than x's K = {x.shape[1]}")
    if isinstance(N, bool) or not isinstance(N, int) or not 0 < N <= weight.shape[0]:
        raise ValueError(f"out_features must be an int in 1..{weight.shape[0]} (weight rows), got {N!r}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (N,) or bias.dtype != x.dtype
                             or not bias.is_contiguous()):
        got = (tuple(bias.shape), bias.dtype) if isinstance(bias, torch.Tensor) else bias
        raise ValueError(f"bias must be [N={N}] {x.dtype} contiguous or None, got {got}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   out_features: int | None = None, cfg: LaunchConfig | None = None) -> torch.Tensor:
    """x @ weight[:N]^T (+ bias) for a few rows, the weight streamed once (module docstring); sized for M <=
    SMALL_M_MAX (more rows run the largest bucket's launch: correct, slower than F.linear there).

    Args:
        x: [M, K] bfloat16 or float16, unit last stride (any row stride); M may be 0.
        weight: [N', K'] in x's dtype, unit last stride, N' >= N, K' >= K (rows N.. and columns K.. ignored).
        bias: [N] in x's dtype, contiguous, or None (added in fp32 before the cast).
        out_features: N (default N').
        cfg: a launch (bench sweeps and tests): kind "dot"; default pick_small_m_config's.
    Returns:
        [M, N] in x's dtype: small_m_linear_ref's value up to the fp32 summation order.
    Raises:
        ValueError: a bad shape, dtype, stride or device, or a cfg that is not a "dot" launch (the message names
            the argument).
    No host sync; the grid depends on (M, N, K) only: safe to capture in a CUDA graph. On CPU it needs
    TRITON_INTERPRET=1.
    """
    N = weight.shape[0] if out_features is None and isinstance(weight, torch.Tensor) else out_features
    _check(x, weight, bias, N)
    M, K = x.shape
    # the interpreter's bf16 / fp16 cast truncates (Triton 3.6): on CPU the kernel writes fp32 and torch rounds
    # once, to nearest even, as the GPU's cast does
    on_cpu = x.device.type == "cpu"
    out = torch.empty((M, N), dtype=torch.float32 if on_cpu else x.dtype, device=x.device)
    if M == 0:
        return out.to(x.dtype)
    cfg = cfg or pick_small_m_config(M, N, K, x.device)
    if cfg.kind != "dot" or min(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) < 16:
        raise ValueError(f"cfg must be a 'dot' launch with tiles >= 16, got {cfg}")
    plan = SplitKPlan.of(M, N, K, cfg, out)
    _small_m_dot_kernel[plan.grid](
        x, weight, bias if bias is not None else out, out, plan.part, plan.locks if plan.locks is not None else out,
        M, N, K, plan.k_per_split, plan.splits, x.stride(0), weight.stride(0), out.stride(0),
        **split_dot_launch_kwargs(plan, cfg, K, bias is not None, x.device))
    plan.finish(bias, out)
    return out.to(x.dtype) if on_cpu else out


def split_dot_launch_kwargs(plan: SplitKPlan, cfg: LaunchConfig, K: int, has_bias: bool,
                            device: torch.device) -> dict:
    """The launch keywords a 16-row tl.dot kernel with the fused split-K reduction takes (_small_m_dot_kernel,
    wo_small_m's kernel): the split plan's flags, cfg's tiles, warps and stages, PDL's, and DOT_FP32 on CPU (the
    interpreter)."""
    return dict(HAS_BIAS=has_bias, SPLIT=plan.splits > 1, FUSED_REDUCE=plan.locks is not None,
                EVEN_K=K % cfg.BLOCK_K == 0, DOT_FP32=device.type == "cpu",
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(device))


def small_m_silu_config(M: int, D: int, K: int, device: torch.device) -> LaunchConfig | None:
    """The fused gate_up + SiLU-and-mul launch for x [M, K] and a [2D, K] weight: the gate_up layer's own small-M
    launch (pick_small_m_config(M, 2D, K)) with BLOCK_N halved (two tiles a program: the same weight bytes a stage,
    the same programs), or None where that launch splits K (the fused kernel has no split-K reduction; the tables'
    gate_up launches do not split), where it is narrower than FUSED_SILU_MIN_BLOCK_N, or M > SMALL_M_MAX."""
    if M > SMALL_M_MAX:
        return None
    cfg = pick_small_m_config(M, 2 * D, K, device)
    if cfg.SPLIT_K != 1 or cfg.BLOCK_N < FUSED_SILU_MIN_BLOCK_N:
        return None
    return LaunchConfig("dot", BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N // 2, BLOCK_K=cfg.BLOCK_K,
                        SPLIT_K=1, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def small_m_silu_linear(x: torch.Tensor, weight: torch.Tensor, cfg: LaunchConfig | None = None) -> torch.Tensor:
    """silu(x @ weight[:D]^T) * (x @ weight[D:]^T) in one launch, D = weight.shape[0] // 2: an MLP's gate_up
    projection (rows [gate | up], as ``Linear(K, [D, D])`` stores them) and its SiLU-and-mul, for a few rows.

    Args:
        x: [M, K] bfloat16 or float16, unit last stride (any row stride); M may be 0.
        weight: [2D, K] in x's dtype, unit last stride.
        cfg: a launch (tests, bench); default small_m_silu_config's.
    Returns:
        [M, D] in x's dtype: the same bits as ``activation.silu_and_mul(small_m_linear(x, weight))`` with the
        gate_up launch whose BLOCK_K this shares (no bias: a gate_up with one takes the two launches).
    Raises:
        ValueError: a bad shape, dtype, stride or device, an odd number of weight rows, a cfg that is not a "dot"
            launch without a K split, or no cfg where small_m_silu_config has none (the message names it).
    No host sync; the grid depends on (M, D) only: CUDA-graph safe. On CPU it needs TRITON_INTERPRET=1.
    """
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"weight must have an even number of rows [gate | up], got {tuple(weight.shape)}")
    _check(x, weight, None, weight.shape[0] if isinstance(weight, torch.Tensor) else 0)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} columns, x has K = {x.shape[1]}")
    M, K = x.shape
    D = weight.shape[0] // 2
    out = torch.empty((M, D), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if cfg is None:
        cfg = small_m_silu_config(M, D, K, x.device)
        if cfg is None:
            raise ValueError(f"cfg: no fused launch for x [{M}, {K}] and D = {D} (more than SMALL_M_MAX = "
                             f"{SMALL_M_MAX} rows, or the gate_up launch splits K); pass one or run the two launches")
    if cfg.kind != "dot" or cfg.SPLIT_K != 1 or min(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) < 16:
        raise ValueError(f"cfg must be a 'dot' launch with tiles >= 16 and SPLIT_K 1, got {cfg}")
    on_cpu = x.device.type == "cpu"
    grid = (cdiv(M, cfg.BLOCK_M), cdiv(D, cfg.BLOCK_N))
    _small_m_silu_dot_kernel[grid](
        x, weight, out, M, D, K, x.stride(0), weight.stride(0), out.stride(0),
        EVEN_K=K % cfg.BLOCK_K == 0, DOT_FP32=on_cpu, BF16_BY_HAND=on_cpu and x.dtype == torch.bfloat16,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x.device))
    return out


def small_m_silu_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain torch: each half's product summed in fp32 and rounded to x's dtype, then F.silu(gate) * up."""
    h = small_m_linear_ref(x, weight)
    D = weight.shape[0] // 2
    return torch.nn.functional.silu(h[:, :D]) * h[:, D:]


def small_m_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       out_features: int | None = None) -> torch.Tensor:
    """Plain torch, same arguments and result: the products summed in fp32 (+ bias in fp32), one rounding."""
    N = weight.shape[0] if out_features is None else out_features
    y = x.float() @ weight[:N, :x.shape[1]].float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def silu_and_mul_small_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``activation.silu_and_mul(linear_small_m(x, weight, bias))`` in one launch (small_m_silu_linear) where it
    applies: x [..., K] with 1..SMALL_M_MAX rows in bf16 / fp16 on CUDA (or the interpreter), a [2D, K] weight of
    its dtype and device with a unit last stride, no bias, a launch without a K split. Else None: the caller runs
    the two steps."""
    x2 = _small_m_rows(x, weight)
    if bias is not None or x2 is None or weight.shape[0] % 2:
        return None
    cfg = small_m_silu_config(x2.shape[0], weight.shape[0] // 2, x2.shape[1], x.device)
    if cfg is None:
        return None
    return small_m_silu_linear(x2, weight, cfg).view(*x.shape[:-1], weight.shape[0] // 2)


def _small_m_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] as [rows, K] (a view) where the small-M kernels take it with this weight: 1..SMALL_M_MAX rows in
    bf16 / fp16 on CUDA (or the interpreter: CPU tests), a weight [N > 0, K] of x's dtype and device with a unit
    last stride, unit last stride after the reshape; else None (linear_small_m and silu_and_mul_small_m)."""
    K = x.shape[-1] if x.dim() else 0
    rows = x.numel() // K if K else 0
    on_triton = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not (0 < rows <= SMALL_M_MAX) or x.dtype not in _DTYPES or not on_triton or weight.dim() != 2 \
            or weight.shape[1] != K or weight.shape[0] == 0 or weight.dtype != x.dtype \
            or weight.device != x.device or weight.stride(-1) != 1:
        return None
    x2 = x.reshape(rows, K)
    return x2 if x2.stride(-1) == 1 else None


def linear_small_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's signature and result up to the fp32 summation order: x [..., K] with at most SMALL_M_MAX rows in
    bf16 / fp16 and a weight [N > 0, K] of x's dtype and device with a unit last stride takes small_m_linear (a
    bias of x's dtype and device that broadcasts to [N] made contiguous first), anything else F.linear, errors
    included (a weight of another K). The loader puts it in place of F.linear for the unquantized linears and the
    lm_head where small_m_enabled (model/loader.py)."""
    x2 = _small_m_rows(x, weight)
    if x2 is not None:
        N = weight.shape[0]
        if bias is not None:
            if bias.dtype != x.dtype or bias.device != x.device or bias.dim() > 1 or bias.numel() not in (1, N):
                return torch.nn.functional.linear(x, weight, bias)
            bias = bias.expand(N).contiguous()      # the layer's own bias: already so, no copy
        return small_m_linear(x2, weight, bias).view(*x.shape[:-1], N)
    return torch.nn.functional.linear(x, weight, bias)


def load_small_m_tables(path: str, env: str | None = None) -> dict[str, int]:
    """Update SMALL_M_TABLE and SMALL_M_SHAPES in place from the JSON that ``bench_small_m_linear.py --sweep
    --table-json`` wrote (what ``HAYABUSA_SMALL_M_TABLE_JSON`` names; fp8_gemv.load_launch_tables, "dot" launches
    only). Returns how many entries each took. Raises ValueError naming the file and the bad row (with ``env``, a
    HayabusaValidationError naming that variable)."""
    return load_launch_tables(path, {"SMALL_M_TABLE": SMALL_M_TABLE, "SMALL_M_SHAPES": SMALL_M_SHAPES}, env=env,
                              dot_only=("SMALL_M_TABLE", "SMALL_M_SHAPES"), shape_keyed=("SMALL_M_SHAPES",),
                              writer="benchmarks/kernels/bench_small_m_linear.py --sweep --table-json PATH")


if os.environ.get(SMALL_M_TABLE_JSON_ENV):
    load_small_m_tables(os.environ[SMALL_M_TABLE_JSON_ENV], env=SMALL_M_TABLE_JSON_ENV)


__all__ = ["FP8_M_BUCKETS", "FUSED_SILU_MIN_BLOCK_N", "SMALL_M_MAX", "SMALL_M_SHAPES", "SMALL_M_TABLE", "dot_acc",
           "linear_small_m", "load_small_m_tables", "pick_small_m_config", "silu_and_mul_small_m", "small_m_enabled",
           "small_m_linear", "small_m_linear_ref",
           "small_m_silu_config", "small_m_silu_linear", "small_m_silu_linear_ref", "split_dot_launch_kwargs",
           "SMALL_M_DEFAULT_CAPABILITY"]
