"""Fused residual add + RMSNorm (kernel + launcher + reference).

Numerics follow HF LlamaRMSNorm: h = x + residual rounded to the model dtype; normalised in fp32; cast back to the
model dtype; multiplied by the weight in the model dtype. With ``gemma=True``, HF Gemma2RMSNorm instead: the
normalised fp32 value is multiplied by (1 + weight) in fp32 and cast back once (Gemma stores weight - 1).
"""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import next_power_of_2, tl, triton
from hayabusa.kernels.pdl import pdl_kwargs, pdl_wait


@triton.jit
def add_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, N, eps, offs, mask,
                      HAS_RES: tl.constexpr, GEMMA: tl.constexpr):
    """One row's (x + residual) (stored to res_out when HAS_RES) and its RMSNorm as fp32, before the one rounding
    to the output dtype. Shared by ``_fused_add_rms_norm_kernel`` and fused_act_quant's ``_rms_norm_quant_kernel``
    so both compute the same bits."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like HF's add
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if GEMMA:  # (x * rsqrt) * (1 + w) in fp32, one rounding
        y = xf * tl.math.rsqrt(var + eps) * (1.0 + w.to(tl.float32))
    else:  # rounded to the model dtype, then times w (Llama)
        normed = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
        y = normed.to(tl.float32) * w.to(tl.float32)
    return y


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                               stride_ro, N, eps, HAS_RES: tl.constexpr, GEMMA: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    y = add_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, N, eps, offs, mask,
                          HAS_RES, GEMMA)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual [T, N] (same dtype), weight [N] -> (rmsnorm(x + residual) [T, N], x + residual [T, N]).

    gemma: Gemma's (1 + weight) variant (see the module docstring).

    Without residual returns (rmsnorm(x), None). Inputs need a unit stride on the last dim. Raises ValueError on
    shape or dtype mismatch.
    """
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, N] with unit last stride and weight [N]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype")
    T, N = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if T == 0:
        return out, res_out
    BLOCK = next_power_of_2(N)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    _fused_add_rms_norm_kernel[(T,)](x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
                                     N, eps, HAS_RES=residual is not None, GEMMA=gemma, BLOCK=BLOCK,
                                     num_warps=4 if BLOCK <= 4096 else 8, **pdl_kwargs(x.device))
    return out, res_out


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch fused_add_rms_norm (the CPU path; same semantics)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (xf * (1.0 + weight.float())).to(x.dtype) if gemma else weight * xf.to(x.dtype)
    return out, (x if residual is not None else None)
