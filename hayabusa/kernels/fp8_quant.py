"""per_token_quant_fp8: activations [M, K] -> e4m3 rows and one fp32 scale per row, in one launch (kernel + launcher
+ reference).

The activation half of FP8 W8A8 (quantization/fp8.py): per-token dynamic scaling as in vLLM's
``dynamic_per_token_scaled_fp8_quant`` and torchao's float8 row-wise recipe. Row m of x becomes

    s[m] = max(amax(|x[m, :]|) / 448, MIN_SCALE)        (dynamic; or one static fp32 scale for every row)
    q[m, k] = e4m3(clamp(x[m, k] / s[m], -448, 448))    (round to nearest, ties to even; saturating)

so x ~= q * s. Done in plain torch that is ~7 launches (float, abs, amax, div, clamp_min, div, clamp + cast) per
linear layer; the kernel is one, with no host sync, so it runs inside a captured CUDA graph. Its bits equal
per_token_quant_fp8_ref's, which is the CPU engine's path: both divide in IEEE fp32 (tl.math.div_rn here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hayabusa.kernels._triton import next_power_of_2, tl, triton
from hayabusa.kernels.pdl import pdl_kwargs, pdl_wait
from hayabusa.kernels.fp8 import FP8_FORMATS, quantize_fp8_ref, round_to_fp8_grid
from hayabusa.kernels.per_token_quant import check_per_token_quant_inputs, per_token_scales_ref

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX, _MANT, _EMIN = FP8_FORMATS[FP8_DTYPE]          # 448.0, 3, -6
# Smallest dynamic scale: an all-zero row would otherwise divide by zero (vLLM uses the same floor).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# Columns one program holds at once: rows up to this long are read once, longer ones twice (amax, then quantize).
MAX_BLOCK = 4096


@triton.jit
def _per_token_quant_fp8_kernel(
    x_ptr, xq_ptr, s_ptr, static_scale_ptr,   # x: [M, K] (stride_xm, 1); xq: [M, OUT_COLS] contiguous; s: [M] fp32
    stride_xm,
    K: tl.constexpr, OUT_COLS: tl.constexpr, BLOCK: tl.constexpr,
    STATIC: tl.constexpr,                     # read the scale from static_scale_ptr ([1] fp32) instead of the amax
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr,
    SOFT_ROUND: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    xq_row = xq_ptr + row * OUT_COLS
    offs = tl.arange(0, BLOCK)
    ONE_BLOCK: tl.constexpr = OUT_COLS <= BLOCK
    if ONE_BLOCK:  # the whole row (and its padding) in registers: x is read once
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.load(static_scale_ptr)
    else:
        if ONE_BLOCK:
            amax = tl.max(tl.abs(x), axis=0)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(xk))
            amax = tl.max(acc, axis=0)
        # div_rn: IEEE division as torch does it (plain `/` is the approximate div.full.f32 on NVIDIA)
        s = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row, s)
    if ONE_BLOCK:
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
        if SOFT_ROUND:  # the CPU interpreter's fp8 cast does not round correctly (see kernels/fp8.py)
            q = round_to_fp8_grid(q, FP8_MANT, FP8_EMIN)
        tl.store(xq_row + offs, q.to(xq_ptr.dtype.element_ty), mask=offs < OUT_COLS)
    else:
        for k0 in range(0, OUT_COLS, BLOCK):
            cols = k0 + offs
            xk = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)   # columns >= K: +0.0
            q = tl.minimum(tl.maximum(tl.math.div_rn(xk, s), -FP8_MAX), FP8_MAX)
            if SOFT_ROUND:
                q = round_to_fp8_grid(q, FP8_MANT, FP8_EMIN)
            tl.store(xq_row + cols, q.to(xq_ptr.dtype.element_ty), mask=cols < OUT_COLS)


def _check_inputs(x: torch.Tensor, static_scale: torch.Tensor | None, out_cols: int | None) -> int:
    """Raises ValueError naming the argument; returns the number of output columns."""
    check_per_token_quant_inputs(x, static_scale)
    K = x.shape[1]
    if out_cols is None:
        return K
    if isinstance(out_cols, bool) or not isinstance(out_cols, int) or out_cols < K:
        raise ValueError(f"out_cols must be None or an int >= K = {K}, got {out_cols!r}")
    return out_cols


def per_token_quant_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                        out_cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of x to float8 e4m3 with one fp32 scale per row, in one Triton launch.

    Per-token dynamic scaling as in vLLM (``scaled_fp8_quant(..., use_per_token_if_dynamic=True)``) and torchao's
    float8 row-wise scaling: s = max(amax(|row|) / 448, MIN_SCALE), q = e4m3(clamp(x / s, -448, 448)), round to
    nearest even. Bit-identical to per_token_quant_fp8_ref (and so to quantization.fp8.quantize_fp8_rows).

    Args:
        x: [M, K] float32/float16/bfloat16; any row stride, stride 1 on the last dim; finite values (a NaN or inf
            row's result is unspecified). M may be 0.
        static_scale: None (dynamic: a scale per row from its amax), or a one-element float32 tensor on x's device
            used for every row; read on the device, so a captured CUDA graph sees later changes.
        out_cols: None (= K), or the number of output columns >= K: columns K.. are +0.0 (e.g. K rounded up to 16
            for torch._scaled_mm).
    Returns:
        (xq [M, out_cols] float8_e4m3fn contiguous, s [M, 1] float32 contiguous), x ~= xq[:, :K] * s.
    Raises:
        ValueError: on a bad shape, dtype, stride or device of x or static_scale, or out_cols < K (the message
            names the argument).
    No host sync and no data-dependent host logic: safe to capture in a CUDA graph. On CPU it needs
    TRITON_INTERPRET=1 (the CPU engine calls per_token_quant_fp8_ref instead).
    """
    cols = _check_inputs(x, static_scale, out_cols)
    M, K = x.shape
    xq = torch.empty(M, cols, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M == 0:
        return xq, s
    block = min(next_power_of_2(cols), MAX_BLOCK)
    _per_token_quant_fp8_kernel[(M,)](
        x, xq, s, s if static_scale is None else static_scale,   # the scale pointer is unread when dynamic
        x.stride(0),
        K=K, OUT_COLS=cols, BLOCK=block, STATIC=static_scale is not None,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, FP8_MANT=_MANT, FP8_EMIN=_EMIN,
        SOFT_ROUND=x.device.type == "cpu",
        num_warps=max(1, min(8, block // 256)), **pdl_kwargs(x.device),
    )
    return xq, s


def per_token_quant_fp8_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                            out_cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch per_token_quant_fp8 (same arguments and results); also the CPU engine's path.

    x may be any float dtype and static_scale any one-element float tensor here (no checks). The scales are
    per_token_scales_ref's (IEEE division of the amax by 448 on every device).
    """
    tf = x.float()
    K = x.shape[1]
    s = per_token_scales_ref(tf, static_scale, FP8_MAX, MIN_SCALE)                        # [M, 1]
    q = quantize_fp8_ref(tf, s, FP8_DTYPE)
    if out_cols is not None and out_cols > K:
        q = F.pad(q.view(torch.uint8), (0, out_cols - K)).view(FP8_DTYPE)                 # zero bytes = +0.0
    return q, s


__all__ = ["per_token_quant_fp8", "per_token_quant_fp8_ref", "MIN_SCALE"]
