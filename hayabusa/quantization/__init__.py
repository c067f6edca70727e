"""Quantization: one ``QuantizationConfig`` per scheme hands each ``Linear`` a ``LinearMethod`` (base.py).

Schemes (vLLM's method names):
  fp8                 FP8 W8A8 (e4m3, per-channel weight scales, per-token activation scales): FP8 checkpoints
                      with ``{"quant_method": "fp8"}``, or ``quantization="fp8"`` on an unquantized checkpoint
  compressed-tensors  FP8 W8A8 checkpoints in compressed-tensors format
  int8, int4          hayabusa's online weight-only schemes (W8A16 per channel; W4A16 group 128)
  awq, gptq, bitsandbytes   names reserved, not implemented yet
"""

from hayabusa.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    current_quantization_config,
    set_quantization_config,
)
from hayabusa.quantization.registry import (
    QUANTIZATION_METHODS,
    get_quantization_config,
    implemented_methods,
    methods_supported_on,
    normalize_method_name,
)

__all__ = [
    "LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "current_quantization_config",
    "set_quantization_config", "QUANTIZATION_METHODS", "get_quantization_config", "implemented_methods",
    "methods_supported_on", "normalize_method_name",
]
