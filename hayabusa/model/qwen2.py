"""Qwen2 / Qwen2.5: Llama with q/k/v biases (no o_proj bias), usually tied embeddings on small sizes."""

from __future__ import annotations

from typing import Any

from hayabusa.model.llama import LlamaForCausalLM


def qwen_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    """Qwen2/Qwen3's per-layer rule (HF): with ``use_sliding_window``, layers ``>= max_window_layers`` slide.
    transformers >= 4.53 writes the rule out as ``layer_types``; older configs get it computed here."""
    window = getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", False) or not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if layer_idx >= getattr(cfg, "max_window_layers", 0) else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """HF ``Qwen2ForCausalLM``; ``use_sliding_window`` follows HF's per-layer rule (``max_window_layers``)."""

    qkv_bias_default = True
    o_bias_follows_attention_bias = False

    @classmethod
    def sliding_window(cls, cfg: Any, layer_idx: int) -> int | None:
        return qwen_sliding_window(cfg, layer_idx)
