"""RMSNorm (Zhang & Sennrich 2019) with the residual add fused in, matching HF Llama's numerics."""

from __future__ import annotations

import torch
from torch import nn

from hayabusa.quantization.act_quant import QuantizedActivation, quantize_ref


class RMSNorm(nn.Module):
    """out = weight * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (HF LlamaRMSNorm).

    ``forward(x, residual)`` first adds the residual (x + residual, in the model dtype as HF does) and returns
    ``(normed, new_residual)``; without residual it returns the normed tensor alone. ``quant="int8" | "fp8"``:
    ``normed`` is a ``QuantizedActivation`` instead (quantization/act_quant.py), the same bits as quantizing the
    plain output per token (CUDA: one kernel, ``kernels/fused_act_quant.rms_norm_quant``).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: str | None = None):
        if quant is not None:
            return self._forward_quant(x, residual, quant)
        if x.is_cuda:  # one Triton kernel instead of ~8 torch ops
            from hayabusa.kernels.fused_norm import fused_add_rms_norm

            out, res = fused_add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, res)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _forward_quant(self, x: torch.Tensor, residual: torch.Tensor | None, quant: str):
        if x.is_cuda:  # norm + per-token quantization in one kernel; the plain output is never written
            from hayabusa.kernels.fused_act_quant import rms_norm_quant

            xq, s, res = rms_norm_quant(x, residual, self.weight, self.eps, quant)
            out = QuantizedActivation(xq, s, x.dtype, quant)
        else:
            if residual is not None:
                x = x + residual
            out, res = quantize_ref(self._norm(x), quant), x
        return out if residual is None else (out, res)


class GemmaRMSNorm(nn.Module):
    """out = x / sqrt(mean(x^2) + eps) * (1 + weight), all in fp32 and cast back once (HF Gemma2RMSNorm: Gemma
    stores weight - 1, and multiplies before the cast where Llama multiplies after). Same ``(x, residual)``
    interface as RMSNorm; on CUDA the fused Triton kernel (``gemma=True``), else plain torch."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:  # one Triton kernel instead of ~10 torch ops (four norms per Gemma 2 layer)
            from hayabusa.kernels.fused_norm import fused_add_rms_norm

            out, res = fused_add_rms_norm(x.reshape(-1, x.shape[-1]), None if residual is None else
                                          residual.reshape(-1, x.shape[-1]), self.weight, self.eps, gemma=True)
            out = out.view(x.shape)
            return out if residual is None else (out, res.view(x.shape))
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.Module):
    """torch LayerNorm (weight and bias; GPT-2, OPT) with RMSNorm's ``(x, residual)`` interface.
    ``elementwise_affine=False`` (OPT's ``layer_norm_elementwise_affine``): no weight and no bias."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 elementwise_affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = (nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
                       if elementwise_affine else None)
        self.bias = (nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)
                     if elementwise_affine else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        out = torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return out if residual is None else (out, x)


def norm_first(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
               quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first norm: ``(norm(x + residual), x + residual)``, where the first layer starts the
    residual stream (residual None) with x itself. ``norm`` is any of this module's norms; ``quant`` (RMSNorm
    only) as RMSNorm.forward's."""
    kw = {} if quant is None else {"quant": quant}
    if residual is None:
        return norm(x, **kw), x
    return norm(x, residual, **kw)
