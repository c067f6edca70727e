"""Quantization: one ``QuantizationConfig`` per scheme hands each ``Linear`` a ``LinearMethod`` (base.py).

Schemes (vLLM's method names):
  fp8                 FP8 W8A8 (e4m3, per-channel weight scales, per-token activation scales): FP8 checkpoints
                      with ``{"quant_method": "fp8"}``, or ``quantization="fp8"`` on an unquantized checkpoint
  compressed-tensors  FP8 and INT8 W8A8 checkpoints in compressed-tensors format (llm-compressor)
  int8, int4          hayabusa's online weight-only schemes (W8A16 per channel; W4A16 group 128)
  w8a8_int8           INT8 W8A8 (per-channel int8 weights, per-token int8 activations, int32 accumulation) of an
                      unquantized checkpoint, quantized while loading (SGLang's name; vLLM has no online INT8 W8A8)
  awq                 AWQ 4-bit checkpoints (AutoAWQ GEMM packing), repacked at load for the int4 kernel
  gptq                GPTQ checkpoints: 4-bit (int4 kernel; act-order by a row permutation), 8-bit (int8 kernel, or
                      dequantized when grouped / asymmetric); v1 and v2 zero points
  bitsandbytes        8-bit (int8 kernel, no bitsandbytes needed) and 4-bit NF4 / FP4 (through bitsandbytes)
                      checkpoints
("awq_marlin" / "gptq_marlin", vLLM's kernel-specific names, mean awq / gptq.)
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
    check_device,
    get_quantization_config,
    implemented_methods,
    methods_supported_on,
    normalize_method_name,
)

__all__ = [
    "LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "current_quantization_config",
    "set_quantization_config", "QUANTIZATION_METHODS", "check_device", "get_quantization_config",
    "implemented_methods", "methods_supported_on", "normalize_method_name",
]
