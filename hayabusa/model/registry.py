"""HF architecture name -> model class."""

from __future__ import annotations

import importlib
from typing import Any

from hayabusa.errors import UnsupportedModelError

# architecture -> (module, class)
_MODELS = {
    "LlamaForCausalLM": ("hayabusa.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("hayabusa.model.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("hayabusa.model.qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("hayabusa.model.mistral", "MistralForCausalLM"),
    "Gemma2ForCausalLM": ("hayabusa.model.gemma2", "Gemma2ForCausalLM"),
    "GPT2LMHeadModel": ("hayabusa.model.gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("hayabusa.model.opt", "OPTForCausalLM"),
    "T5ForConditionalGeneration": ("hayabusa.model.t5", "T5ForConditionalGeneration"),
    "MT5ForConditionalGeneration": ("hayabusa.model.t5", "MT5ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("hayabusa.model.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("hayabusa.model.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: Any) -> str:
    """The first of the config's ``architectures`` that hayabusa supports.

    Raises:
        UnsupportedModelError: none is supported (the message lists the supported ones).
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return arch
    raise UnsupportedModelError(
        f"architecture {archs or '(none in config.json)'} is not supported; supported: "
        f"{', '.join(supported_architectures())}.", parameter="model", value=archs)


def get_model_class(arch: str):
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(module), name)
