"""Attention layer: RoPE (when given the rotary module), write this step's K/V into the paged cache, then attend
over the cache.

Each layer owns its KV-cache scales ``k_scale`` / ``v_scale`` ([1] fp32 buffers, 1.0 unless the checkpoint has
them). They matter only when the cache is fp8 (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2): stored = fp8(x / scale),
read = fp8 * scale (vLLM's semantics). Buffers live on the device at fixed addresses and the kernels read them there,
so CUDA graphs need no host sync and see values loaded after capture.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.errors import HayabusaValidationError
from hayabusa.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Causal multi-head / grouped-query attention over the paged KV cache.

    Args:
        num_heads: H query heads; num_kv_heads: H_kv (H % H_kv == 0); head_dim: D.
        scale: softmax scale (usually D ** -0.5).
        layer_idx: index into ForwardContext.kv_caches.
        sliding_window: attend only to the last ``sliding_window`` keys (HF semantics), None = full.
        softcap: logit soft-capping value (Gemma 2), None = off.
    Buffers:
        k_scale, v_scale: [1] fp32, the fp8 KV cache's per-layer scales (see the module docstring).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_idx = scale, layer_idx
        self.sliding_window, self.softcap = sliding_window, softcap
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
                positions: torch.Tensor | None = None, rotary: RotaryEmbedding | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] (views allowed) -> out [T, H * D].

        With ``rotary`` and ``positions`` ([T] int64), q and k get RoPE first (q may be rotated in place, so the
        caller must not reuse it; k is consumed only by the cache write). The Triton backend does that in the same
        launch as the KV-cache write when the rotary is full-width (backend.rope_and_store_kv); otherwise, and on
        CPU, ``rotary`` runs and then store_kv. Both give the same bits.
        """
        T = q.shape[0]
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if ctx.kv_caches is None:  # memory profiling: no cache yet (RoPE still runs: its memory counts)
            if rotary is not None:
                rotary(positions, q, k)
            return out.view(T, -1)
        meta = ctx.attn_metadata
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        if rotary is not None and ctx.backend.rope_and_store_kv is not None and rotary.is_full_width(self.head_dim):
            ctx.backend.rope_and_store_kv(positions, q, k, v, k_cache, v_cache, meta.slot_mapping, rotary.cos,
                                          rotary.sin, self.k_scale, self.v_scale)
        else:
            if rotary is not None:
                q, k = rotary(positions, q, k)  # [T, H, D], [T, H_kv, D]
            ctx.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        ctx.backend.paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                    meta.block_table, self.scale, meta.max_query_len, num_seqs=meta.num_reqs,
                                    sliding_window=self.sliding_window, softcap=self.softcap,
                                    k_scale=self.k_scale, v_scale=self.v_scale)
        return out.view(T, -1)


# ------------------------------------------------------------------------------------------------ checkpoint scales
# Checkpoint names of KV-cache scales (vLLM's maybe_remap_kv_scale_name and the compressed-tensors / fp8 / quark
# get_cache_scale conventions): suffix after <attn> -> which of our buffers it fills. <attn> is the model's
# self-attention module (e.g. model.layers.0.self_attn) or our Attention itself (model.layers.0.self_attn.attn).
# Longer suffixes first. An empty tuple: a scale for fp8 attention math (query, softmax probabilities) that some
# checkpoints carry; hayabusa computes attention in the model dtype, so it is accepted and not used (as vLLM does
# unless the attention itself is fp8).
_KV_SCALE_SUFFIXES: list[tuple[str, tuple[str, ...]]] = [
    (".k_proj.output_scale", ("k_scale",)), (".v_proj.output_scale", ("v_scale",)),  # compressed-tensors, quark
    (".k_proj.k_scale", ("k_scale",)), (".v_proj.v_scale", ("v_scale",)),            # NVIDIA ModelOpt
    (".k_scale", ("k_scale",)), (".v_scale", ("v_scale",)),                          # vLLM, AutoFP8, llm-compressor
    (".kv_scale", ("k_scale", "v_scale")),                                           # deprecated: one for both
    (".q_proj.output_scale", ()), (".prob_output_scale", ()), (".q_scale", ()), (".prob_scale", ()),
]


def _attention_at(model: nn.Module, path: str) -> Attention | None:
    """The Attention module at ``path`` or at ``path + '.attn'``, else None."""
    for p in (path, path + ".attn"):
        try:
            mod = model.get_submodule(p)
        except AttributeError:
            continue
        if isinstance(mod, Attention):
            return mod
    return None


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Load the checkpoint tensor ``name`` if it is a KV-cache scale of one of the model's Attention layers.

    Args:
        model: the model (its Attention layers own ``k_scale`` / ``v_scale``).
        name: checkpoint key, e.g. ``model.layers.3.self_attn.k_scale`` or ``...self_attn.v_proj.output_scale``.
        tensor: the checkpoint tensor, one element (shape [] or [1]), any float dtype.
    Returns:
        True when the tensor was consumed (loaded, or a recognised attention scale hayabusa does not use); False
        when ``name`` is not an attention scale of this model (the caller loads it as a parameter).
    Raises:
        HayabusaValidationError: the scale is not a single positive finite number (like vLLM, only per-tensor KV
            scales are supported).
    """
    for suffix, buffers in _KV_SCALE_SUFFIXES:
        if not name.endswith(suffix):
            continue
        attn = _attention_at(model, name[: -len(suffix)])
        if attn is None:
            return False
        if not buffers:
            return True
        if tensor.numel() != 1:
            raise HayabusaValidationError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}: only one KV-cache scale per layer "
                "(per-tensor) is supported.", parameter="model", value=name)
        value = float(tensor.float().reshape(()))
        if not (math.isfinite(value) and value > 0.0):
            raise HayabusaValidationError(f"checkpoint tensor {name} = {value}: a KV-cache scale must be a positive "
                                          "finite number.", parameter="model", value=name)
        for b in buffers:
            getattr(attn, b).fill_(value)
        return True
    return False


__all__ = ["Attention", "load_kv_scale"]
