"""Gemma 2 decoder on the shared layers (HF ``Gemma2ForCausalLM``).

Differences from Llama, each as HF computes it:
- embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype first;
- RMSNorm with ``(1 + weight)`` (GemmaRMSNorm), and four norms per layer: input, post-attention (on the attention
  output, before the residual add), pre-feedforward and post-feedforward;
- GeGLU MLP (``hidden_activation``, gelu_pytorch_tanh);
- attention scale ``query_pre_attn_scalar ** -0.5`` (not head_dim), scores soft-capped
  ``c * tanh(s / c)`` with ``attn_logit_softcapping`` before the mask;
- alternating layers: ``layer_types`` (or, in configs without it, even layers) use ``sliding_window``;
- final logits soft-capped with ``final_logit_softcapping``; lm_head tied to the embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.errors import UnsupportedModelError
from hayabusa.model.layers.activation import gelu_tanh_and_mul
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import GemmaRMSNorm, norm_first
from hayabusa.model.layers.pipeline import IntermediateTensors
from hayabusa.model.layers.rotary import RotaryEmbedding
from hayabusa.model.llama import MERGED_QKV_GATE_UP, LlamaAttention


def gemma2_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if layer_idx % 2 == 0 else None  # transformers < 4.53: even layers slide


class Gemma2Attention(LlamaAttention):
    """Llama attention with Gemma 2's scale (query_pre_attn_scalar ** -0.5), soft-capping and per-layer window."""

    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, layer_idx, rotary, bias, bias, dtype, device,
                         sliding_window=gemma2_sliding_window(cfg, layer_idx),
                         scale=cfg.query_pre_attn_scalar ** -0.5,
                         softcap=getattr(cfg, "attn_logit_softcapping", None))


class Gemma2MLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], False, dtype, device, shard_names=["gate", "up"])
        self.down_proj = Linear(inter, [cfg.hidden_size], False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma2Attention(cfg, layer_idx, rotary, dtype, device)
        self.mlp = Gemma2MLP(cfg, dtype, device)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)

    def forward(self, positions, x, residual, ctx):
        # residual stream: h_{l+1} = h + post_ff(mlp(pre_ff(h + post_attn(attn(in_ln(h))))))
        x, residual = norm_first(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, ctx))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(nn.Module):
    """HF ``Gemma2ForCausalLM`` (see the module docstring for the numerics)."""

    # the lm_head matmul; batch-invariant mode sets linear_bi on the instance (model/loader.py)
    logits_linear = staticmethod(torch.nn.functional.linear)

    stacked_params_mapping = MERGED_QKV_GATE_UP

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_python_tanh"):
            raise UnsupportedModelError(f"Gemma 2 hidden_activation {act!r} is not supported (only "
                                        "gelu_pytorch_tanh).", parameter="hidden_activation", value=act)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.model.embed_tokens.weight.requires_grad_(False)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max(max_position, 1), dtype, device)
        self.model.rotary_emb = rotary
        self.model.layers = nn.ModuleList(Gemma2DecoderLayer(cfg, i, rotary, dtype, device)
                                          for i in range(cfg.num_hidden_layers))
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        # a pipeline stage's layers (model/layers/pipeline.py sets them; the whole stack by default)
        self.model.start_layer, self.model.end_layer, self.model.last_stage = 0, cfg.num_hidden_layers, True
        # HF multiplies by sqrt(hidden) held as a tensor of the model dtype (bf16: sqrt(3584) = 59.87 -> 60.0)
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype))
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype,
                                                                    device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None):
        """hidden [T, hidden] after the final norm (a pipeline stage: see model/layers/pipeline.py)."""
        m = self.model
        if intermediate is None:
            x, residual = m.embed_tokens(input_ids) * self.embed_scale, None   # [T, hidden]
        else:                                                           # the previous pipeline stage's output
            x, residual = intermediate.hidden, intermediate.residual
        for i in range(m.start_layer, m.end_layer):
            x, residual = m.layers[i](positions, x, residual, ctx)
        if not m.last_stage:
            return IntermediateTensors(x, residual)
        x, _ = m.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in the model dtype, soft-capped as HF does."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.logits_linear(hidden, w)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def ignored_checkpoint_key(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"
