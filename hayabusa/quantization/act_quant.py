"""Activations quantized by the kernel that makes them (issues #24 / #25): the seam between a producer (RMSNorm with
its residual add, SiLU-and-mul) and the W8A8 linears that consume its output.

Without it every INT8 / FP8 W8A8 linear first launches its own per-token quantizer over an activation that the
norm or the activation function has just written. With it the producer also computes each row's scale and writes
the quantized row (``kernels/fused_act_quant.py``), and the linear takes a ``QuantizedActivation`` in place of x.

Who decides: a decoder layer asks the methods of the linears that read one activation
(``input_quant_of([qkv_proj], M, x)``); each answers ``LinearMethod.input_quant(layer, M)`` -> None or the kind of
per-token dynamic quantization its ``apply`` would do to x itself ("int8" or "fp8"). Only when every consumer names
the same kind does the producer quantize; otherwise it returns the plain activation and nothing changes. The bits
are the same either way: the fused kernels and the CPU path quantize the producer's output in the model dtype with
the separate quantizer's exact arithmetic (``per_token_quant_int8`` / ``per_token_quant_fp8``), so greedy output
does not change with the switch.

Switch: ``HAYABUSA_FUSED_ACT_QUANT`` (read at import; ``USE_FUSED_ACT_QUANT`` / ``USE_FUSED_ACT_QUANT_CUDA`` at call
time). On by default on CPU (plain torch: the producer's output, then the quantizer's torch reference). On CUDA,
unset means "where it was measured to pay" (``USE_FUSED_ACT_QUANT_CUDA = None``): the producer quantizes only when
every consumer's method says its kernel prefers quantized rows at that M and dtype
(``LinearMethod.prefers_quantized_input``: FP8's small-M kernel, whose XQ launch streams the weights without a
quantization step; measured on an H200, 2026-12-03, BENCHMARKS.md). Setting the variable sets both: 1 = always
(where the consumers can take it), 0 = never. ``tests/kernels/test_fused_act_quant_cuda.py`` passed on the H200
in bf16 at every M; fp16 at 256 rows with a residual did not (session 13), so the measured default is bf16 only.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from hayabusa.envs import env_flag

USE_FUSED_ACT_QUANT = env_flag("HAYABUSA_FUSED_ACT_QUANT", True)           # CPU (and any non-CUDA device)
# CUDA: True / False when the variable is set, None (where the consumers prefer it) when not
USE_FUSED_ACT_QUANT_CUDA: bool | None = (env_flag("HAYABUSA_FUSED_ACT_QUANT", False)
                                         if "HAYABUSA_FUSED_ACT_QUANT" in os.environ else None)

ACT_QUANT_KINDS = ("int8", "fp8")


class QuantizedActivation:
    """An activation [M, K] handed to a W8A8 linear already quantized per token.

    Attributes:
        xq: [M, K] int8 ("int8") or float8_e4m3fn ("fp8"), contiguous.
        scale: [M, 1] float32 contiguous; row m of the activation ~= xq[m] * scale[m].
        dtype: the unquantized activation's dtype (the model dtype): the linear's output dtype.
        kind: "int8" or "fp8".
    ``shape`` is xq's, so code that reads only the number of tokens (``x.shape[0]``) needs no change.
    """

    __slots__ = ("xq", "scale", "dtype", "kind")

    def __init__(self, xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, kind: str) -> None:
        self.xq, self.scale, self.dtype, self.kind = xq, scale, dtype, kind

    @property
    def shape(self) -> torch.Size:
        return self.xq.shape

    def __repr__(self) -> str:
        return f"QuantizedActivation({self.kind}, shape={tuple(self.xq.shape)}, dtype={self.dtype})"


def fused_act_quant_enabled(device: torch.device) -> bool | None:
    """The switch for activations on ``device`` (module docstring): True, False, or None (CUDA's default: where
    the consumers prefer quantized rows)."""
    return USE_FUSED_ACT_QUANT_CUDA if device.type == "cuda" else USE_FUSED_ACT_QUANT


def input_quant_of(linears: Iterable[torch.nn.Module | None], M: int, x: torch.Tensor) -> str | None:
    """The quantization the producer of ``x`` [M, K] should apply for its consumers ``linears``: "int8" / "fp8"
    when the switch is on for x's device (or, unset on CUDA, every consumer prefers quantized rows at this M and
    dtype) and every consumer's method answers that same kind, else None (the producer returns its plain output).
    A consumer that is None or has no method counts as a plain one."""
    enabled = fused_act_quant_enabled(x.device)
    if enabled is False:
        return None
    kind = None
    for layer in linears:
        method = getattr(layer, "quant_method", None)
        k = method.input_quant(layer, M) if method is not None else None
        if k is None or (kind is not None and k != kind):
            return None
        if enabled is None and not method.prefers_quantized_input(layer, M, x.dtype):
            return None
        kind = k
    return kind


def quantize_ref(t: torch.Tensor, kind: str) -> QuantizedActivation:
    """The CPU path: ``t`` [M, K] (the producer's output in the model dtype) quantized per token by the separate
    quantizer's torch reference (``per_token_quant_int8_ref`` / ``per_token_quant_fp8_ref``: the same bits as its
    kernel). Raises ValueError naming ``kind`` when it is neither "int8" nor "fp8"."""
    if kind == "int8":
        from hayabusa.kernels.int8_quant import per_token_quant_int8_ref as quant
    elif kind == "fp8":
        from hayabusa.kernels.fp8_quant import per_token_quant_fp8_ref as quant
    else:
        raise ValueError(f"kind must be one of {ACT_QUANT_KINDS}, got {kind!r}")
    xq, s = quant(t.reshape(-1, t.shape[-1]))
    return QuantizedActivation(xq, s, t.dtype, kind)


__all__ = ["QuantizedActivation", "input_quant_of", "fused_act_quant_enabled", "quantize_ref", "ACT_QUANT_KINDS",
           "USE_FUSED_ACT_QUANT", "USE_FUSED_ACT_QUANT_CUDA"]
