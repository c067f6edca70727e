"""Quantization method names (vLLM's, plus hayabusa's online "int8" / "int4" and SGLang's "w8a8_int8") -> config
classes, and the choice between the ``quantization=`` engine argument and the checkpoint's
``quantization_config``."""

from __future__ import annotations

from typing import Any

import torch

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.awq import AwqConfig
from hayabusa.quantization.base import QuantizationConfig
from hayabusa.quantization.bitsandbytes import BitsAndBytesConfig
from hayabusa.quantization.compressed_tensors import CompressedTensorsConfig
from hayabusa.quantization.fp8 import Fp8Config
from hayabusa.quantization.gptq import GptqConfig
from hayabusa.quantization.w8a8_int8 import W8A8Int8Config
from hayabusa.quantization.weight_only import Int4Config, Int8Config


# name -> config class. The config classes' ``name`` equals the key.
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "int8": Int8Config,
    "int4": Int4Config,
    "w8a8_int8": W8A8Int8Config,
    "awq": AwqConfig,
    "gptq": GptqConfig,
    "bitsandbytes": BitsAndBytesConfig,
}

# Spellings of quant_method found in config.json files, and vLLM's kernel-specific names of the same checkpoint
# formats (it picks marlin kernels on its own) -> our name.
_ALIASES = {"compressed_tensors": "compressed-tensors", "awq_marlin": "awq", "gptq_marlin": "gptq"}


def implemented_methods() -> list[str]:
    """Every registry name (each one runs; the list is kept for callers that ask which do)."""
    return list(QUANTIZATION_METHODS)


def methods_supported_on(device: torch.device) -> list[str]:
    """Implemented method names that run on ``device``."""
    return [n for n in implemented_methods() if QUANTIZATION_METHODS[n].supports(device)]


def check_device(quant_config: QuantizationConfig, device: torch.device) -> None:
    """Raises HayabusaValidationError when ``quant_config``'s scheme cannot run on ``device``; the message names the
    scheme, the device (and its compute capability) and the schemes that do run there."""
    if quant_config.supports(device):
        return
    if device.type == "cuda":
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        where = f"{device} ({torch.cuda.get_device_name(device)}, compute capability {cap})"
    else:
        where = str(device)
    runs = methods_supported_on(device)
    raise HayabusaValidationError(
        f"quantization={quant_config.name!r} runs on {quant_config.supported_devices()}, not on {where}. On this "
        f"device hayabusa runs: {', '.join(runs) if runs else 'no quantization scheme'}.",
        parameter="quantization", value=quant_config.name)


def normalize_method_name(name: str) -> str:
    """Lower-cased registry name of ``name``.

    Raises:
        HayabusaValidationError: not a known method (the message lists the known ones).
    """
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in QUANTIZATION_METHODS:
        raise HayabusaValidationError(
            f"quantization={name!r} is not a known method; known: {', '.join(QUANTIZATION_METHODS)}.",
            parameter="quantization", value=name)
    return key


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` dict of an HF config (object or dict), or None."""
    qc = hf_config.get("quantization_config") if isinstance(hf_config, dict) else \
        getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def get_quantization_config(quantization: str | None, hf_config: Any) -> QuantizationConfig | None:
    """The quantization to run: from the ``quantization`` engine argument and/or the checkpoint's
    ``quantization_config`` (vLLM's rule: the checkpoint's method is used when the argument is None; both given
    must agree).

    Args:
        quantization: a registry name or None.
        hf_config: the checkpoint's HF config (``transformers.PretrainedConfig``) or its dict.
    Returns:
        The config, or None for an unquantized run.
    Raises:
        HayabusaValidationError: unknown name; the argument disagrees with the checkpoint (both named); the
            checkpoint's variant of the scheme is not supported; the scheme needs a quantized checkpoint.
    """
    qc = checkpoint_quantization_config(hf_config)
    name = normalize_method_name(quantization) if quantization is not None else None
    if qc is None:
        if name is None:
            return None
        try:
            return QUANTIZATION_METHODS[name].online()
        except HayabusaValidationError as e:
            if str(quantization).strip().lower() == name:
                raise
            # an alias (vLLM's "awq_marlin"): the message names what the user wrote, then the format it means
            raise HayabusaValidationError(f"quantization={quantization!r} (the {name!r} format): {e}",
                                          parameter="quantization", value=quantization) from None
    if "quant_method" not in qc:
        raise HayabusaValidationError("the checkpoint's quantization_config has no quant_method.",
                                      parameter="quantization", value=qc)
    ckpt = normalize_method_name(qc["quant_method"])
    if name is not None and name != ckpt:
        raise HayabusaValidationError(
            f"quantization={quantization!r} does not match the checkpoint, which is quantized with "
            f"{qc['quant_method']!r} (config.json quantization_config). Leave quantization unset to use the "
            "checkpoint's method, or pass an unquantized checkpoint.", parameter="quantization", value=quantization)
    return QUANTIZATION_METHODS[ckpt].from_hf_config(qc)
