"""Activations. Each formula is the one HF Transformers uses for the same name (ACT2FN), so that float32 outputs
match bit for bit where the ops are the same."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from hayabusa.errors import UnsupportedModelError
from hayabusa.quantization.act_quant import QuantizedActivation, quantize_ref


def silu_and_mul(x: torch.Tensor, quant: str | None = None) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> silu(gate) * up, [..., d] (SwiGLU, Shazeer 2020). ``quant="int8" | "fp8"``
    (x [T, 2d]): a ``QuantizedActivation`` of it instead (quantization/act_quant.py), the same bits as quantizing
    the plain output per token (CUDA: one kernel, ``kernels/fused_act_quant.silu_and_mul_quant``)."""
    if quant is not None:
        if x.is_cuda:
            from hayabusa.kernels.fused_act_quant import silu_and_mul_quant

            xq, s = silu_and_mul_quant(x, quant)
            return QuantizedActivation(xq, s, x.dtype, quant)
        return quantize_ref(silu_and_mul(x), quant)
    if x.is_cuda:
        from hayabusa.kernels.activation import silu_and_mul as fused

        return fused(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> gelu_tanh(gate) * up, [..., d] (GeGLU of Gemma; HF "gelu_pytorch_tanh")."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _gelu_new(x: torch.Tensor) -> torch.Tensor:  # HF NewGELUActivation (GPT-2), written out as HF does
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:  # HF FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:  # HF QuickGELUActivation
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Elementwise activation by its HF config name (``activation_function`` / ``hidden_act``).

    Raises:
        UnsupportedModelError: an activation hayabusa does not implement (the message lists the known ones).
    """
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}.",
                                    parameter="hidden_act", value=name)
    return _ACTIVATIONS[name]
