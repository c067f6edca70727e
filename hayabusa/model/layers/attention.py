"""Attention layer: write this step's K/V into the paged cache, then attend over the cache."""

from __future__ import annotations

import torch
from torch import nn

from hayabusa.attention.metadata import ForwardContext


class Attention(nn.Module):
    """Causal multi-head / grouped-query attention over the paged KV cache.

    Args:
        num_heads: H query heads; num_kv_heads: H_kv (H % H_kv == 0); head_dim: D.
        scale: softmax scale (usually D ** -0.5).
        layer_idx: index into ForwardContext.kv_caches.
        sliding_window: attend only to the last ``sliding_window`` keys (HF semantics), None = full.
        softcap: logit soft-capping value (Gemma 2), None = off.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_idx = scale, layer_idx
        self.sliding_window, self.softcap = sliding_window, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] (views allowed) -> out [T, H * D]."""
        T = q.shape[0]
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if ctx.kv_caches is None:  # memory profiling: no cache yet
            return out.view(T, -1)
        meta = ctx.attn_metadata
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        ctx.backend.paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                    meta.block_table, self.scale, meta.max_query_len, num_seqs=meta.num_reqs,
                                    sliding_window=self.sliding_window, softcap=self.softcap)
        return out.view(T, -1)
