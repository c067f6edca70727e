"""Qwen2 / Qwen2.5: Llama with q/k/v biases (no o_proj bias), usually tied embeddings on small sizes."""

from __future__ import annotations

from hayabusa.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """HF ``Qwen2ForCausalLM``. Sliding window (use_sliding_window) is rejected by the registry for now."""

    qkv_bias_default = True
    o_bias_follows_attention_bias = False
