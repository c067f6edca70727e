"""T5 (HF ``T5ForConditionalGeneration``; also T5 v1.1, Flan-T5 and ``MT5ForConditionalGeneration``).

An encoder-decoder. The encoder runs once per request over its encoder input; each decoder layer attends to its
own previous tokens (paged KV cache, causal) and to the encoder output (cross-attention; its K/V are computed once
from the encoder output and written into the request's cross-attention blocks of the same paged cache).

Facts from transformers' ``modeling_t5.py`` (code our own):
- T5 LayerNorm: RMS over the last dim in fp32, no mean, no bias; weight * x (x cast to the weight's half dtype).
- Attention has no 1/sqrt(D) scaling. Self-attention adds a relative position bias: bucketed ``key - query``
  (bidirectional in the encoder, causal in the decoder), one [num_buckets, H] embedding in the first layer of each
  stack, shared by every layer of that stack. Cross-attention has no position bias.
- FFN: ``relu`` (original T5: wo(relu(wi x))) or ``gated-gelu`` (v1.1 / Flan / mT5: wo(gelu_new(wi_0 x) * wi_1 x)).
- Head: original T5 ties lm_head to ``shared`` and scales the decoder output by d_model ** -0.5 first; v1.1 keeps
  an untied lm_head and no scaling. The scaling follows config.json's ``tie_word_embeddings`` (transformers 5.2x
  keeps it as ``scale_decoder_outputs``); the head is ``lm_head.weight`` when the checkpoint has one, else
  ``shared``.
- fp16, as transformers runs it: the FFN's ``wo`` runs in fp32 (``_keep_in_fp32_modules``) and its fp32 output
  added to the fp16 residual makes the residual stream fp32 (type promotion) from the first FFN on; a sum that is
  still fp16 (the first block's attention sub-layers) is clamped to the fp16 range (max - 1000 when an inf
  appeared); every norm computes in fp32 and casts to fp16 before its weight (T5LayerNorm), so the layers' inputs
  stay fp16. Flan-T5's FFN outputs overflow fp16: a residual kept in fp16 (clamped) loses them, this one does not.
  bf16 and fp32 keep the residual in the model dtype (bf16 is the dtype T5 v1.1 was trained in).

Model interface used by ``worker/encoder_decoder.py`` (the model knows no requests):
    encode(input_ids [T_e], seq_lens list[int]) -> encoder output [T_e, d_model] (the sequences packed)
    encode_padded(input_ids [B * L], seq_lens [B] device, L) -> [B * L, d_model] (the encoder's CUDA-graph shapes)
    store_cross_kv(enc_out [T_e, d], slot_mapping [T_e], ctx): cross K/V of every decoder layer into the cache
    forward(input_ids [T], positions [T], ctx) -> decoder hidden [T, d]; ctx.cross_attn_metadata says, per query
        token, which cross blocks and how many encoder keys it reads
    compute_logits(hidden [R, d]) -> [R, V]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.envs import env_flag
from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels.t5_fp16_norm import reserve_t5_fp16_norm_sync, t5_fp16_add_norm, t5_fp16_add_norm_ref
from hayabusa.model.layers.activation import get_act_fn
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import RMSNorm
from hayabusa.model.vision_attention import host_to_device

# fp16 on CUDA: _add_norm's fp16 branch as one Triton launch (kernels/t5_fp16_norm.py). On by default since its CUDA
# test (tests/models/test_t5_fp16_norm_cuda.py) passed on an H200 (2026-12-03) and W9 fp16 on t5-base measured 1.23x
# with it (BENCHMARKS.md, fifteenth session); HAYABUSA_T5_FP16_FUSED_NORM=0 keeps transformers' torch ops
USE_FP16_FUSED_NORM = env_flag("HAYABUSA_T5_FP16_FUSED_NORM", True)


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of ``key_position - query_position`` (int64 tensor, any shape) -> int64 buckets in
    [0, num_buckets). Small distances get their own bucket, larger ones log-spaced buckets up to max_distance."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


# T5's LayerNorm is RMSNorm with HF Llama's numerics (variance in fp32, weight * normed.to(dtype)): the shared layer,
# whose CUDA path fuses the residual add into one Triton kernel.
T5LayerNorm = RMSNorm


def _add_norm(norm: RMSNorm, delta: torch.Tensor, residual: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + delta), residual + delta): the residual stream after a sub-layer and the next sub-layer's
    normed input. fp16 weights (transformers' numerics, see the module docstring): an fp16 sum is clamped first
    (so the add is not fused); an fp32 delta (the FFN's fp32 ``wo``) or residual makes the sum fp32, unclamped;
    the normed output is fp16 either way. On CUDA (``USE_FP16_FUSED_NORM``) the fp16 branch is one Triton launch
    (``t5_fp16_add_norm``: the same residual bits, normed within one fp16 ulp)."""
    if norm.weight.dtype == torch.float16:
        if USE_FP16_FUSED_NORM and delta.is_cuda:
            return t5_fp16_add_norm(delta, residual, norm.weight, norm.eps)
        return t5_fp16_add_norm_ref(delta, residual, norm.weight, norm.eps)     # transformers' ops
    if residual is None:
        return norm(delta), delta
    return norm(delta, residual)


class T5FF(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d, ff = cfg.d_model, cfg.d_ff
        self.gated = bool(getattr(cfg, "is_gated_act", str(cfg.feed_forward_proj).startswith("gated")))
        act = getattr(cfg, "dense_act_fn", None) or str(cfg.feed_forward_proj).split("-")[-1]
        if self.gated and act == "gelu":
            act = "gelu_new"   # transformers' backwards-compatible reading of "gated-gelu"
        self.act = get_act_fn(act)
        if self.gated:  # wi_0 | wi_1 as one matmul
            self.wi = Linear(d, [ff, ff], False, dtype, device, shard_names=["0", "1"])
        else:
            self.wi = Linear(d, [ff], False, dtype, device)
        # fp16: wo in fp32, as transformers keeps it (_keep_in_fp32_modules): Flan-T5's FFN outputs overflow fp16
        self.wo_fp32 = dtype == torch.float16
        self.wo = Linear(ff, [d], False, torch.float32 if self.wo_fp32 else dtype, device)
        self.d_ff = ff

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)                                     # [T, ff] or [T, 2 ff]
        if self.gated:
            h = self.act(h[:, :self.d_ff]) * h[:, self.d_ff:]
        else:
            h = self.act(h)
        if self.wo_fp32:   # fp32 out, as transformers: the residual add makes the stream fp32 (_add_norm)
            return self.wo(h.float())
        return self.wo(h)


class T5EncoderSelfAttention(nn.Module):
    """Bidirectional self-attention over packed sequences (no cache): SDPA with the position bias as its mask."""

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.H, self.D = cfg.num_heads, cfg.d_kv
        inner = self.H * self.D
        self.qkv = Linear(cfg.d_model, [inner] * 3, False, dtype, device, shard_names=["q", "k", "v"])
        self.o = Linear(inner, [cfg.d_model], False, dtype, device)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, pad: "_Padding") -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.H, self.D).unbind(1)     # each [T, H, D]
        q, k, v = (pad.to_batch(t).transpose(1, 2) for t in (q, k, v))  # each [B, H, L, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)   # [B, H, L, D]
        return self.o(pad.from_batch(o.transpose(1, 2)).reshape(T, -1))


class _Padding:
    """Packed [T, ...] <-> padded [B, L, ...] for the encoder's attention (no copy when all lengths are equal).

    ``valid`` [B, L] bool (None: every position valid) masks the padding keys. ``padded``: inputs already laid out
    as [B, L] (the encoder's CUDA-graph shapes), only ``valid`` computed, on the device, from the lengths."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        self.B, self.L = len(seq_lens), max(seq_lens)
        self.equal = all(n == self.L for n in seq_lens)
        self.idx = None
        self.valid = None
        if not self.equal:   # built on the host and copied without blocking (no nonzero() sync on the device)
            valid = np.arange(self.L)[None, :] < np.asarray(seq_lens)[:, None]           # [B, L] bool
            self.valid = host_to_device(valid, device)
            self.idx = host_to_device(np.flatnonzero(valid), device)                      # [T] padded row of token

    @classmethod
    def padded(cls, seq_lens: torch.Tensor, L: int) -> "_Padding":
        """Inputs [B * L, ...] with sequence i's tokens at rows i * L .. i * L + seq_lens[i] - 1 (seq_lens [B] int
        on the device): views in and out, the keys past each length masked (no host sync, no host copy)."""
        pad = cls.__new__(cls)
        pad.B, pad.L, pad.equal, pad.idx = seq_lens.shape[0], L, True, None
        pad.valid = torch.arange(L, device=seq_lens.device)[None, :] < seq_lens[:, None]      # [B, L] bool
        return pad

    def to_batch(self, t: torch.Tensor) -> torch.Tensor:
        if self.equal:
            return t.view(self.B, self.L, *t.shape[1:])
        out = t.new_zeros(self.B * self.L, *t.shape[1:])
        out[self.idx] = t
        return out.view(self.B, self.L, *t.shape[1:])

    def from_batch(self, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(self.B * self.L, *t.shape[2:])
        return t if self.equal else t[self.idx]


class T5DecoderSelfAttention(nn.Module):
    """Causal self-attention over the paged cache with the relative position bias (the backend adds
    ``bias_table[h, query_pos - key_pos]`` to each score)."""

    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.H, self.D, self.layer_idx = cfg.num_heads, cfg.d_kv, layer_idx
        inner = self.H * self.D
        self.qkv = Linear(cfg.d_model, [inner] * 3, False, dtype, device, shard_names=["q", "k", "v"])
        self.o = Linear(inner, [cfg.d_model], False, dtype, device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, bias_table: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.H, self.D).unbind(1)     # each [T, H, D]
        out = torch.empty(T, self.H, self.D, dtype=x.dtype, device=x.device)
        if ctx.kv_caches is not None:
            meta = ctx.attn_metadata
            k_cache, v_cache = ctx.kv_caches[self.layer_idx]
            ctx.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            ctx.backend.paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                        meta.block_table, 1.0, meta.max_query_len, num_seqs=meta.num_reqs,
                                        position_bias=bias_table)
        return self.o(out.view(T, -1))


class T5CrossAttention(nn.Module):
    """Attention of decoder tokens to their request's encoder output, whose K/V sit in the request's cross blocks.

    ``ctx.cross_attn_metadata`` has one "sequence" per query token (query_start_loc = 0..T, seq_lens = the encoder
    length of the token's request, block table = its cross blocks), so the causal kernel lets every query see every
    encoder key: the last query position of a one-token sequence of length S is S - 1."""

    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.H, self.D, self.layer_idx = cfg.num_heads, cfg.d_kv, layer_idx
        inner = self.H * self.D
        self.q = Linear(cfg.d_model, [inner], False, dtype, device)
        self.kv = Linear(cfg.d_model, [inner, inner], False, dtype, device, shard_names=["k", "v"])
        self.o = Linear(inner, [cfg.d_model], False, dtype, device)

    def store_kv(self, enc_out: torch.Tensor, slot_mapping: torch.Tensor, ctx: ForwardContext) -> None:
        T = enc_out.shape[0]
        k, v = self.kv(enc_out).view(T, 2, self.H, self.D).unbind(1)   # each [T_e, H, D]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q = self.q(x).view(T, self.H, self.D)
        out = torch.empty(T, self.H, self.D, dtype=x.dtype, device=x.device)
        meta = ctx.cross_attn_metadata
        if ctx.kv_caches is not None and meta is not None:
            k_cache, v_cache = ctx.kv_caches[self.layer_idx]
            ctx.backend.paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens,
                                        meta.block_table, 1.0, 1, num_seqs=meta.num_reqs)
        return self.o(out.view(T, -1))


class T5EncoderBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_attn = T5LayerNorm(cfg.d_model, eps, dtype, device)
        self.attn = T5EncoderSelfAttention(cfg, dtype, device)
        self.ln_ff = T5LayerNorm(cfg.d_model, eps, dtype, device)
        self.ff = T5FF(cfg, dtype, device)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor, pad: _Padding
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous sub-layer's output, the residual stream before it) -> the same after this block."""
        h, residual = _add_norm(self.ln_attn, delta, residual)
        h, residual = _add_norm(self.ln_ff, self.attn(h, bias, pad), residual)
        return self.ff(h), residual


class T5DecoderBlock(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_self = T5LayerNorm(cfg.d_model, eps, dtype, device)
        self.self_attn = T5DecoderSelfAttention(cfg, layer_idx, dtype, device)
        self.ln_cross = T5LayerNorm(cfg.d_model, eps, dtype, device)
        self.cross_attn = T5CrossAttention(cfg, layer_idx, dtype, device)
        self.ln_ff = T5LayerNorm(cfg.d_model, eps, dtype, device)
        self.ff = T5FF(cfg, dtype, device)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
                bias_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = _add_norm(self.ln_self, delta, residual)
        h, residual = _add_norm(self.ln_cross, self.self_attn(h, ctx, bias_table), residual)
        h, residual = _add_norm(self.ln_ff, self.cross_attn(h, ctx), residual)
        return self.ff(h), residual


class T5ForConditionalGeneration(nn.Module):
    """HF ``T5ForConditionalGeneration`` (see the module docstring)."""

    is_encoder_decoder = True
    # the lm_head matmul; HAYABUSA_SMALL_M_LINEAR sets linear_small_m on the instance (model/loader.py)
    logits_linear = staticmethod(F.linear)
    # (ours, checkpoint's, shard): q/k/v and wi_0/wi_1 load into merged Linears
    stacked_params_mapping = [
        (".qkv.", ".SelfAttention.q.", "q"), (".qkv.", ".SelfAttention.k.", "k"), (".qkv.", ".SelfAttention.v.", "v"),
        (".wi.", ".DenseReluDense.wi_0.", "0"), (".wi.", ".DenseReluDense.wi_1.", "1"),
        (".kv.", ".EncDecAttention.k.", "k"), (".kv.", ".EncDecAttention.v.", "v"),
    ]

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.d_model
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        self.shared = nn.Embedding(cfg.vocab_size, d, dtype=dtype, device=device)
        self.shared.weight.requires_grad_(False)
        self.enc_rel_bias = nn.Embedding(self.num_buckets, cfg.num_heads, dtype=dtype, device=device)
        self.dec_rel_bias = nn.Embedding(self.num_buckets, cfg.num_heads, dtype=dtype, device=device)
        for e in (self.enc_rel_bias, self.dec_rel_bias):
            e.weight.requires_grad_(False)
        self.enc_blocks = nn.ModuleList(T5EncoderBlock(cfg, dtype, device) for _ in range(cfg.num_layers))
        n_dec = getattr(cfg, "num_decoder_layers", None) or cfg.num_layers
        self.dec_blocks = nn.ModuleList(T5DecoderBlock(cfg, i, dtype, device) for i in range(n_dec))
        self.enc_final_norm = T5LayerNorm(d, cfg.layer_norm_epsilon, dtype, device)
        self.dec_final_norm = T5LayerNorm(d, cfg.layer_norm_epsilon, dtype, device)
        self.scale_decoder_outputs = bool(getattr(cfg, "scale_decoder_outputs",
                                                  getattr(cfg, "tie_word_embeddings", True)))
        # The head: lm_head.weight when the checkpoint has one (v1.1), else shared (original T5).
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, d, dtype=dtype, device=device), requires_grad=False)
        self.lm_head.optional = True          # type: ignore[attr-defined]
        self.lm_head.weight_loader = self._load_lm_head  # type: ignore[attr-defined]
        self.has_lm_head = False
        self.max_position = max(max_position, 1)        # the decoder's positions (max_model_len)
        from hayabusa.config import derive_encoder_decoder_max_len

        # the longest encoder input (the input processor's limit, ModelConfig.max_encoder_len)
        self.max_encoder_len = max(derive_encoder_decoder_max_len(cfg), self.max_position)
        self._bias_table: torch.Tensor | None = None
        self._enc_bias: torch.Tensor | None = None
        if dtype == torch.float16 and torch.device(device).type == "cuda":
            reserve_t5_fp16_norm_sync(device)   # the fused fp16 norm's flag + counter, before any graph capture

    def _load_lm_head(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        param.data.copy_(loaded)
        self.has_lm_head = True

    # ------------------------------------------------------------------ checkpoint names
    _RENAMES = [("encoder.final_layer_norm.", "enc_final_norm."), ("decoder.final_layer_norm.", "dec_final_norm."),
                ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.", "enc_rel_bias."),
                ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.", "dec_rel_bias."),
                ("lm_head.weight", "lm_head")]
    _SUBLAYERS = {("encoder", "0"): "ln_attn", ("encoder", "1"): "ln_ff", ("decoder", "0"): "ln_self",
                  ("decoder", "1"): "ln_cross", ("decoder", "2"): "ln_ff"}

    @classmethod
    def rename_checkpoint_key(cls, name: str) -> str:
        """HF names -> ours: ``encoder.block.{i}.layer.{j}.X`` -> ``enc_blocks.{i}.…`` (layer norms by sub-layer,
        projections kept for the stacked mapping and renamed after it)."""
        for theirs, ours in cls._RENAMES:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        parts = name.split(".")
        if len(parts) < 6 or parts[0] not in ("encoder", "decoder") or parts[1] != "block":
            return name
        stack, i, j, rest = parts[0], parts[2], parts[4], parts[5:]
        head = ("enc_blocks." if stack == "encoder" else "dec_blocks.") + i
        if rest[0] == "layer_norm":
            return f"{head}.{cls._SUBLAYERS[(stack, j)]}.{'.'.join(rest[1:])}"
        sub = {"SelfAttention": "attn" if stack == "encoder" else "self_attn", "EncDecAttention": "cross_attn",
               "DenseReluDense": "ff"}.get(rest[0])
        if sub is None:
            return name
        if rest[1] in ("o", "wo") or (rest[0] == "EncDecAttention" and rest[1] == "q") or rest[1] == "wi":
            return f"{head}.{sub}.{'.'.join(rest[1:])}"
        # q/k/v, wi_0/wi_1: the checkpoint's spelling stays for stacked_params_mapping (-> qkv, kv, wi shards)
        return f"{head}.{sub}.{'.'.join(rest)}"

    def ignored_checkpoint_key(self, name: str) -> bool:
        # embed_tokens of both stacks are ``shared``; transformers ignores a cross-attention bias in the decoder
        return name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight") or \
            "EncDecAttention.relative_attention_bias" in name

    # ------------------------------------------------------------------ encoder
    def _encoder_bias(self, L: int, pad: _Padding, dtype: torch.dtype) -> torch.Tensor:
        """[1 or B, H, L, L] additive mask: the bidirectional position bias, -inf on padding keys."""
        bias = self._encoder_bias_table(L, dtype)[:, :, :L, :L]                     # [1, H, L, L]
        if pad.valid is None:
            return bias
        key_mask = torch.zeros(pad.B, 1, 1, L, dtype=dtype, device=bias.device)
        key_mask.masked_fill_(~pad.valid[:, None, None, :], torch.finfo(dtype).min)
        return bias + key_mask                                                        # [B, H, L, L]

    def _encoder_bias_table(self, L: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, H, L', L'] the encoder's bidirectional position bias for every length up to L' >= L, computed once
        (the bias depends on key - query only, so a shorter sequence's is the top-left corner): an encoder run
        then launches none of the ~20 small ops of the bucket arithmetic (issue #17). L' = max(L, max_encoder_len)
        (the encoder limit; the memory profile runs the encoder at that length, so the table is in the peak)
        rounded up to 16, so each row of a slice starts 32-byte aligned
        (what SDPA's fused kernels want of a mask)."""
        cached = self._enc_bias
        if cached is None or cached.shape[-1] < L or cached.dtype != dtype:
            n = -(-max(L, self.max_encoder_len) // 16) * 16
            pos = torch.arange(n, device=self.shared.weight.device)
            buckets = relative_position_bucket(pos[None, :] - pos[:, None], True, self.num_buckets,
                                               self.max_distance)
            cached = self.enc_rel_bias(buckets).permute(2, 0, 1).unsqueeze(0).to(dtype)   # [1, H, n, n]
            self._enc_bias = cached
        return cached

    def encode(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """input_ids [T_e] (sequences packed, lengths ``seq_lens``) -> encoder output [T_e, d_model]."""
        pad = _Padding(seq_lens, input_ids.device)
        x, residual = self.shared(input_ids), None                                    # [T_e, d]
        bias = self._encoder_bias(pad.L, pad, x.dtype)
        for block in self.enc_blocks:
            x, residual = block(x, residual, bias, pad)
        return _add_norm(self.enc_final_norm, x, residual)[0]

    def encode_padded(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, L: int) -> torch.Tensor:
        """The encoder over B sequences laid out padded to L tokens each (the CUDA-graph shapes of
        ``worker/encoder_decoder.py``): input_ids [B * L] int64 (sequence i at rows i * L ..), seq_lens [B] int on
        the device (1 <= seq_lens[i] <= L; keys past it are masked, so the padding changes no real token's
        output) -> encoder output [B * L, d_model] (rows past a sequence's length are padding, finite). Runs no
        host sync and reads nothing from the host: capturable in a CUDA graph.

        Raises:
            ValueError: input_ids is not [B * L] for seq_lens' B (parameter ``input_ids``)."""
        if input_ids.dim() != 1 or input_ids.shape[0] != seq_lens.shape[0] * L:
            raise HayabusaValidationError(f"input_ids must be [B * L] = [{seq_lens.shape[0]} * {L}], got "
                                          f"{tuple(input_ids.shape)}", parameter="input_ids",
                                          value=tuple(input_ids.shape))
        pad = _Padding.padded(seq_lens, L)
        x, residual = self.shared(input_ids), None                                    # [B * L, d]
        bias = self._encoder_bias(L, pad, x.dtype)                                    # [B, H, L, L]
        for block in self.enc_blocks:
            x, residual = block(x, residual, bias, pad)
        return _add_norm(self.enc_final_norm, x, residual)[0]

    def store_cross_kv(self, enc_out: torch.Tensor, slot_mapping: torch.Tensor, ctx: ForwardContext) -> None:
        """Every decoder layer's cross-attention K/V of enc_out [T_e, d] into the cache at slot_mapping [T_e]."""
        for block in self.dec_blocks:
            block.cross_attn.store_kv(enc_out, slot_mapping, ctx)

    # ------------------------------------------------------------------ decoder
    def decoder_bias_table(self) -> torch.Tensor:
        """[H, max_position] fp32: entry [h, d] is the bias of a query to the key d positions before it."""
        if self._bias_table is None:
            dist = torch.arange(self.max_position, device=self.shared.weight.device)
            buckets = relative_position_bucket(-dist, False, self.num_buckets, self.max_distance)
            self._bias_table = self.dec_rel_bias(buckets).float().t().contiguous()
        return self._bias_table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Decoder tokens [T] -> decoder hidden states [T, d] (final norm applied; the head's scaling in
        compute_logits). While memory is profiled (no cache) the encoder also runs first, over
        max(T, max_encoder_len) tokens in sequences of max_encoder_len (a step's encoder inputs are at most
        max_num_batched_tokens tokens, or one input of up to max_encoder_len), so its activations count."""
        if ctx.kv_caches is None:
            self.profile_encoder(input_ids.shape[0])
        x, residual = self.shared(input_ids), None                                     # [T, d]
        table = self.decoder_bias_table()
        for block in self.dec_blocks:
            x, residual = block(x, residual, ctx, table)
        return _add_norm(self.dec_final_norm, x, residual)[0]

    def profile_encoder(self, num_tokens: int) -> list[int]:
        """The largest encoder step for the memory profile: max(num_tokens, max_encoder_len) tokens (id 0) in
        sequences of max_encoder_len tokens (the last one shorter). Returns the sequence lengths run."""
        T, L = max(num_tokens, self.max_encoder_len), self.max_encoder_len
        lens = [L] * (T // L) + ([T % L] if T % L else [])
        self.encode(torch.zeros(T, dtype=torch.int64, device=self.shared.weight.device), lens)
        return lens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, d] -> logits [R, V] in the model dtype."""
        if self.scale_decoder_outputs:
            hidden = hidden * (self.config.d_model ** -0.5)
        return self.logits_linear(hidden, self.lm_head if self.has_lm_head else self.shared.weight)


class MT5ForConditionalGeneration(T5ForConditionalGeneration):
    """mT5: T5 v1.1's architecture (gated-GELU, its own lm_head) with a 250k vocabulary; the decoder output is never
    scaled (transformers' MT5 forces tie_word_embeddings=True in the config but does not scale)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__(cfg, dtype, device, max_position)
        self.scale_decoder_outputs = False
