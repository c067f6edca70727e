"""SiLU-and-mul (SwiGLU's gate, Shazeer 2020): kernel + launcher + reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hayabusa.kernels._triton import cdiv, next_power_of_2, tl, triton
from hayabusa.kernels.pdl import pdl_kwargs, pdl_wait


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0)
    # silu rounded to the model dtype first, as F.silu(gate) * up does in torch
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    out = (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2D] = [gate | up] -> silu(gate) * up, [T, D]. Raises ValueError on a bad shape."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, 2D] with unit last stride, got {tuple(x.shape)}")
    T, D = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    BLOCK = min(1024, next_power_of_2(D))
    _silu_and_mul_kernel[(T, cdiv(D, BLOCK))](x, out, x.stride(0), out.stride(0), D, BLOCK=BLOCK,
                                                     **pdl_kwargs(x.device))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
