"""Shared by the AWQ and GPTQ loaders: unpacking int32 words of k-bit fields, and the W4A16 linear method their
layers end up as (``hayabusa/kernels/quant_linear.py``'s int4 layout, plus an optional input permutation).

After ``process_weights_after_loading`` such a layer holds
    qweight  [K // 8, N] int32   8 consecutive input rows per word, row 8i + j in bits 4j..4j+3 (GPTQ's layout)
    scales   [K // G, N]         model dtype
    zeros    [K // G, N]         model dtype, integers: 0..15 (AWQ, GPTQ v2) or 1..16 (GPTQ v1 stores zero - 1)
    perm     [K] int64 or None   GPTQ act-order: row i of qweight is input feature perm[i]; x's columns are gathered
                                 the same way before the matmul
so that y = x[:, perm] @ W' + bias with W'[i, n] = (q[i, n] - zeros[i // G, n]) * scales[i // G, n]. The matmul is
``int4_weight_only_linear``'s: the fused Triton kernel below ``DEQUANT_GEMM_MIN_M`` tokens, W' dequantized to the
model dtype + cuBLAS from there on (zeros 1..16 included: q - zero stays exact in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.base import LinearMethod


def quant_kernels():
    """``hayabusa.kernels.quant_linear``, imported on first use (so that naming a scheme does not load Triton), with
    ``kernels/wo_small_m.py``, which registers its batched-decode kernel with it."""
    from hayabusa.kernels import quant_linear, wo_small_m  # noqa: F401  (wo_small_m: its registration)

    return quant_linear


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split each int32 of ``packed`` into its 32 // bits unsigned fields, low bits first, along ``dim``.

    Args:
        packed: int32 tensor, any shape.
        bits: field width: 4 or 8.
        dim: the dimension the fields were packed along.
    Returns:
        int32 tensor, ``dim`` longer by f = 32 // bits: out[.., f * i + j, ..] = bits [j * bits, (j + 1) * bits)
        of packed[.., i, ..] as an unsigned value.
    """
    assert packed.dtype == torch.int32 and bits in (4, 8)
    f = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    p = packed.movedim(dim, -1)                                         # [..., M]
    fields = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)           # [..., M, f]; & drops the sign extension
    return fields.reshape(*p.shape[:-1], p.shape[-1] * f).movedim(-1, dim).contiguous()


def check_divisible(method: str, layer_prefix: str, what: str, value: int, by: int, why: str) -> None:
    """Raises HayabusaValidationError naming the layer when ``value`` is not a multiple of ``by``."""
    if value % by:
        raise HayabusaValidationError(
            f"{method}: {layer_prefix} has {what} = {value}, not a multiple of {by} ({why}); hayabusa cannot load "
            f"this layer in the {method} format. List it in the checkpoint's modules_to_not_convert if it is "
            "stored unquantized.", parameter="model", value=layer_prefix)


class PackedInt4LinearMethod(LinearMethod):
    """W4A16 through ``int4_weight_only_linear`` on the layout in the module docstring; subclasses create the
    checkpoint's parameters and convert them in ``process_weights_after_loading`` (``set_int4``)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size     # G, already resolved (-1 in a config means K)

    @staticmethod
    def set_int4(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None) -> None:
        """Store q [K, N] (values 0..15, any int dtype; rows in ``perm`` order), scales / zeros [K // G, N]."""
        from hayabusa.quantization.base import replace_param

        replace_param(layer, "qweight", quant_kernels().pack_int4(q))
        replace_param(layer, "scales", scales.to(layer.params_dtype).contiguous())
        replace_param(layer, "zeros", zeros.to(layer.params_dtype).contiguous())
        replace_param(layer, "perm", perm)

    def apply(self, layer, x):
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)
        y = quant_kernels().int4_weight_only_linear(x2, layer.qweight, layer.scales, layer.zeros, self.group_size,
                                               layer.bias)
        return y.reshape(*lead, layer.out_features)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K] float32 in the checkpoint's input order (what ``apply`` multiplies by): for tests and debugging."""
        w = quant_kernels().dequantize_int4(layer.qweight, layer.scales, layer.zeros, self.group_size)   # [N, K]
        if layer.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, layer.perm] = w
        return out
