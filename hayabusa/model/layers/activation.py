"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> silu(gate) * up, [..., d] (SwiGLU, Shazeer 2020)."""
    if x.is_cuda:
        from hayabusa.kernels.activation import silu_and_mul as fused

        return fused(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
