"""Llama (and Llama-shaped: Qwen2, Qwen3, Mistral) decoder on the shared layers.

forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]; compute_logits(hidden [R, hidden]) -> [R, V].
Checkpoint names follow HF's; q/k/v and gate/up projections are merged into one matmul each at load time.
Subclasses change the per-layer sliding window (``sliding_window``) and the attention module (``attention_cls``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.model.layers.activation import silu_and_mul
from hayabusa.model.layers.attention import Attention
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import RMSNorm, norm_first
from hayabusa.model.layers.pipeline import IntermediateTensors
from hayabusa.model.layers.rotary import RotaryEmbedding
from hayabusa.quantization.act_quant import input_quant_of


# Checkpoint q/k/v and gate/up projections load into one merged matrix each: (our parameter, theirs, shard).
MERGED_QKV_GATE_UP = [
    (".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"), (".gate_up_proj.", ".up_proj.", "up"),
]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 dtype: torch.dtype, device: torch.device, sliding_window: int | None = None,
                 scale: float | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], qkv_bias, dtype, device,
                               shard_names=["q", "k", "v"])
        self.o_proj = Linear(self.q_size, [cfg.hidden_size], o_bias, dtype, device)
        self.rotary = rotary  # shared by all layers; not a registered submodule
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5 if scale is None else scale, layer_idx,
                              sliding_window=sliding_window, softcap=softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)                                          # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # RoPE inside: on CUDA one kernel rotates q and writes rotated k, v into the cache
        out = self.attn(q, k, v, ctx, positions=positions, rotary=self.rotary)  # [T, H * D]
        return self.o_proj(out)                                         # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], bias, dtype, device, shard_names=["gate", "up"])
        self.down_proj = Linear(inter, [cfg.hidden_size], bias, dtype, device)
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            from hayabusa.errors import UnsupportedModelError

            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)", parameter="hidden_act",
                                        value=act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (or a QuantizedActivation of it, for gate_up_proj) -> [T, hidden]."""
        act = self.gate_up_proj.quant_method.apply_silu_and_mul(self.gate_up_proj, x)
        if act is not None:                  # the small-M linear's one launch for gate_up + SiLU-and-mul
            return self.down_proj(act)
        h = self.gate_up_proj(x)                                        # [T, 2 inter]
        # down_proj's per-token quantization done by the activation kernel when its method asks for one
        return self.down_proj(silu_and_mul(h, quant=input_quant_of((self.down_proj,), h.shape[0], h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, arch: type, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        qkv_bias, o_bias = arch.attention_biases(cfg)
        self.self_attn = arch.attention_cls(cfg, layer_idx, rotary, qkv_bias, o_bias, dtype, device,
                                            sliding_window=arch.sliding_window(cfg, layer_idx))
        self.mlp = LlamaMLP(cfg, getattr(cfg, "mlp_bias", False), dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions, x, residual, ctx):
        # each norm quantizes its output itself when the one linear reading it asks (quantization/act_quant.py)
        T = x.shape[0]
        quant = input_quant_of((getattr(self.self_attn, "qkv_proj", None),), T, x)
        x, residual = norm_first(self.input_layernorm, x, residual, quant=quant)
        x = self.self_attn(positions, x, ctx)
        quant = input_quant_of((self.mlp.gate_up_proj,), T, x)
        x, residual = self.post_attention_layernorm(x, residual, quant=quant)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, arch: type, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max_position, dtype, device)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rotary, arch, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        # a pipeline stage's layers (model/layers/pipeline.py sets them; the whole stack by default)
        self.start_layer, self.end_layer, self.last_stage = 0, cfg.num_hidden_layers, True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                aux_layers: tuple[int, ...] | None = None, intermediate: IntermediateTensors | None = None):
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None            # [T, hidden]
        else:                                                           # the previous pipeline stage's output
            x, residual = intermediate.hidden, intermediate.residual
        aux: dict[int, torch.Tensor] = {}
        for i in range(self.start_layer, self.end_layer):
            if aux_layers is not None and i in aux_layers:   # the residual stream entering layer i
                aux[i] = x if residual is None else x + residual
            x, residual = self.layers[i](positions, x, residual, ctx)
        if not self.last_stage:
            return IntermediateTensors(x, residual)
        x, _ = self.norm(x, residual)
        if aux_layers is not None:
            return x, [aux[i] for i in aux_layers]
        return x


class LlamaForCausalLM(nn.Module):
    """HF ``LlamaForCausalLM``: RMSNorm, RoPE, SwiGLU MLP, GQA; optional attention/MLP biases; tied embeddings."""

    # the lm_head matmul; batch-invariant mode sets linear_bi on the instance (model/loader.py)
    logits_linear = staticmethod(torch.nn.functional.linear)

    qkv_bias_default = False
    o_bias_follows_attention_bias = True
    attention_cls = LlamaAttention
    stacked_params_mapping = MERGED_QKV_GATE_UP

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, type(self), dtype, device, max(max_position, 1))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, device)

    @classmethod
    def attention_biases(cls, cfg: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        return cls.qkv_bias_default or attn_bias, attn_bias if cls.o_bias_follows_attention_bias else False

    @classmethod
    def sliding_window(cls, cfg: Any, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window W (query at p sees keys p-W+1..p), None = full attention.
        HF Llama ignores ``sliding_window`` even when a config.json carries one."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                aux_layers: tuple[int, ...] | None = None, intermediate: IntermediateTensors | None = None):
        """hidden [T, hidden] after the final norm; with ``aux_layers`` (EAGLE-3's target layer ids, each in
        [0, num_layers)) also the residual stream entering each of those layers: (hidden, [[T, hidden], ...] in
        ``aux_layers`` order). A pipeline stage (model/layers/pipeline.py) starts from ``intermediate`` after
        stage 0 and returns an IntermediateTensors before the last stage."""
        return self.model(input_ids, positions, ctx, aux_layers, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in the model dtype."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.logits_linear(hidden, w)

    def ignored_checkpoint_key(self, name: str) -> bool:
        """Keys that are present in some checkpoints but carry nothing we need."""
        if "rotary_emb.inv_freq" in name:
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"
