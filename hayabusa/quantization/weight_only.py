"""hayabusa's online weight-only schemes: int8 (W8A16) and int4 (W4A16, group size 128). Activations stay in the
model dtype; the weight is quantized once, after loading, and dequantized inside the matmul kernel (decode, small
batches) or, from ``DEQUANT_GEMM_MIN_M`` tokens on (prefill), into a temporary model-dtype weight that cuBLAS
multiplies (vLLM's AWQ heuristic).

  int8:  W[n, k] = q[n, k] * scale[n]                                  q int8, symmetric, one scale per output
         channel (scale = amax / 127 over the row).
  int4:  W[k, n] = (q[k, n] - zero[k // G, n]) * scale[k // G, n]      q in 0..15, asymmetric, one (scale, zero)
         per group of G = 128 consecutive input features of an output channel, round-to-nearest (the grouping
         of GPTQ / AWQ checkpoints, without their calibration).

Storage and matmuls are ``hayabusa/kernels/quant_linear.py``'s (Triton / cuBLAS on CUDA, a torch reference on CPU):
int8 ``qweight [N, K] int8``, ``scales [N]``; int4 ``qweight [K/8, N] int32`` (8 consecutive k per int32, low
nibble first), ``scales``, ``zeros [K/G, N]`` in the model dtype.

A layer whose K is not a multiple of G (e.g. K = 172 in stories260K's MLP, K = 576 in SmolLM2-135M) is padded
with zero input features up to the next multiple of G at load time, and its input x with zero columns per call:
the real columns' groups are unchanged and the padded columns add exactly 0 to every output. A log line names
the padded layers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.base import LinearMethod, QuantizationConfig, make_param, replace_param
from hayabusa.quantization.packed import quant_kernels

logger = logging.getLogger(__name__)

INT4_GROUP_SIZE = 128


class _OnlineConfig(QuantizationConfig):
    """A scheme that only quantizes unquantized checkpoints while loading (no checkpoint format of its own)."""

    cpu_supported = True
    min_capability = (7, 0)   # what Triton supports
    capability_note = "(Volta and newer; Triton kernels)"

    @classmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "QuantizationConfig":
        raise HayabusaValidationError(
            f"quantization={cls.name!r} quantizes an unquantized checkpoint while loading; a checkpoint whose "
            f"config.json declares quant_method {cls.name!r} has no format hayabusa knows.",
            parameter="quantization", value=cls.name)


class _HighPrecisionWeight(LinearMethod):
    """Creates the checkpoint's high-precision weight [N, K] (model dtype), quantized after loading."""

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        make_param(layer, "weight", torch.empty(sum(output_sizes), in_features, dtype=dtype, device=device))


# ---------------------------------------------------------------------------------------------- int8
class Int8WeightOnlyLinearMethod(_HighPrecisionWeight):
    """W8A16: after loading the layer holds ``qweight [N, K] int8`` and ``scales [N]`` (model dtype)."""

    def process_weights_after_loading(self, layer):
        q, s = quant_kernels().quantize_int8_per_channel(layer.weight.data)
        replace_param(layer, "weight", None)
        replace_param(layer, "qweight", q)
        replace_param(layer, "scales", s.to(layer.params_dtype))

    def apply(self, layer, x):
        lead, K = x.shape[:-1], x.shape[-1]
        y = quant_kernels().int8_weight_only_linear(x.reshape(-1, K), layer.qweight, layer.scales, layer.bias)
        return y.reshape(*lead, layer.out_features)


class Int8Config(_OnlineConfig):
    """``quantization="int8"``: per-output-channel symmetric int8 weights, activations in the model dtype."""

    name = "int8"

    @classmethod
    def online(cls) -> "Int8Config":
        return cls()

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        return Int8WeightOnlyLinearMethod()


# ---------------------------------------------------------------------------------------------- int4
class Int4WeightOnlyLinearMethod(_HighPrecisionWeight):
    """W4A16, group size G: after loading the layer holds ``qweight [K'/8, N] int32``, ``scales`` and ``zeros``
    [K'/G, N] (model dtype), with K' = K rounded up to a multiple of G (``int4_pad`` = K' - K zero columns)."""

    def __init__(self, group_size: int = INT4_GROUP_SIZE) -> None:
        self.group_size = group_size

    def process_weights_after_loading(self, layer):
        w = layer.weight.data                                  # [N, K]
        K, G = w.shape[1], self.group_size
        pad = -K % G
        if pad:
            w = F.pad(w, (0, pad))
        q, s, z = quant_kernels().quantize_int4_grouped(w, group_size=G)
        replace_param(layer, "weight", None)
        replace_param(layer, "qweight", q)
        replace_param(layer, "scales", s.to(layer.params_dtype))
        replace_param(layer, "zeros", z.to(layer.params_dtype))
        layer.int4_pad = pad

    def apply(self, layer, x):
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if layer.int4_pad:
            x2 = F.pad(x2, (0, layer.int4_pad))
        y = quant_kernels().int4_weight_only_linear(x2, layer.qweight, layer.scales, layer.zeros, self.group_size,
                                               layer.bias)
        return y.reshape(*lead, layer.out_features)


class Int4Config(_OnlineConfig):
    """``quantization="int4"``: 4-bit asymmetric weights in groups of ``group_size`` input features (RTN)."""

    name = "int4"

    def __init__(self, group_size: int = INT4_GROUP_SIZE) -> None:
        self.group_size = group_size

    @classmethod
    def online(cls) -> "Int4Config":
        return cls()

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        K = layer.in_features
        if K % self.group_size:
            logger.info("int4: %s has K=%d, not a multiple of the group size %d: padded with %d zero input "
                        "features", layer_prefix, K, self.group_size, -K % self.group_size)
        return Int4WeightOnlyLinearMethod(self.group_size)
