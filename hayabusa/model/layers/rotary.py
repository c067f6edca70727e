"""Rotary position embedding (RoFormer, Su et al. 2021), HF's rotate-half layout.

inv_freq comes from transformers' own RoPE init functions for scaled variants (llama3, linear, yarn, longrope),
so a config's ``rope_scaling`` / ``rope_parameters`` mean what they mean in HF.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hayabusa.errors import UnsupportedModelError


def rope_parameters(cfg: Any) -> dict:
    """{'rope_type': ..., 'rope_theta': ..., ...} for transformers 4.x (rope_theta + rope_scaling) and 5.x
    (rope_parameters) configs."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(cfg, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def compute_inv_freq(cfg: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim / 2] fp32, attention_scaling) for the config's RoPE variant."""
    params = rope_parameters(cfg)
    rope_type = params["rope_type"]
    rot_dim = int(head_dim * getattr(cfg, "partial_rotary_factor", 1.0))
    if rope_type == "default":
        theta = float(params["rope_theta"])
        inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise UnsupportedModelError(
            "rope_type 'dynamic' (dynamic NTK scaling) is not supported yet; supported: default, linear, llama3, "
            "yarn, longrope.", parameter="rope_scaling", value=params)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"unknown rope_type {rope_type!r}", parameter="rope_scaling", value=params)
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, H_kv, D] at positions [T] (int64).

    Buffers cos, sin: [max_position, rot_dim] in the model dtype (rotate-half layout: the two halves repeat).
    """

    def __init__(self, cfg: Any, head_dim: int, max_position: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(cfg, head_dim)
        self.rot_dim = inv_freq.numel() * 2
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # [P, rot/2], same fp32 products as HF's matmul
        emb = torch.cat([freqs, freqs], dim=-1)
        # Cache in the model dtype, as HF casts cos/sin to the activations' dtype before use.
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype=dtype, device=device), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], dim=-1)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rot_dim
        if r == x.shape[-1]:
            return x * cos + RotaryEmbedding._rotate_half(x) * sin
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat([xr * cos + RotaryEmbedding._rotate_half(xr) * sin, xp], dim=-1)

    def is_full_width(self, head_dim: int) -> bool:
        """True when the whole head rotates (rot_dim == head_dim, no partial_rotary_factor): the case the Triton
        kernels handle (kernels/rotary.py, and kernels/rope_store_kv.py fused into the KV-cache write)."""
        return self.rot_dim == head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """(q, k) rotated at positions. On CUDA with full-width rotary q and k are rotated in place by one Triton
        kernel (fp32 math, one rounding) and returned; otherwise new tensors from the torch ops in the model dtype.
        Attention layers given this module may instead fuse the kernel into the cache write (bit-identical)."""
        if q.is_cuda and self.is_full_width(q.shape[-1]):  # rotate in place, one kernel for q and k
            from hayabusa.kernels.rotary import rotary_embedding

            rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rot]
        sin = self.sin[positions].unsqueeze(1)
        return self._rope(q, cos, sin), self._rope(k, cos, sin)
