"""Mistral: Llama with a sliding window on every layer (``sliding_window``, None = full attention)."""

from __future__ import annotations

from typing import Any

from hayabusa.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """HF ``MistralForCausalLM``: no biases; every layer attends to the last ``sliding_window`` keys (HF: query at
    p sees keys p-W+1..p). ``layer_types`` is ignored, as HF Mistral ignores it."""

    @classmethod
    def sliding_window(cls, cfg: Any, layer_idx: int) -> int | None:
        return getattr(cfg, "sliding_window", None) or None
