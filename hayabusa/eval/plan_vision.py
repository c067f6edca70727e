"""``hayabusa plan`` for vision-language checkpoints: the vision tower's parameters and its activation peak at the
largest input a prompt may bring, from config.json's ``vision_config`` (Qwen2-VL, Qwen2.5-VL).

Parameters (exact, the modules of transformers' Qwen2-VL / Qwen2.5-VL vision towers; h = vision hidden size, i =
its MLP width, d = depth, o = the language model's hidden size):
  patch embedding   Conv3d 3 x 2 x 14 x 14 -> h, no bias:                    1176 h   (in_channels x temporal x p^2)
  Qwen2.5-VL block  RMSNorm x2, qkv + proj with biases, SwiGLU with biases:  4 h^2 + 3 h i + 7 h + 2 i
  Qwen2-VL block    LayerNorm x2, qkv + proj with biases, fc1 / fc2 biases:  4 h^2 + 2 h i + 9 h + i
  merger            norm (RMSNorm h / LayerNorm 2 h), 4h -> 4h -> o MLP:      16 h^2 + 4 h + 4 h o + o (+ norm)

Activations (estimated like the language model's, one profiling pass over the largest allowed input): P =
max_images x max_pixels / 14^2 patches (the image processor resizes every image to at most max_pixels), at most
4 x max_model_len (one prompt token per 2 x 2 patches);
  pixel values        P x 1176 elements (3 channels x 2 frames x 14 x 14)
  one block's live    P x (6 h + 3 i) elements: residual, normed input, q / k / v, attention output, MLP gate /
                      up / product (varlen attention per image or window: no P x P matrix)
  rotary tables       P x head_dim x 2 fp32 (cos, sin)
  merger              P / 4 x (8 h + o) elements
  encoder output      P / 4 x o elements, kept until the prefill that consumes it.
The plan's activation figure for a VL model is max(language model peak + encoder output, vision peak).
"""

from __future__ import annotations

import json
import os
from typing import Any

PATCH = 14
PATCH_ELEMENTS = 3 * 2 * PATCH * PATCH       # in_channels x temporal_patch_size x patch^2 = 1176
DEFAULT_MAX_PIXELS = 12_845_056              # Qwen2-VL / Qwen2.5-VL image processors' default max_pixels


def _get(v: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        x = v.get(n) if isinstance(v, dict) else getattr(v, n, None)
        if x is not None:
            return x
    return default


def vision_dims(cfg: Any) -> dict[str, Any] | None:
    """{"kind": "qwen2_5_vl" | "qwen2_vl", "hidden", "intermediate", "depth", "heads", "out"} of the vision tower,
    or None for a model without ``vision_config``."""
    v = getattr(cfg, "vision_config", None)
    if v is None:
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if _get(v, "embed_dim") is not None and _get(v, "mlp_ratio") is not None:       # Qwen2-VL
        h = int(_get(v, "embed_dim"))
        return {"kind": "qwen2_vl", "hidden": h, "intermediate": int(h * _get(v, "mlp_ratio")),
                "depth": int(_get(v, "depth")), "heads": int(_get(v, "num_heads", default=16)),
                "out": int(_get(v, "hidden_size", default=getattr(text, "hidden_size", h)))}
    h = int(_get(v, "hidden_size"))
    return {"kind": "qwen2_5_vl", "hidden": h, "intermediate": int(_get(v, "intermediate_size", default=4 * h)),
            "depth": int(_get(v, "depth", "num_hidden_layers")), "heads": int(_get(v, "num_heads", default=16)),
            "out": int(_get(v, "out_hidden_size", default=getattr(text, "hidden_size", h)))}


def vision_params(cfg: Any) -> int:
    """The vision tower's parameter count (0 without one); see the module docstring."""
    dims = vision_dims(cfg)
    if dims is None:
        return 0
    h, i, d, o = dims["hidden"], dims["intermediate"], dims["depth"], dims["out"]
    if dims["kind"] == "qwen2_vl":
        block, norm = 4 * h * h + 2 * h * i + 9 * h + i, 2 * h
    else:
        block, norm = 4 * h * h + 3 * h * i + 7 * h + 2 * i, h
    return PATCH_ELEMENTS * h + d * block + norm + 16 * h * h + 4 * h + 4 * h * o + o


def max_pixels_of(model: str) -> int:
    """max_pixels of the checkpoint's preprocessor_config.json (a local folder), else DEFAULT_MAX_PIXELS."""
    path = os.path.join(model, "preprocessor_config.json")
    try:
        with open(path) as f:
            pp = json.load(f)
        return int(pp.get("max_pixels") or (pp.get("size") or {}).get("longest_edge") or DEFAULT_MAX_PIXELS)
    except (OSError, ValueError, TypeError, AttributeError):
        return DEFAULT_MAX_PIXELS


def vision_activation(cfg: Any, dtype_bytes: int, max_images: int, max_pixels: int,
                      max_model_len: int | None = None) -> dict[str, int] | None:
    """{"patches", "peak_bytes", "encoder_output_bytes", "max_images", "max_pixels"} for `max_images` images of
    `max_pixels` each -- but no more patches than 4 x max_model_len (every 2 x 2 patches become one prompt token,
    and a longer prompt is refused) -- or None without a vision tower."""
    dims = vision_dims(cfg)
    if dims is None:
        return None
    h, i, o = dims["hidden"], dims["intermediate"], dims["out"]
    per_image = max_pixels // (PATCH * PATCH) // 4 * 4          # whole 2 x 2 merge units
    p = max_images * per_image
    if max_model_len:
        p = min(p, 4 * max_model_len)
    pixels = p * PATCH_ELEMENTS * dtype_bytes
    block = p * (6 * h + 3 * i) * dtype_bytes
    rotary = p * (h // dims["heads"]) * 2 * 4
    merger = p // 4 * (8 * h + o) * dtype_bytes
    return {"patches": p, "max_images": max_images, "max_pixels": max_pixels,
            "peak_bytes": pixels + rotary + max(block, merger),
            "encoder_output_bytes": p // 4 * o * dtype_bytes}
