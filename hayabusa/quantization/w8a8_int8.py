"""INT8 W8A8: int8 weights with per-output-channel scales, int8 activations with per-token (dynamic) or one static
scale, int32 accumulation, dequantized in the matmul's epilogue.

  y [M, N] = ((x_q [M, K] @ w_q^T [K, N] in int32, as fp32) * s_x [M, 1]) * s_w [1, N]   (+ bias)

Symmetric throughout (no zero points): s = amax / 127, q = round-half-even(t / s) (kernels/int8_quant.py); weights
in [-127, 127], activations in [-128, 127] (a static scale may saturate). The same numerics everywhere:
  * CUDA, compute capability >= 8.0 (int8 tensor cores): the activations by one Triton launch
    (``per_token_quant_int8``), the product by ``int8_scaled_mm`` (kernels/int8_gemm.py): a Triton int8 GEMM with
    the scales and bias fused into its epilogue (``torch._int_mm`` + a one-pass epilogue is there from
    ``INT_MM_MIN_M`` rows, off by default: slower than the Triton kernel at every M on the H200).
  * CPU: an exact emulation: the same int8 x_q, s_x (torch reference, same bits), the int32 accumulation done
    exactly in float64, the same fp32 epilogue; so ``hayabusa eval --fidelity`` on CPU measures the real error.

Where the weights come from:
  * ``quantization="w8a8_int8"`` on an unquantized checkpoint: each weight is quantized per output channel after
    loading, its high-precision copy freed (activations per token). vLLM has no online INT8 W8A8 method; the name
    is SGLang's (``--quantization w8a8_int8``). Round-to-nearest without smoothing: SmoothQuant's migrated scales
    come with checkpoints (llm-compressor's job), not from here.
  * compressed-tensors INT8 W8A8 checkpoints (llm-compressor's SmoothQuant + GPTQ "W8A8" recipes; vLLM detects
    them the same way): ``compressed_tensors.py`` parses the config and hands this method ``weight`` int8 [N, K],
    ``weight_scale`` [N, 1] (channel) or one per checkpoint tensor (tensor), ``input_scale`` (static), and accepts
    all-zero ``weight_zero_point`` / ``input_zero_point`` tensors that some exports write for symmetric schemes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.act_quant import QuantizedActivation
from hayabusa.quantization.base import (LinearMethod, QuantizationConfig, create_w8a8_checkpoint_params, make_param,
                                        per_channel_weight_scale, replace_param)

W8A8_INT8_MIN_CAPABILITY = (8, 0)
W8A8_INT8_CAPABILITY_NOTE = "(Ampere, Ada, Hopper: int8 tensor cores)"


def _kernels():
    """(int8_quant, int8_gemm) kernel modules, imported on first use (naming a scheme does not load Triton)."""
    from hayabusa.kernels import int8_gemm, int8_quant

    return int8_quant, int8_gemm


def quantize_int8_rows(t: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of t [M, K]: (q [M, K] int8, s [M, 1] fp32), t ~= q * s; one static scale when given.
    The activation quantizer's torch reference (the same bits as its Triton kernel), also used for the weights
    (rows = output channels)."""
    return _kernels()[0].per_token_quant_int8_ref(t, scale)


class Int8W8A8LinearMethod(LinearMethod):
    """INT8 W8A8 on one Linear (module docstring).

    Args:
        checkpoint_int8: the checkpoint holds int8 weights and scales (else a high-precision weight is quantized
            after loading).
        weight_strategy: "channel" (``weight_scale`` [N, 1]) or "tensor" (one per checkpoint tensor); only read
            when ``checkpoint_int8``.
        static_input: the checkpoint has calibrated ``input_scale`` scalars (else per-token dynamic scales).

    After loading the layer holds ``weight`` [N, K] int8, ``weight_scale`` [N] fp32 and ``input_scale`` (fp32
    scalar) or None.
    """

    def __init__(self, checkpoint_int8: bool, weight_strategy: str = "channel", static_input: bool = False) -> None:
        assert weight_strategy in ("tensor", "channel")
        self.checkpoint_int8 = checkpoint_int8
        self.weight_strategy = weight_strategy
        self.static_input = static_input

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        if not self.checkpoint_int8:
            make_param(layer, "weight", torch.empty(sum(output_sizes), in_features, dtype=dtype, device=device))
            return
        create_w8a8_checkpoint_params(layer, in_features, output_sizes, device, torch.int8, self.weight_strategy,
                                      self.static_input, zero_points=True)

    def process_weights_after_loading(self, layer):
        w = layer.weight.data
        if not self.checkpoint_int8:
            wq, sw = quantize_int8_rows(w)                      # [N, K] int8, [N, 1] fp32
            sw = sw.view(-1)
        else:
            for name in ("weight_zero_point", "input_zero_point"):
                zp = getattr(layer, name, None)
                if zp is not None and bool(torch.any(zp != 0)):
                    raise HayabusaValidationError(
                        f"INT8 W8A8 checkpoint: {name} of this layer is not zero (an asymmetric scheme); hayabusa "
                        "runs symmetric int8 weights and activations only.", parameter="model", value=name)
                replace_param(layer, name, None)
            wq = w
            sw = per_channel_weight_scale(layer, self.weight_strategy)
        # merged shards with static scales share the largest one (as vLLM does): no shard saturates earlier
        si = layer.input_scale.data.float().max().reshape(1) if self.static_input else None
        replace_param(layer, "weight", wq.contiguous())
        replace_param(layer, "weight_scale", sw.contiguous())
        replace_param(layer, "input_scale", si)

    def input_quant(self, layer, M):
        """"int8" for per-token dynamic activations (None with a static input scale: the producer quantizes
        dynamically only)."""
        return None if self.static_input else "int8"

    def apply(self, layer, x):
        quant, gemm = _kernels()
        if isinstance(x, QuantizedActivation):  # quantized by the kernel that made x (input_quant): [M, K] int8
            return gemm.int8_scaled_mm(x.xq, x.scale, layer.weight, layer.weight_scale, layer.bias, x.dtype)
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if x.is_cuda:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            xq, sx = quant.per_token_quant_int8(x2, layer.input_scale)       # one launch
        else:
            xq, sx = quant.per_token_quant_int8_ref(x2, layer.input_scale)
        y = gemm.int8_scaled_mm(xq, sx, layer.weight, layer.weight_scale, layer.bias, x.dtype)
        return y.reshape(*lead, layer.out_features)


class W8A8Int8Config(QuantizationConfig):
    """``quantization="w8a8_int8"``: online INT8 W8A8 (per-channel weights, per-token activations) of an
    unquantized checkpoint. INT8 W8A8 checkpoints are compressed-tensors ones (compressed_tensors.py)."""

    name = "w8a8_int8"
    cpu_supported = True
    min_capability = W8A8_INT8_MIN_CAPABILITY
    capability_note = W8A8_INT8_CAPABILITY_NOTE

    @classmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "W8A8Int8Config":
        raise HayabusaValidationError(
            "quantization='w8a8_int8' quantizes an unquantized checkpoint while loading; hayabusa reads INT8 W8A8 "
            "checkpoints in the compressed-tensors format (quant_method 'compressed-tensors', what llm-compressor "
            "writes), not ones whose config.json declares quant_method 'w8a8_int8'.",
            parameter="quantization", value=cls.name)

    @classmethod
    def online(cls) -> "W8A8Int8Config":
        return cls()

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        return Int8W8A8LinearMethod(checkpoint_int8=False)
