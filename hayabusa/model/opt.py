"""OPT (HF ``OPTForCausalLM``: facebook/opt-125m ... opt-66b, vLLM's quickstart model).

Learned absolute position embeddings with HF's offset of 2 (``embed_positions`` has max_position_embeddings + 2
rows; position p reads row p + 2), multi-head attention (q/k/v merged into one matmul at load time), a ReLU MLP
(``activation_function``), biases everywhere unless ``enable_bias`` is false, LayerNorm (eps 1e-5, without weight
and bias when ``layer_norm_elementwise_affine`` is false) and an lm_head tied to ``embed_tokens``.
``do_layer_norm_before`` (true for every OPT but opt-350m) picks pre-LayerNorm blocks with a final LayerNorm (unless
``_remove_final_layer_norm``), or post-LayerNorm blocks without one. ``word_embed_proj_dim`` < hidden_size
(opt-350m): token embeddings of that width go through ``project_in`` before the first layer, and the last hidden
states through ``project_out`` before the lm_head.

HF scales q by head_dim ** -0.5 after q_proj and attends with scale 1; here the attention kernel applies the same
scale to q.k (equal up to float rounding). Checkpoint keys: HF's ``model.decoder.*``, or ``decoder.*`` as in the
original facebook/opt-* files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.model.layers.activation import get_act_fn
from hayabusa.model.layers.attention import Attention
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import LayerNorm, norm_first

POSITION_OFFSET = 2   # HF OPTLearnedPositionalEmbedding.offset
LAYER_NORM_EPS = 1e-5  # torch nn.LayerNorm's default, which HF OPT uses


class OPTAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, bool(getattr(cfg, "enable_bias", True))
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.qkv_proj = Linear(h, [h, h, h], bias, dtype, device, shard_names=["q", "k", "v"])
        self.out_proj = Linear(h, [h], bias, dtype, device)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5, layer_idx)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)   # each [T, H, D]
        return self.out_proj(self.attn(q, k, v, ctx))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, bool(getattr(cfg, "enable_bias", True))
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(getattr(cfg, "do_layer_norm_before", True))
        self.self_attn = OPTAttention(cfg, layer_idx, dtype, device)
        self.self_attn_layer_norm = LayerNorm(h, LAYER_NORM_EPS, dtype, device, elementwise_affine=affine)
        self.fc1 = Linear(h, [cfg.ffn_dim], bias, dtype, device)
        self.fc2 = Linear(cfg.ffn_dim, [h], bias, dtype, device)
        self.final_layer_norm = LayerNorm(h, LAYER_NORM_EPS, dtype, device, elementwise_affine=affine)
        self.act = get_act_fn(getattr(cfg, "activation_function", "relu"))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        """Pre-LN: (x, residual) -> (mlp output, residual stream), as GPT-2's block. Post-LN (opt-350m): x is the
        whole hidden state and residual stays None: x -> LN(x + attn(x)) -> LN(x + mlp(x))."""
        if self.pre_norm:
            x, residual = norm_first(self.self_attn_layer_norm, x, residual)
            x, residual = self.final_layer_norm(self.self_attn(x, ctx), residual)
            return self.fc2(self.act(self.fc1(x))), residual
        x = self.self_attn_layer_norm(x + self.self_attn(x, ctx))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x)))), None


class OPTDecoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h = cfg.hidden_size
        proj = getattr(cfg, "word_embed_proj_dim", None) or h
        self.embed_tokens = nn.Embedding(cfg.vocab_size, proj, dtype=dtype, device=device)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, h, dtype=dtype,
                                            device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_positions.weight.requires_grad_(False)
        self.project_in = Linear(proj, [h], False, dtype, device) if proj != h else None
        self.project_out = Linear(h, [proj], False, dtype, device) if proj != h else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        final = bool(getattr(cfg, "do_layer_norm_before", True)) and not getattr(cfg, "_remove_final_layer_norm",
                                                                                 False)
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = LayerNorm(h, LAYER_NORM_EPS, dtype, device, elementwise_affine=affine) if final \
            else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                    # [T, word_embed_proj_dim]
        if self.project_in is not None:
            x = self.project_in(x)                                          # [T, hidden]
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        if residual is not None:
            x = x + residual
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)                                         # [T, word_embed_proj_dim]
        return x


class OPTModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, dtype, device)


class OPTForCausalLM(nn.Module):
    """HF ``OPTForCausalLM`` (see the module docstring). No tensor or pipeline parallelism (not in
    ``distributed/config.py``'s TP_ARCHITECTURES, so both are refused by name)."""

    # the lm_head matmul; batch-invariant mode sets linear_bi on the instance (model/loader.py)
    logits_linear = staticmethod(torch.nn.functional.linear)
    stacked_params_mapping = [(".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"),
                              (".qkv_proj.", ".v_proj.", "v")]

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = OPTModel(cfg, dtype, device)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        proj = getattr(cfg, "word_embed_proj_dim", None) or cfg.hidden_size
        self.lm_head = None if self.tie_word_embeddings else Linear(proj, [cfg.vocab_size], False, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 (0-based; row + 2 of ``embed_positions``) -> hidden
        [T, word_embed_proj_dim] in the model dtype (after the final LayerNorm and ``project_out``)."""
        return self.model.decoder(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, word_embed_proj_dim] -> logits [R, V] in the model dtype."""
        w = self.model.decoder.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.logits_linear(hidden, w)

    @staticmethod
    def rename_checkpoint_key(name: str) -> str:
        """facebook/opt-* files save the decoder's keys without the ``model.`` prefix."""
        return "model." + name if name.startswith("decoder.") else name

    def ignored_checkpoint_key(self, name: str) -> bool:
        return self.tie_word_embeddings and name == "lm_head.weight"
