"""FP8 KV-cache formats: what each one can hold, the torch quantize/dequantize that the references use, and the
Triton rounding helper that the kernels need under the CPU interpreter.

Formats (arXiv:2209.05433, "FP8 Formats for Deep Learning"; torch / vLLM names):

    format      torch dtype            Triton type  mantissa  min normal exp  largest finite
    e4m3 (fn)   torch.float8_e4m3fn    fp8e4nv      3 bits    -6              448    (no inf; 0x7f = NaN)
    e5m2        torch.float8_e5m2      fp8e5        2 bits    -14             57344  (IEEE-like, has inf)

Scales (vLLM's kv_cache_dtype semantics): one fp32 scale per layer for K and one for V. A value x is stored as
fp8(clamp(x / scale, -max, max)) (round to nearest, ties to even; saturating, so a large activation becomes +-max,
never inf or NaN) and read back as fp8 * scale.
"""

from __future__ import annotations

import functools

import torch

from hayabusa.kernels._triton import tl, triton

# dtype -> (largest finite value, mantissa bits, exponent of the smallest normal number)
FP8_FORMATS: dict[torch.dtype, tuple[float, int, int]] = {
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def fp8_max(dtype: torch.dtype) -> float:
    return FP8_FORMATS[dtype][0]


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) -> fp8 `dtype`: fp8(clamp(x.float() / scale, -max, max)), round to nearest even."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp(-m, m).to(dtype)


def dequantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """fp8 -> fp32: x.float() * scale."""
    return x.float() * scale


@functools.lru_cache(maxsize=8)
def unit_scale(device: torch.device) -> torch.Tensor:
    """A [1] fp32 tensor holding 1.0 (the default scale when the caller passes None)."""
    return torch.ones(1, dtype=torch.float32, device=device)


def check_scale(name: str, scale: torch.Tensor | None, device: torch.device) -> None:
    """A KV scale is None (1.0) or a one-element fp32 tensor on the cache's device. Raises ValueError."""
    if scale is None:
        return
    if not (isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.dtype == torch.float32
            and scale.device == device):
        got = (tuple(scale.shape), scale.dtype, str(scale.device)) if isinstance(scale, torch.Tensor) else scale
        raise ValueError(f"{name} must be None or a one-element float32 tensor on {device}, got {got!r}")


@triton.jit
def round_to_fp8_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 x (|x| <= the format's max) rounded to the nearest value of an fp8 format, ties to even; still fp32.

    Needed only under TRITON_INTERPRET: Triton 3.6's interpreter converts fp32 -> fp8 by cutting the mantissa and
    adding the first dropped bit without carrying into the exponent (125.0 -> 64.0 in e4m3) and rounds ties up.
    A value already on the fp8 grid converts exactly there, and on a GPU the hardware conversion (cvt.rn.satfinite)
    is round-to-nearest-even anyway. The grid step at x is 2**(max(exp(x), EMIN) - MANT); adding and subtracting
    2**23 steps rounds |x| to a multiple of it in fp32 round-to-nearest-even arithmetic.
    """
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    big = ((e - MANT + 23 + 127) << 23).to(tl.float32, bitcast=True)  # 2 ** (e - MANT + 23)
    r = (tl.abs(x) + big) - big
    sign = (bits >> 31) << 31  # the sign bit alone (keeps -0.0, which 0 - r would not)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


__all__ = ["FP8_FORMATS", "is_fp8", "fp8_max", "unit_scale", "check_scale", "quantize_fp8_ref", "dequantize_fp8_ref",
           "round_to_fp8_grid"]
