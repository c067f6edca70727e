"""AWQ 4-bit checkpoints (Lin et al., "AWQ: Activation-aware Weight Quantization", arXiv:2306.00978), in AutoAWQ's
GEMM packing, run as W4A16 by ``hayabusa/kernels/quant_linear.py``.

config.json (AutoAWQ's quant_config, or transformers' AwqConfig):
  {"quant_method": "awq", "bits": 4 (or "w_bit"), "group_size": 128 (or "q_group_size"), "zero_point": true,
   "version": "gemm", "modules_to_not_convert": [...] | null}
Tensors per quantized Linear with K inputs and N outputs, G = group_size (-1 = one group of K):
  qweight  int32 [K, N / 8]      8 output columns per word in AutoAWQ's interleaved order: bits 4i..4i+3 of word
                                 c hold column 8c + AWQ_PACK_ORDER[i] (AWQ_PACK_ORDER = 0, 2, 4, 6, 1, 3, 5, 7)
  qzeros   int32 [K / G, N / 8]  the zero points, packed the same way
  scales   fp16  [K / G, N]
  W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]   (unsigned q, z in 0..15; the same formula as hayabusa's int4)

Shards of a merged q/k/v or gate/up concatenate along N (N / 8 words for qweight and qzeros). At load the layer is
repacked once into the int4 kernel's layout (``packed.PackedInt4LinearMethod``): qweight [K / 8, N] packed along
K, zeros unpacked to the model dtype; the numbers are unchanged, so the kernel computes exactly the checkpoint's W.

Supported: bits 4, zero_point true, version gemm (AutoAWQ's default). Refused by name: other bit widths, symmetric
(zero_point false), the GEMV / exllama / marlin / ipex packings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.base import LinearMethod, QuantizationConfig, is_ignored, make_param
from hayabusa.quantization.packed import PackedInt4LinearMethod, check_divisible, unpack_int32

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble i of a word holds column AWQ_PACK_ORDER[i] of its 8
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)    # column j is nibble AWQ_UNPACK_ORDER[j] (the inverse permutation)
SUPPORTED = "AWQ with bits 4, zero_point true and version gemm"


def _first(qc: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for k in keys:
        if qc.get(k) is not None:
            return qc[k]
    return default


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ-packed int32 [R, C / 8] -> int32 [R, C] values 0..15 in column order."""
    nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)        # [R, C / 8, 8], nibble order
    order = torch.tensor(AWQ_UNPACK_ORDER, device=packed.device)
    return nibbles.index_select(2, order).reshape(packed.shape[0], -1)


class AwqLinearMethod(PackedInt4LinearMethod):
    """One AWQ Linear (module docstring): creates qweight / qzeros / scales, repacks them after loading."""

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        K, N, G = in_features, sum(output_sizes), self.group_size
        make_param(layer, "qweight", torch.empty(K, N // 8, dtype=torch.int32, device=device), output_dim=1,
                   packed_factor=8)
        make_param(layer, "qzeros", torch.empty(K // G, N // 8, dtype=torch.int32, device=device), output_dim=1,
                   packed_factor=8)
        make_param(layer, "scales", torch.empty(K // G, N, dtype=dtype, device=device), output_dim=1)

    def process_weights_after_loading(self, layer):
        from hayabusa.quantization.base import replace_param

        q = unpack_awq(layer.qweight.data)                    # [K, N]
        zeros = unpack_awq(layer.qzeros.data)                 # [K / G, N]
        scales = layer.scales.data
        replace_param(layer, "qzeros", None)
        self.set_int4(layer, q, scales, zeros, None)


class AwqConfig(QuantizationConfig):
    """vLLM's "awq": a checkpoint whose config.json has ``{"quant_method": "awq", ...}`` (module docstring).

    Args:
        group_size: G, input features per scale and zero point; -1 = all of K.
        modules_to_not_convert: checkpoint module names (or ``re:`` patterns) stored unquantized.
    """

    name = "awq"
    cpu_supported = True
    min_capability = (7, 0)   # the Triton int4 kernel
    capability_note = "(Volta and newer; Triton kernels)"

    def __init__(self, group_size: int, modules_to_not_convert: list[str] | tuple[str, ...] = ()) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert)

    @classmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "AwqConfig":
        bits = _first(qc, ("bits", "w_bit"))
        group_size = _first(qc, ("group_size", "q_group_size"), 128)
        zero_point = _first(qc, ("zero_point",), True)
        version = str(_first(qc, ("version", "format"), "gemm")).lower()
        for field, value, ok in (("bits", bits, bits == 4), ("zero_point", zero_point, zero_point is True),
                                 ("version", version, version == "gemm")):
            if not ok:
                raise HayabusaValidationError(
                    f"AWQ checkpoint with {field}={value!r} is not supported; hayabusa runs {SUPPORTED}.",
                    parameter="quantization", value=f"awq {field}={value!r}")
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise HayabusaValidationError(f"AWQ group_size must be a positive integer or -1, got {group_size!r}.",
                                          parameter="quantization", value=f"awq group_size={group_size!r}")
        return cls(group_size, qc.get("modules_to_not_convert") or ())

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        if is_ignored(layer_prefix, layer, self.modules_to_not_convert, substring=True):
            return None
        K = layer.in_features
        G = K if self.group_size == -1 else self.group_size
        check_divisible("awq", layer_prefix, "in_features", K, G, f"group_size {G}")
        check_divisible("awq", layer_prefix, "in_features", K, 8, "8 rows per int32 in the int4 kernel")
        check_divisible("awq", layer_prefix, "group_size", G, 8, "the int4 kernel's groups are whole int32 rows")
        for size in layer.output_sizes:
            check_divisible("awq", layer_prefix, "out_features of a shard", size, 8, "8 columns per int32")
        return AwqLinearMethod(G)
