"""GPT-2 (HF ``GPT2LMHeadModel``; also rinna/japanese-gpt-1b and other GPT-2-architecture checkpoints).

Pre-LayerNorm blocks, learned absolute position embeddings (``wpe``, n_positions rows), multi-head attention with
fused q/k/v (``c_attn``), a 4x GELU MLP (``activation_function``: gelu_new by default), final ``ln_f`` and an
lm_head tied to ``wte``. HF stores these projections as ``Conv1D`` with the weight as [in, out]; they are
transposed once at load time into ``Linear``'s [out, in]. Checkpoint keys may lack the ``transformer.`` prefix
(the original openai-community/gpt2 files) and may carry the old causal-mask buffers ``attn.bias`` /
``attn.masked_bias``, which are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.errors import UnsupportedModelError
from hayabusa.model.layers.activation import get_act_fn
from hayabusa.model.layers.attention import Attention
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import LayerNorm, norm_first
from hayabusa.model.layers.pipeline import IntermediateTensors


class Conv1DLinear(Linear):
    """A Linear loaded from an HF ``Conv1D`` checkpoint tensor (weight [in, out], transposed on load)."""

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        super()._load(param, loaded.t() if param is self.weight else loaded, shard)


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.c_attn = Conv1DLinear(h, [3 * h], True, dtype, device)   # q | k | v, each [h]
        self.c_proj = Conv1DLinear(h, [h], True, dtype, device)
        scale = self.head_dim ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale, layer_idx)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.c_attn(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        return self.c_proj(self.attn(q, k, v, ctx))                                   # [T, h]


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h = cfg.hidden_size
        inner = getattr(cfg, "n_inner", None) or 4 * h
        self.c_fc = Conv1DLinear(h, [inner], True, dtype, device)
        self.c_proj = Conv1DLinear(inner, [h], True, dtype, device)
        self.act = get_act_fn(getattr(cfg, "activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.hidden_size, eps, dtype, device)
        self.attn = GPT2Attention(cfg, layer_idx, dtype, device)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp = GPT2MLP(cfg, dtype, device)

    def forward(self, x, residual, ctx):
        x, residual = norm_first(self.ln_1, x, residual)
        x, residual = self.ln_2(self.attn(x, ctx), residual)
        return self.mlp(x), residual


class GPT2Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype, device=device)
        self.wte.weight.requires_grad_(False)
        self.wpe.weight.requires_grad_(False)
        self.h = nn.ModuleList(GPT2Block(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype, device)
        # a pipeline stage's layers (model/layers/pipeline.py sets them; the whole stack by default)
        self.start_layer, self.end_layer, self.last_stage = 0, cfg.num_hidden_layers, True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None):
        if intermediate is None:
            x, residual = self.wte(input_ids) + self.wpe(positions), None   # [T, hidden]
        else:                                                           # the previous pipeline stage's output
            x, residual = intermediate.hidden, intermediate.residual
        for i in range(self.start_layer, self.end_layer):
            x, residual = self.h[i](x, residual, ctx)
        if not self.last_stage:
            return IntermediateTensors(x, residual)
        x, _ = self.ln_f(x, residual)
        return x


class GPT2LMHeadModel(nn.Module):
    """HF ``GPT2LMHeadModel`` (see the module docstring)."""

    # the lm_head matmul; batch-invariant mode sets linear_bi on the instance (model/loader.py)
    logits_linear = staticmethod(torch.nn.functional.linear)

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        if getattr(cfg, "add_cross_attention", False):
            raise UnsupportedModelError("GPT-2 with add_cross_attention=true (an encoder-decoder) is not "
                                        "supported.", parameter="add_cross_attention", value=True)
        self.config = cfg
        self.transformer = GPT2Model(cfg, dtype, device)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype,
                                                                    device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None):
        """hidden [T, hidden] after ln_f (a pipeline stage: see model/layers/pipeline.py)."""
        return self.transformer(input_ids, positions, ctx, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in the model dtype."""
        w = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        return self.logits_linear(hidden, w)

    @staticmethod
    def rename_checkpoint_key(name: str) -> str:
        """openai-community/gpt2 saves the base model's keys without the ``transformer.`` prefix."""
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    def ignored_checkpoint_key(self, name: str) -> bool:
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of old transformers
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"
