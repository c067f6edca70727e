"""per_token_quant_int8: activations [M, K] -> int8 rows and one fp32 scale per row, in one launch (kernel + launcher
+ reference).

The activation half of INT8 W8A8 (quantization/w8a8_int8.py), symmetric, as vLLM's ``scaled_int8_quant`` and
compressed-tensors' int8 "token" / "tensor" activation schemes. Row m of x becomes

    s[m] = max(amax(|x[m, :]|) / 127, MIN_SCALE_INT8)        (dynamic; or one static fp32 scale for every row)
    q[m, k] = clamp(rne(x[m, k] / s[m]), -128, 127)          (round to nearest, ties to even; saturating)

so x ~= q * s. Rounding: ties to even, as vLLM's ``float_to_int8_rn`` (``nearbyint`` in the default rounding mode)
and ``torch.round``; dynamic rows never reach -128 (|x / s| <= 127), a static scale may saturate at -128 / 127
(compressed-tensors' int8 range). The division is IEEE fp32 on both sides (``tl.math.div_rn`` here, a tensor
divisor in torch), so the kernel's bits equal per_token_quant_int8_ref's, the CPU engine's path. (vLLM multiplies
by 127 / amax instead; that differs from the division by an ulp before rounding, i.e. on rare exact ties only.)
"""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import next_power_of_2, tl, triton
from hayabusa.kernels.per_token_quant import check_per_token_quant_inputs, per_token_scales_ref

INT8_MAX = 127.0
# Smallest dynamic scale (fp32's smallest normal): an all-zero row would otherwise divide by zero; it quantizes to 0.
MIN_SCALE_INT8 = 2.0 ** -126
MAX_BLOCK = 4096     # columns one program holds at once (longer rows are read twice: amax, then quantize)


@triton.jit
def round_half_even(v):
    """fp32 -> nearest integer (as fp32), ties to even, for |v| < 2**22. floor and compares only: no libdevice
    (absent from the interpreter) and nothing a compiler could fold away (unlike the 1.5 * 2**23 trick)."""
    t = v + 0.5                         # exact for |v| < 2**22
    f = tl.floor(t)
    return f - tl.where((f == t) & (f - 2.0 * tl.floor(f * 0.5) != 0.0), 1.0, 0.0)


@triton.jit
def _per_token_quant_int8_kernel(
    x_ptr, xq_ptr, s_ptr, static_scale_ptr,   # x: [M, K] (stride_xm, 1); xq: [M, K] int8 contiguous; s: [M] fp32
    stride_xm,
    K: tl.constexpr, BLOCK: tl.constexpr,
    STATIC: tl.constexpr,                     # read the scale from static_scale_ptr ([1] fp32) instead of the amax
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    xq_row = xq_ptr + row * K
    offs = tl.arange(0, BLOCK)
    ONE_BLOCK: tl.constexpr = K <= BLOCK
    if ONE_BLOCK:  # the whole row in registers: x is read once
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
        s = tl.maximum(tl.math.div_rn(amax, 127.0), MIN_SCALE)
    tl.store(s_ptr + row, s)
    if ONE_BLOCK:
        q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(x, s)), -128.0), 127.0)
        tl.store(xq_row + offs, q.to(tl.int8), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK):
            cols = k0 + offs
            xk = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(xk, s)), -128.0), 127.0)
            tl.store(xq_row + cols, q.to(tl.int8), mask=cols < K)


def per_token_quant_int8(x: torch.Tensor,
                         static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of x to int8 with one fp32 scale per row, in one Triton launch (module docstring).

    Args:
        x: [M, K] float32/float16/bfloat16; any row stride, stride 1 on the last dim; finite values. M may be 0.
        static_scale: None (dynamic: a scale per row from its amax), or a one-element float32 tensor on x's device
            used for every row; read on the device, so a captured CUDA graph sees later changes.
    Returns:
        (xq [M, K] int8 contiguous, s [M, 1] float32 contiguous), x ~= xq * s; bit-identical to
        per_token_quant_int8_ref.
    Raises:
        ValueError: on a bad shape, dtype, stride or device of x or static_scale (the message names the argument).
    No host sync: safe to capture in a CUDA graph. On CPU it needs TRITON_INTERPRET=1 (the CPU engine calls
    per_token_quant_int8_ref instead).
    """
    check_per_token_quant_inputs(x, static_scale)
    M, K = x.shape
    xq = torch.empty(M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M == 0:
        return xq, s
    block = min(next_power_of_2(K), MAX_BLOCK)
    _per_token_quant_int8_kernel[(M,)](
        x, xq, s, s if static_scale is None else static_scale,   # the scale pointer is unread when dynamic
        x.stride(0), K=K, BLOCK=block, STATIC=static_scale is not None, MIN_SCALE=MIN_SCALE_INT8,
        num_warps=max(1, min(8, block // 256)),
    )
    return xq, s


def per_token_quant_int8_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Plain-torch per_token_quant_int8 (same arguments and results); also the CPU engine's path and the weight
    quantizer's rounding. x may be any float dtype and static_scale any one-element float tensor here (no checks).
    The scales are per_token_scales_ref's (IEEE division of the amax by 127 on every device); ``torch.round``
    rounds ties to even."""
    tf = x.float()
    s = per_token_scales_ref(tf, static_scale, INT8_MAX, MIN_SCALE_INT8)                    # [M, 1]
    q = torch.round(tf / s).clamp_(-128, 127).to(torch.int8)
    return q, s


__all__ = ["per_token_quant_int8", "per_token_quant_int8_ref", "round_half_even", "INT8_MAX", "MIN_SCALE_INT8"]
