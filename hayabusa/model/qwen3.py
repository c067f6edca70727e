"""Qwen3 (dense): Llama with RMSNorm on each head's query and key before RoPE ("QK-norm"), no q/k/v bias."""

from __future__ import annotations

from typing import Any

import torch

from hayabusa.attention.metadata import ForwardContext
from hayabusa.model.layers.norm import RMSNorm
from hayabusa.model.llama import LlamaAttention, LlamaForCausalLM
from hayabusa.model.qwen2 import qwen_sliding_window


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: Any, layer_idx: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, layer_idx, *args, **kwargs)
        dtype, device = self.qkv_proj.weight.dtype, self.qkv_proj.weight.device
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)  # over D, shared by all heads
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)                                          # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T * self.num_heads, self.head_dim)).view(T, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(T * self.num_kv_heads, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # RoPE inside: on CUDA one kernel rotates q and writes rotated k, v into the cache
        out = self.attn(q, k, v, ctx, positions=positions, rotary=self.rotary)  # [T, H * D]
        return self.o_proj(out)                                         # [T, hidden]


class Qwen3ForCausalLM(LlamaForCausalLM):
    """HF ``Qwen3ForCausalLM``: QK-norm; ``attention_bias`` applies to q/k/v and o_proj alike (default off);
    sliding window by Qwen2's per-layer rule."""

    attention_cls = Qwen3Attention

    @classmethod
    def sliding_window(cls, cfg: Any, layer_idx: int) -> int | None:
        return qwen_sliding_window(cfg, layer_idx)
