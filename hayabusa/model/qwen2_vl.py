"""Qwen2-VL and Qwen2.5-VL: a ViT vision tower whose merged patch features replace the ``<|image_pad|>`` token
embeddings, and a Qwen2 decoder with multimodal RoPE (M-RoPE: three position rows t / h / w, each rotating its
own section of the head's frequencies).

Entry points (the model knows no requests):
    get_image_embeddings(pixel_values [N_patch, C * tp * p * p], grid_thw [(t, h, w), ...]) -> [N_tok, hidden]
    embed_input_ids(input_ids [T]) -> [T, hidden]
    forward(input_ids [T], positions [3, T] (or [T] = all rows equal), ctx, inputs_embeds=None) -> [T, hidden]
    compute_logits(hidden [R, hidden]) -> [R, V]

Vision tower facts (transformers' modeling_qwen2_vl / modeling_qwen2_5_vl): the Conv3d patch embedding with
kernel = stride = (tp, p, p) is a bias-free linear over each flattened patch; patches arrive block-major over the
2 x 2 merge units; the 2-D rotary uses head_dim / 4 frequencies for h and for w; Qwen2.5 reorders merge units
window by window (``window_size`` pixels) and attends within windows, except at ``fullatt_block_indexes``.

Checkpoint keys: transformers 4.x (``visual.*``, ``model.*``, ``lm_head``) and 5.x (``model.visual.*``,
``model.language_model.*``, ``lm_head``) both load (5.x names are renamed to ours, the 4.x ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.kernels.rotary import rotary_embedding
from hayabusa.model.layers.activation import get_act_fn, silu_and_mul
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import LayerNorm, RMSNorm, norm_first
from hayabusa.model.llama import MERGED_QKV_GATE_UP, LlamaAttention, LlamaDecoderLayer
from hayabusa.model.qwen2 import qwen_sliding_window
from hayabusa.model.vision_attention import Segments, build_segments, host_to_device, use_flash_varlen

GridTHW = Sequence[Sequence[int]]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


# ------------------------------------------------------------------------------------------------ M-RoPE (text)
def mrope_section(cfg: Any) -> list[int]:
    """The text config's ``mrope_section`` (4.x ``rope_scaling``, 5.x ``rope_parameters``)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, name, None)
        if isinstance(params, dict) and params.get("mrope_section"):
            return list(params["mrope_section"])
    return [16, 24, 24]


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


class MRotaryEmbedding(nn.Module):
    """M-RoPE over q [T, H, D] and k [T, H_kv, D] at positions [3, T] int64 (rows t, h, w).

    Frequency j of the first half of the head takes its angle from row ``section_of(j)``
    (``mrope_section`` = [s_t, s_h, s_w], sum D / 2); the second half repeats the first (rotate-half layout).
    Positions [T] mean all three rows equal (plain RoPE). cos / sin are cached per position in the model dtype,
    from fp32 angles, as HF casts them before use.
    """

    def __init__(self, cfg: Any, head_dim: int, max_position: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        section = mrope_section(cfg)
        assert sum(section) * 2 == head_dim, (section, head_dim)
        theta = _rope_theta(cfg)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv[None, :]   # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)                                                 # [P, D]
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)
        half = torch.repeat_interleave(torch.arange(3), torch.tensor(section))                # [D/2] in {0,1,2}
        self.register_buffer("row_of_dim", torch.cat([half, half]).to(device), persistent=False)   # [D]
        self.step_cos_sin: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (positions, cos, sin)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] or [T] -> (cos, sin) [T, 1, D]."""
        if positions.dim() == 1:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        D = self.cos.shape[1]
        T = positions.shape[1]
        # rows of positions per head dim: [T, D] -> the cache's [P, D] at (pos[row_of_dim[d], t], d)
        pos = positions.t().gather(1, self.row_of_dim.view(1, D).expand(T, D))                   # [T, D]
        cols = torch.arange(D, device=positions.device).view(1, D)
        return self.cos[pos, cols].unsqueeze(1), self.sin[pos, cols].unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        step = self.step_cos_sin            # set by Qwen2VLTextModel.forward: one gather per forward, not per layer
        cos, sin = step[1:] if step is not None and step[0] is positions else self.cos_sin(positions)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class MRopeAttention(LlamaAttention):
    """Qwen2's attention with M-RoPE applied here (torch), then the shared paged Attention without a rotary."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))                     # [T, hidden]


class _TextArch:
    """What LlamaDecoderLayer asks of an architecture, for the Qwen2 decoder of the VL models."""

    attention_cls = MRopeAttention

    @staticmethod
    def attention_biases(cfg: Any) -> tuple[bool, bool]:
        return True, False

    @staticmethod
    def sliding_window(cfg: Any, layer_idx: int) -> int | None:
        return qwen_sliding_window(cfg, layer_idx)


class Qwen2VLTextModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary_emb = MRotaryEmbedding(cfg, head_dim, max_position, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.rotary_emb, _TextArch, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        residual = None
        # every layer rotates at the same positions: their cos / sin gathered once for the forward
        self.rotary_emb.step_cos_sin = (positions, *self.rotary_emb.cos_sin(positions))
        try:
            for layer in self.layers:
                x, residual = layer(positions, x, residual, ctx)
        finally:
            self.rotary_emb.step_cos_sin = None
        x, _ = self.norm(x, residual)
        return x


# ------------------------------------------------------------------------------------------------ vision tower
def vision_rotary_positions(grid_thw: GridTHW, merge: int) -> np.ndarray:
    """(h, w) of every patch, in the processor's block-major order over merge x merge units: [N_patch, 2] int64."""
    out = []
    for t, h, w in grid_thw:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")          # [h, w]
        shape = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        ww = ww.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hh, ww], axis=1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def window_order(grid_thw: GridTHW, merge: int, window_units: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5's window attention layout.

    Merge units (merge x merge patches each) of every image are visited window by window (``window_units`` x
    ``window_units`` units, row-major windows, row-major units inside; edge windows are smaller).

    Returns:
        order: [N_units] int64, the unit index (over all images, in input order) at each new position.
        cu_window: cumulative patch counts of the windows, starting at 0 (empty windows dropped).
    """
    orders, counts = [], []
    base = 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        nwr, nwc = -(-gh // window_units), -(-gw // window_units)            # windows per column / row
        f, r, c = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")   # units, row-major
        win = ((f * nwr + r // window_units) * nwc + c // window_units).reshape(-1)       # [t * gh * gw]
        # windows in row-major order, units row-major inside each (a stable sort keeps the units' order)
        orders.append(np.argsort(win, kind="stable") + base)
        counts.append(np.bincount(win, minlength=t * nwr * nwc))            # every window holds >= 1 unit
        base += t * gh * gw
    cu = np.concatenate([[0], np.cumsum(np.concatenate(counts)) * merge * merge])
    return np.concatenate(orders).astype(np.int64), cu.tolist()


def full_segments(grid_thw: GridTHW) -> list[int]:
    """Cumulative patch counts of the full-attention segments: one per frame of every image, from 0."""
    cu = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


@dataclass
class VisionRope:
    """The tower's 2-D rotary for one forward (shared by every layer), fp32 as HF computes it.

    cos, sin: [N, D] fp32, the angle of each row's (h, w) position (rotate-half layout: the halves repeat).
    rows: [N] int64 = arange(N) on the device when q and k are rotated by the Triton kernel (``kernels/rotary.py``:
        one launch per layer for q and k, fp32 math, one rounding); None for the torch path (CPU).
    cos4, sin_signed: the torch path's [N, 1, 1, D] fp32 factors for qkv [N, 3, H, D] (sin_signed: rotate_half's
        sign moved in); None on the kernel path.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    rows: torch.Tensor | None
    cos4: torch.Tensor | None = None
    sin_signed: torch.Tensor | None = None

    @classmethod
    def build(cls, emb: torch.Tensor, fused: bool) -> "VisionRope":
        """emb [N, D] fp32 angles -> the rotary of one forward (``fused``: the kernel's layout)."""
        N, D = emb.shape
        cos, sin = emb.cos(), emb.sin()                                          # [N, D] fp32
        if fused:
            return cls(cos, sin, torch.arange(N, device=emb.device))
        sin_signed = torch.cat([-sin[:, :D // 2], sin[:, D // 2:]], dim=-1)     # rotate_half's sign in sin
        return cls(cos, sin, None, cos.view(N, 1, 1, D), sin_signed.view(N, 1, 1, D))

    def rotate_qk(self, qkv: torch.Tensor) -> None:
        """Rotate q and k of qkv [N, 3, H, D] in place, in fp32 and rounded once to qkv's dtype (HF's float()
        round trip): q * cos + rotate_half(q) * sin."""
        if self.rows is not None:
            rotary_embedding(self.rows, qkv[:, 0], qkv[:, 1], self.cos, self.sin)
            return
        qk = qkv[:, :2].float()                                                  # [N, 2, H, D] fp32
        # rotate_half(x) = cat(-x2, x1) = roll(x) with the first half's sign moved into sin (exact)
        qkv[:, :2].copy_(qk * self.cos4 + torch.roll(qk, qk.shape[-1] // 2, dims=-1) * self.sin_signed)


def fused_vision_rope(device: torch.device) -> bool:
    """Whether the tower rotates q and k with the Triton rotary kernel (CUDA) rather than torch ops."""
    return torch.device(device).type == "cuda"


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, [3 * dim], True, dtype, device)
        self.proj = Linear(dim, [dim], True, dtype, device)

    def forward(self, x: torch.Tensor, rope: VisionRope, segments: Segments) -> torch.Tensor:
        """x [N, dim] -> [N, dim]; q and k rotated by ``rope``, attention within ``segments``."""
        N = x.shape[0]
        qkv = self.qkv(x).view(N, 3, self.num_heads, self.head_dim)                 # [N, 3, H, D]
        rope.rotate_qk(qkv)
        out = segments.attend(qkv, self.head_dim ** -0.5)                           # [N, H, D]
        return self.proj(out.reshape(N, -1))


class VisionSwiGLU(nn.Module):
    """Qwen2.5's vision MLP: down(silu(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, inter: int, act: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        assert act in ("silu", "swish"), act
        self.gate_up_proj = Linear(dim, [inter, inter], True, dtype, device, shard_names=["gate", "up"])
        self.down_proj = Linear(inter, [dim], True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class VisionMLP(nn.Module):
    """Qwen2's vision MLP: fc2(act(fc1(x))) (QuickGELU in the released checkpoints)."""

    def __init__(self, dim: int, inter: int, act: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.fc1 = Linear(dim, [inter], True, dtype, device)
        self.fc2 = Linear(inter, [dim], True, dtype, device)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, norm_cls: type, mlp: nn.Module, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.norm1 = norm_cls(dim, 1e-6, dtype, device)
        self.norm2 = norm_cls(dim, 1e-6, dtype, device)
        self.attn = VisionAttention(dim, heads, dtype, device)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: VisionRope,
                segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's x = x + attn(norm1(x)); x = x + mlp(norm2(x)) with each residual add fused into the next norm
        (one kernel on CUDA, the same numbers): takes and returns (mlp output, residual stream) [N, dim]; the
        stream's sum is the block's output."""
        h, residual = norm_first(self.norm1, x, residual)
        h, residual = self.norm2(self.attn(h, rope, segments), residual)
        return self.mlp(h), residual


class PatchMerger(nn.Module):
    """norm, then merge x merge neighbouring patches concatenated -> Linear -> GELU -> Linear -> out_dim."""

    def __init__(self, dim: int, out_dim: int, merge: int, norm_cls: type, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.ln_q = norm_cls(dim, 1e-6, dtype, device)
        self.mlp = nn.Sequential(Linear(self.merged_dim, [self.merged_dim], True, dtype, device), nn.GELU(),
                                 Linear(self.merged_dim, [out_dim], True, dtype, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))      # [N / merge^2, out_dim]


class VisionTransformer(nn.Module):
    """The vision tower of either model (``v25``: Qwen2.5's RMSNorm / SwiGLU / window attention)."""

    def __init__(self, vc: Any, out_dim: int, v25: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.v25 = v25
        dim = vc.hidden_size if v25 else vc.embed_dim
        heads = vc.num_heads
        self.merge = vc.spatial_merge_size
        self.patch_size = vc.patch_size
        in_ch = getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3)
        self.patch_dim = in_ch * vc.temporal_patch_size * vc.patch_size ** 2
        self.patch_shape = (dim, in_ch, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = nn.Parameter(torch.empty(self.patch_shape, dtype=dtype, device=device),
                                                    requires_grad=False)
        norm_cls = RMSNorm if v25 else LayerNorm
        act = getattr(vc, "hidden_act", "silu" if v25 else "quick_gelu")
        if v25:
            mlps = [VisionSwiGLU(dim, vc.intermediate_size, act, dtype, device) for _ in range(vc.depth)]
        else:
            inter = int(dim * vc.mlp_ratio)
            mlps = [VisionMLP(dim, inter, act, dtype, device) for _ in range(vc.depth)]
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, norm_cls, m, dtype, device) for m in mlps)
        self.merger = PatchMerger(dim, out_dim, self.merge, norm_cls, dtype, device)
        self.full_blocks = set(getattr(vc, "fullatt_block_indexes", None) or []) if v25 else set(range(vc.depth))
        self.window_units = (vc.window_size // self.merge // self.patch_size) if v25 else 0
        head_dim = dim // heads
        rope = getattr(vc, "rope_parameters", None)
        theta = float(rope.get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        half = head_dim // 2            # h and w each rotate over half of the head: D / 4 frequencies each
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32)
                                                          / half)).to(device), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        """pixel_values [N, C * tp * p * p] (any float dtype), grid_thw [(t, h, w)] per image (in patches) ->
        merged features [N / merge^2, out_dim] in the model dtype, images in input order."""
        w = self.patch_embed.proj.weight
        x = F.linear(pixel_values.to(w.dtype), w.view(w.shape[0], -1))                # [N, dim]
        pos = host_to_device(vision_rotary_positions(grid_thw, self.merge), x.device)   # [N, 2] int64
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)                  # [N, D/2]: h freqs, w freqs
        emb = torch.cat([freqs, freqs], dim=-1)                                      # [N, D] fp32
        unit = self.merge * self.merge
        full_cu = window_cu = full_segments(grid_thw)
        order = None
        if self.v25:
            order_np, window_cu = window_order(grid_thw, self.merge, self.window_units)
            inverse_np = np.empty_like(order_np)
            inverse_np[order_np] = np.arange(len(order_np))                           # argsort on the host
            order, inverse = host_to_device([order_np, inverse_np], x.device).split(len(order_np))

            def permute(t: torch.Tensor) -> torch.Tensor:   # by merge unit: [N, ...] -> [N, ...]
                return t.view(-1, unit, t.shape[-1])[order].view(-1, t.shape[-1])
            x, emb = permute(x), permute(emb)
        rope = VisionRope.build(emb, fused_vision_rope(x.device))
        full, window = build_segments([full_cu, window_cu], x.device, use_flash_varlen(x.device, x.dtype))
        residual = None
        for i, blk in enumerate(self.blocks):
            x, residual = blk(x, residual, rope, full if i in self.full_blocks else window)
        x = self.merger(x + residual)                                                # [N / unit, out_dim]
        if order is not None:
            x = x[inverse]                                                           # back to input order
        return x


# ------------------------------------------------------------------------------------------------ the model
class Qwen2VLForConditionalGeneration(nn.Module):
    """HF ``Qwen2VLForConditionalGeneration`` (images; video inputs are not supported).

    Built from the checkpoint's whole config (``vision_config`` and the text config); see the module docstring.
    """

    is_multimodal = True
    v25 = False
    stacked_params_mapping = MERGED_QKV_GATE_UP
    # the lm_head matmul; HAYABUSA_SMALL_M_LINEAR sets linear_small_m on the instance (model/loader.py)
    logits_linear = staticmethod(F.linear)

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.config, self.text_config = cfg, text
        self.visual = VisionTransformer(cfg.vision_config, text.hidden_size, self.v25, dtype, device)
        self.model = Qwen2VLTextModel(text, dtype, device, max(max_position, 1))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False)
                                        or getattr(text, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(text.hidden_size, [text.vocab_size], False,
                                                                    dtype, device)
        self.image_token_id = int(cfg.image_token_id)
        self.spatial_merge_size = int(cfg.vision_config.spatial_merge_size)

    @torch.inference_mode()
    def get_image_embeddings(self, pixel_values: torch.Tensor, grid_thw: GridTHW) -> list[torch.Tensor]:
        """Run the vision tower over one or more images.

        Args:
            pixel_values: [N_patch, C * tp * p * p], the images' patches one after another (the image processor's
                output, concatenated), any float dtype, on the model's device.
            grid_thw: per image (t, h, w) in patches; N_patch = sum t * h * w.
        Returns:
            Per image its embeddings [t * h * w / merge^2, hidden] in the model dtype (the rows that replace its
            ``<|image_pad|>`` tokens, in order).
        """
        feats = self.visual(pixel_values, grid_thw)
        unit = self.spatial_merge_size ** 2
        return list(feats.split([t * h * w // unit for t, h, w in grid_thw]))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> token embeddings [T, hidden] (image placeholders get the pad token's row)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [3, T] (M-RoPE rows t, h, w) or [T] (text: rows equal), optional
        inputs_embeds [T, hidden] (image rows already in) -> hidden [T, hidden]."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model(x, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in the model dtype."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.logits_linear(hidden, w)

    @staticmethod
    def rename_checkpoint_key(name: str) -> str:
        """transformers 5.x names -> 4.x names (ours)."""
        if name.startswith("model.visual."):
            return name[len("model."):]
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        return name

    def ignored_checkpoint_key(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """HF ``Qwen2_5_VLForConditionalGeneration``: RMSNorm / SwiGLU vision blocks, window attention."""

    v25 = True
