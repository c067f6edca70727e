"""Activation producers that also quantize what they make, per token, for a W8A8 linear (issues #24 / #25): kernels +
launchers + references.

  * ``rms_norm_quant``: fused residual add + RMSNorm (``fused_norm.py``'s HF Llama numerics) whose output row is
    quantized before it is stored: int8 (``int8_quant.py``) or float8 e4m3 (``fp8_quant.py``) rows + fp32 scales,
    and the new residual x + residual as ``fused_add_rms_norm`` writes it.
  * ``silu_and_mul_quant``: ``activation.py``'s SiLU-and-mul, its output rows quantized the same way.

Bit-identical to the separate path on the same input, i.e. the producer's kernel, then ``per_token_quant_int8`` /
``per_token_quant_fp8`` on its output: the producer's value of each element is computed by the same operations and
rounded to the model dtype first (what the separate path stores and the quantizer reads), then the quantizer's
operations follow: amax of |row| (a max: any order gives the same value), s = max(div_rn(amax, qmax), floor),
q = clamp(round(div_rn(v, s))). The quantized rows are written, the unquantized output is not (no consumer reads
it). Each program owns one row; SiLU-and-mul rows longer than ``MAX_BLOCK`` are computed twice (amax pass, then
quantize pass), which reads the gate and up rows twice instead of writing and re-reading the output. Up to
``COLUMN_PARALLEL_MAX_T`` rows (decode) both take a column-parallel form instead: two launches, the row's values
and amax, then the quantization over (row, column block) programs (same values, same bits).

Only dynamic per-token scales (the decoder's W8A8 linears' default); static input scales keep the separate path.
The references (``rms_norm_quant_ref``, ``silu_and_mul_quant_ref``) are the CPU path: the torch producer, then the
quantizer's torch reference.
"""

from __future__ import annotations

import math

import torch

from hayabusa.kernels._triton import cdiv, next_power_of_2, tl, triton
from hayabusa.kernels.pdl import pdl_kwargs, pdl_wait
from hayabusa.kernels.fp8 import FP8_FORMATS, round_to_fp8_grid
from hayabusa.kernels.fp8_quant import FP8_DTYPE, MIN_SCALE, per_token_quant_fp8_ref
from hayabusa.kernels.fused_norm import add_rms_norm_row, fused_add_rms_norm_ref
from hayabusa.kernels.int8_quant import INT8_MAX, MIN_SCALE_INT8, per_token_quant_int8_ref, round_half_even
from hayabusa.kernels.per_token_quant import FLOAT_DTYPES

FP8_MAX, _MANT, _EMIN = FP8_FORMATS[FP8_DTYPE]          # 448.0, 3, -6 (as fp8_quant.py)
MAX_BLOCK = 4096     # SiLU-and-mul columns one program holds at once (the quantizers' MAX_BLOCK)
# Up to this many rows the producers take their column-parallel form: the row's values and amax first (SiLU-and-mul
# over many programs per row, each storing its columns and their amax; the norm as before plus its amax), then a
# second launch over (row, column block) programs that quantizes. One program per row leaves decode's 1-16 rows on
# 1-16 SMs, where the IEEE divisions of a long row take longer than the launch saved: H200, 2026-12-03,
# bench_fused_act_quant.py at M = 1: SiLU-and-mul-quantize of an 18,944-column row 11.7 us against 1.2 us for the
# plain SiLU-and-mul, RMSNorm-quantize of 3,584 columns 4.7 against 1.7. The same values, amax and divisions, so
# the same bits.
COLUMN_PARALLEL_MAX_T = 16
COL_BLOCK = 1024     # columns per program of the column-parallel launches
KINDS = ("int8", "fp8")


@triton.jit
def _row_scale(amax, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    # div_rn: IEEE division as torch does it, the quantizers' exact expression
    return tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE)


@triton.jit
def _quantize_store(ptr, v, s, mask, FP8: tl.constexpr, QMAX: tl.constexpr, FP8_MANT: tl.constexpr,
                    FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Store fp32 values v quantized by scale s at ptr (per_token_quant_int8 / per_token_quant_fp8's arithmetic)."""
    if FP8:
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -QMAX), QMAX)
        if SOFT_ROUND:  # the CPU interpreter's fp8 cast does not round correctly (see kernels/fp8.py)
            q = round_to_fp8_grid(q, FP8_MANT, FP8_EMIN)
        tl.store(ptr, q.to(ptr.dtype.element_ty), mask=mask)
    else:
        q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(v, s)), -128.0), 127.0)
        tl.store(ptr, q.to(tl.int8), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, xq_ptr, s_ptr, res_out_ptr, h_ptr, amax_ptr, stride_x, stride_r,
                           stride_ro, N, eps, HAS_RES: tl.constexpr, AMAX_ONLY: tl.constexpr, BLOCK: tl.constexpr,
                           FP8: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, FP8_MANT: tl.constexpr,
                           FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # fused_norm's row (GEMMA=False): the same operations as _fused_add_rms_norm_kernel
    out = add_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, N, eps, offs,
                            mask, HAS_RES, False).to(x_ptr.dtype.element_ty)
    # then the quantizer's, on the output as the model dtype holds it (masked lanes are 0: they do not move amax)
    v = out.to(tl.float32)
    amax = tl.max(tl.abs(v), axis=0)
    if AMAX_ONLY:   # column-parallel form: the row and its amax; _quantize_cols_kernel quantizes
        tl.store(h_ptr + row * N + offs, out, mask=mask)
        tl.store(amax_ptr + row, amax)
    else:
        s = _row_scale(amax, QMAX, MIN_SCALE)
        tl.store(s_ptr + row, s)
        _quantize_store(xq_ptr + row * N + offs, v, s, mask, FP8, QMAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)


@triton.jit
def _silu_and_mul_amax_kernel(x_ptr, h_ptr, amax_ptr, stride_x, D, PARTS, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
    """Column-parallel SiLU-and-mul, grid (rows, PARTS): each program stores its BLOCK columns of the row in the
    model dtype and their amax (one of the row's PARTS partials)."""
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    v = _silu_mul(x_ptr + row * stride_x, cols, D, mask)                 # masked lanes: silu(0) * 0 = 0
    tl.store(h_ptr + row * D + cols, v.to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(amax_ptr + row * PARTS + part, tl.max(tl.abs(v), axis=0))


@triton.jit
def _quantize_cols_kernel(h_ptr, amax_ptr, xq_ptr, s_ptr, D, PARTS, PARTS_P2: tl.constexpr, BLOCK: tl.constexpr,
                          FP8: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, FP8_MANT: tl.constexpr,
                          FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows, column blocks): the row's scale from its PARTS amax partials (a max: any order), then BLOCK
    columns of the stored row quantized; the first column block stores the scale."""
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    p = tl.arange(0, PARTS_P2)
    amax = tl.max(tl.load(amax_ptr + row * PARTS + p, mask=p < PARTS, other=0.0), axis=0)
    s = _row_scale(amax, QMAX, MIN_SCALE)
    if blk == 0:
        tl.store(s_ptr + row, s)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    v = tl.load(h_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    _quantize_store(xq_ptr + row * D + cols, v, s, mask, FP8, QMAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)


def _quantize_cols(h: torch.Tensor, amax: torch.Tensor, qdtype: torch.dtype, consts: dict) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
    """The column-parallel form's second launch: h [T, D] (model dtype), amax [T, PARTS] fp32 -> (xq, s)."""
    T, D = h.shape
    parts = amax.shape[1]
    xq = torch.empty(T, D, dtype=qdtype, device=h.device)
    s = torch.empty(T, 1, dtype=torch.float32, device=h.device)
    _quantize_cols_kernel[(T, cdiv(D, COL_BLOCK))](h, amax, xq, s, D, parts,
                                                          PARTS_P2=next_power_of_2(parts), BLOCK=COL_BLOCK,
                                                          num_warps=4, **consts)
    return xq, s


@triton.jit
def _silu_mul(x_row, cols, D, mask):
    """activation._silu_and_mul_kernel's value of columns ``cols`` of one row, in the model dtype, as fp32."""
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + D + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)   # silu rounded to the model dtype first, as F.silu(gate) * up
    return (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, xq_ptr, s_ptr, stride_x, D, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
                               FP8: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                               FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr,
                               PDL: tl.constexpr = False):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    xq_row = xq_ptr + row * D
    offs = tl.arange(0, BLOCK)
    if ONE_BLOCK:  # the whole row in registers: computed once
        v = _silu_mul(x_row, offs, D, offs < D)           # masked lanes: silu(0) * 0 = 0
        s = _row_scale(tl.max(tl.abs(v), axis=0), QMAX, MIN_SCALE)
        tl.store(s_ptr + row, s)
        _quantize_store(xq_row + offs, v, s, offs < D, FP8, QMAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
    else:          # amax pass, then the same values again for the quantize pass (deterministic per element)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for d0 in range(0, D, BLOCK):
            cols = d0 + offs
            acc = tl.maximum(acc, tl.abs(_silu_mul(x_row, cols, D, cols < D)))
        s = _row_scale(tl.max(acc, axis=0), QMAX, MIN_SCALE)
        tl.store(s_ptr + row, s)
        for d0 in range(0, D, BLOCK):
            cols = d0 + offs
            _quantize_store(xq_row + cols, _silu_mul(x_row, cols, D, cols < D), s, cols < D, FP8, QMAX, FP8_MANT,
                            FP8_EMIN, SOFT_ROUND)


def _kind_args(kind: str, device: torch.device) -> tuple[torch.dtype, dict]:
    """(quantized dtype, the kernels' quantizer constants) of ``kind``; ValueError naming ``kind`` otherwise."""
    if kind == "int8":
        return torch.int8, dict(FP8=False, QMAX=INT8_MAX, MIN_SCALE=MIN_SCALE_INT8, FP8_MANT=0, FP8_EMIN=0,
                                SOFT_ROUND=False, **pdl_kwargs(device))
    if kind == "fp8":
        return FP8_DTYPE, dict(FP8=True, QMAX=FP8_MAX, MIN_SCALE=MIN_SCALE, FP8_MANT=_MANT, FP8_EMIN=_EMIN,
                               SOFT_ROUND=device.type == "cpu", **pdl_kwargs(device))
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x + residual) quantized per token, in one launch (module docstring).

    Args:
        x: [T, N] float32/float16/bfloat16, unit last stride.
        residual: None or [T, N] of x's dtype, unit last stride.
        weight: [N] (the norm's weight, normally x's dtype; any float dtype is read as fp32, as
            fused_add_rms_norm reads it, so the bits still match the separate path).
        eps: the norm's epsilon.
        kind: "int8" or "fp8" (e4m3).
    Returns:
        (xq [T, N] int8 / float8_e4m3fn contiguous, s [T, 1] float32, x + residual [T, N] or None without a
        residual); xq, s bit-identical to per_token_quant_{int8,fp8}(fused_add_rms_norm(x, residual, ...)[0]).
    Raises:
        ValueError: naming the argument (x, residual, weight, eps, kind) on a bad shape, dtype, stride, device,
            kind or an eps that is not a finite number >= 0.
    No host sync: safe to capture in a CUDA graph. On CPU it needs TRITON_INTERPRET=1.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, N] float32/float16/bfloat16 with unit last stride, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    qdtype, consts = _kind_args(kind, x.device)
    if not isinstance(weight, torch.Tensor) or weight.shape != (x.shape[1],) or weight.device != x.device:
        got = (tuple(weight.shape), str(weight.device)) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be [N] = [{x.shape[1]}] on {x.device}, got {got}")
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != x.shape
                                 or residual.dtype != x.dtype or residual.stride(-1) != 1
                                 or residual.device != x.device):
        raise ValueError(f"residual must match x in shape and dtype, with unit last stride, on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    T, N = x.shape
    xq = torch.empty(T, N, dtype=qdtype, device=x.device)
    s = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if T == 0:
        return xq, s, res_out
    BLOCK = next_power_of_2(N)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else x      # unwritten without a residual
    cols = T <= COLUMN_PARALLEL_MAX_T               # the norm's row (its warps: its bits), then the quantize launch
    h = torch.empty_like(x) if cols else xq
    amax = torch.empty(T, 1, dtype=torch.float32, device=x.device) if cols else s
    _rms_norm_quant_kernel[(T,)](x, r, weight, xq, s, ro, h, amax, x.stride(0), r.stride(0), ro.stride(0), N, eps,
                                 HAS_RES=residual is not None, AMAX_ONLY=cols, BLOCK=BLOCK,
                                 num_warps=4 if BLOCK <= 4096 else 8, **consts)   # fused_add_rms_norm's warps
    if cols:
        xq, s = _quantize_cols(h, amax, qdtype, consts)
    return xq, s, res_out


def rms_norm_quant_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Plain-torch rms_norm_quant (same arguments and results): fused_add_rms_norm_ref, then the quantizer's
    reference."""
    out, res = fused_add_rms_norm_ref(x, residual, weight, eps)
    xq, s = _quant_ref(kind)(out)
    return xq, s, res


def silu_and_mul_quant(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of x [T, 2D] = [gate | up], quantized per token, in one launch (module docstring).

    Args:
        x: [T, 2D] float32/float16/bfloat16, unit last stride.
        kind: "int8" or "fp8" (e4m3).
    Returns:
        (xq [T, D] int8 / float8_e4m3fn contiguous, s [T, 1] float32), bit-identical to
        per_token_quant_{int8,fp8}(silu_and_mul(x)).
    Raises:
        ValueError: naming the argument (x, kind) on a bad shape, dtype, stride or kind.
    No host sync: safe to capture in a CUDA graph. On CPU it needs TRITON_INTERPRET=1.
    """
    if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] % 2 or x.shape[1] == 0
            or x.dtype not in FLOAT_DTYPES or x.stride(-1) != 1):
        raise ValueError(f"x must be [T, 2D] float32/float16/bfloat16 with D > 0 and unit last stride, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    qdtype, consts = _kind_args(kind, x.device)     # after x's check: a non-tensor x is named, not x.device
    T, D = x.shape[0], x.shape[1] // 2
    if 0 < T <= COLUMN_PARALLEL_MAX_T:
        parts = cdiv(D, COL_BLOCK)
        h = torch.empty(T, D, dtype=x.dtype, device=x.device)
        amax = torch.empty(T, parts, dtype=torch.float32, device=x.device)
        _silu_and_mul_amax_kernel[(T, parts)](x, h, amax, x.stride(0), D, parts, BLOCK=COL_BLOCK, num_warps=4,
                                              **pdl_kwargs(x.device))
        return _quantize_cols(h, amax, qdtype, consts)
    xq = torch.empty(T, D, dtype=qdtype, device=x.device)
    s = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    if T == 0:
        return xq, s
    block = min(next_power_of_2(D), MAX_BLOCK)
    _silu_and_mul_quant_kernel[(T,)](x, xq, s, x.stride(0), D, BLOCK=block, ONE_BLOCK=D <= block,
                                     num_warps=max(1, min(8, block // 256)), **consts)
    return xq, s


def silu_and_mul_quant_ref(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch silu_and_mul_quant (same arguments and results): activation.silu_and_mul_ref, then the
    quantizer's reference."""
    from hayabusa.kernels.activation import silu_and_mul_ref

    return _quant_ref(kind)(silu_and_mul_ref(x))


def _quant_ref(kind: str):
    if kind == "int8":
        return per_token_quant_int8_ref
    if kind == "fp8":
        return per_token_quant_fp8_ref
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


__all__ = ["rms_norm_quant", "rms_norm_quant_ref", "silu_and_mul_quant", "silu_and_mul_quant_ref", "KINDS"]
