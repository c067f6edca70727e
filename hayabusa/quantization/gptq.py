"""GPTQ checkpoints (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", arXiv:2210.17323) in AutoGPTQ / GPTQModel's packing, 4-bit run as W4A16 by
``hayabusa/kernels/quant_linear.py``, 8-bit through the int8 kernel or dequantized.

config.json (quantize_config of AutoGPTQ / GPTQModel, or transformers' GPTQConfig):
  {"quant_method": "gptq", "bits": 4 | 8, "group_size": 128 | -1, "desc_act": bool, "sym": bool,
   "checkpoint_format": "gptq" | "gptq_v2" (GPTQModel also writes it as "format"),
   "modules_in_block_to_quantize": [...], "modules_to_not_convert": [...], "lm_head": false}
Tensors per quantized Linear with K inputs, N outputs, G = group_size (-1 = one group of K), f = 32 / bits:
  qweight  int32 [K / f, N]   f consecutive input rows per word, row f * i + j in bits j*bits.. (low first):
                              for 4 bits exactly the int4 kernel's layout
  qzeros   int32 [K / G, N / f]  zero points packed along N the same way (low first). GPTQ v1 ("gptq", AutoGPTQ)
                              stores zero - 1: the effective zero is the stored value + 1 (so 1..16 for 4 bits;
                              symmetric checkpoints store 7 -> 8). v2 ("gptq_v2", GPTQModel) stores the zero itself.
  scales   fp16  [K / G, N]
  g_idx    int32 [K]          group of each input row (``i // G`` unless desc_act reordered them); optional
  W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

Act-order (desc_act): GPTQ quantized the input rows in a permuted order, so a group's rows are scattered over K and
g_idx says where. At load the rows are sorted by g_idx (stable): perm = argsort(g_idx), qweight's rows are
permuted with it and kept as ``perm``; each call gathers x's columns by ``perm`` (``index_select``) before the
kernel. Every product x[k] * W[k, n] is the checkpoint's own (no requantization, no regrouping), only the order of
the sum over k changes: exact up to float summation order. This needs every group to hold exactly G rows (true for
GPTQ's g_idx = perm_inverse // G); anything else is refused by name. The shards of a merged q/k/v or gate/up share
one input, so GPTQ gives them the same g_idx; the loader checks that they agree.

8 bits: one group (group_size -1) and symmetric zeros (all 128) run on the int8 kernel (q - 128 as int8, the
scale per output channel), exactly. Any other 8-bit checkpoint (groups, or asymmetric) is dequantized once at load
to the model dtype and runs as an unquantized layer: the checkpoint's numbers, but no memory saved (a log line
names such layers).

Refused by name: bits other than 4 and 8, other checkpoint formats (marlin, bitblas, ...), a quantized lm_head,
per-module ``dynamic`` overrides.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.base import LinearMethod, QuantizationConfig, is_ignored, make_param, replace_param
from hayabusa.quantization.packed import PackedInt4LinearMethod, check_divisible, quant_kernels, unpack_int32

logger = logging.getLogger(__name__)

SUPPORTED = ("GPTQ with bits 4 or 8, any group_size (-1 = one group), desc_act true or false, sym true or false, "
             "checkpoint_format gptq (v1) or gptq_v2")
_FORMATS = {"gptq": 1, "gptq_v1": 1, "gptq_v2": 2}


def _refuse(field: str, value: Any, extra: str = "") -> HayabusaValidationError:
    return HayabusaValidationError(f"GPTQ checkpoint with {field}={value!r} is not supported{extra}; hayabusa runs "
                                   f"{SUPPORTED}.", parameter="quantization", value=f"gptq {field}={value!r}")


# ---------------------------------------------------------------------------------------------- shared loading
def _create_gptq_params(layer: nn.Module, K: int, N: int, G: int, bits: int, dtype: torch.dtype,
                        device: torch.device | None) -> None:
    f = 32 // bits
    make_param(layer, "qweight", torch.empty(K // f, N, dtype=torch.int32, device=device), output_dim=1)
    make_param(layer, "qzeros", torch.empty(K // G, N // f, dtype=torch.int32, device=device), output_dim=1,
               packed_factor=f)
    make_param(layer, "scales", torch.empty(K // G, N, dtype=dtype, device=device), output_dim=1)
    # one row per shard (-1 = not in the checkpoint): shards must agree, which the shared-tensor loader cannot check
    p = make_param(layer, "g_idx", torch.full((len(layer.output_sizes), K), -1, dtype=torch.int32, device=device),
                   output_dim=None, optional=True)

    def load_g_idx(param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        if loaded.shape != (K,):
            raise ValueError(f"shape mismatch: checkpoint g_idx {tuple(loaded.shape)} vs ({K},) (shard {shard!r})")
        param.data[layer.shard_names.index(shard) if shard is not None else 0] = loaded

    p.weight_loader = load_g_idx  # type: ignore[attr-defined]


def _name(layer: nn.Module) -> str:
    return (getattr(layer, "checkpoint_prefixes", None) or ["this layer"])[0]


def _group_index(layer: nn.Module, K: int, G: int) -> torch.Tensor:
    """g_idx [K] int64 of the layer: the checkpoint's (all shards equal) or i // G when it has none.

    Raises:
        HayabusaValidationError: shards disagree, or an entry is outside 0..K/G - 1.
    """
    rows = [r for r in layer.g_idx.data.long() if not bool((r == -1).all())]
    default = torch.arange(K, device=layer.g_idx.device) // G
    if not rows:
        return default
    for r in rows[1:]:
        if not torch.equal(r, rows[0]):
            raise HayabusaValidationError(
                f"gptq: the shards of {_name(layer)} (merged layer) have different g_idx (act-order permutations); "
                "hayabusa runs them as one merged matrix, which needs one input order.", parameter="model",
                value=_name(layer))
    g = rows[0]
    if int(g.min()) < 0 or int(g.max()) >= K // G:
        raise HayabusaValidationError(f"gptq: {_name(layer)}.g_idx has groups outside 0..{K // G - 1}",
                                      parameter="model", value=_name(layer))
    return g


def _unpack(layer: nn.Module, bits: int, zero_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [K, N] int32, zeros [K / G, N] int32 effective zero points) from qweight / qzeros."""
    q = unpack_int32(layer.qweight.data, bits, dim=0)
    zeros = unpack_int32(layer.qzeros.data, bits, dim=1) + zero_offset
    return q, zeros


# ---------------------------------------------------------------------------------------------- 4 bits
class Gptq4LinearMethod(PackedInt4LinearMethod):
    """4-bit GPTQ Linear -> the int4 kernel (module docstring); rows sorted by g_idx when it is not i // G."""

    def __init__(self, group_size: int, zero_offset: int) -> None:
        super().__init__(group_size)
        self.zero_offset = zero_offset

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        _create_gptq_params(layer, in_features, sum(output_sizes), self.group_size, 4, dtype, device)

    def process_weights_after_loading(self, layer):
        K, G = layer.in_features, self.group_size
        q, zeros = _unpack(layer, 4, self.zero_offset)
        g = _group_index(layer, K, G)
        perm = None
        if not torch.equal(g, torch.arange(K, device=g.device) // G):
            counts = torch.bincount(g, minlength=K // G)
            if not bool((counts == G).all()):
                raise HayabusaValidationError(
                    f"gptq: {_name(layer)}.g_idx puts {counts.tolist()} rows in its groups; hayabusa "
                    f"needs exactly group_size={G} rows per group.", parameter="model",
                    value=_name(layer))
            perm = torch.argsort(g, stable=True)
            q = q.index_select(0, perm)
        scales = layer.scales.data
        for name in ("qzeros", "g_idx"):
            replace_param(layer, name, None)
        self.set_int4(layer, q, scales, zeros, perm)


# ---------------------------------------------------------------------------------------------- 8 bits
class Gptq8LinearMethod(LinearMethod):
    """8-bit GPTQ Linear: ``qweight [N, K] int8`` + ``scales [N]`` on the int8 kernel when it has one group and all
    zero points are 128, else ``weight [N, K]`` dequantized in the model dtype (module docstring)."""

    def __init__(self, group_size: int, zero_offset: int) -> None:
        self.group_size = group_size
        self.zero_offset = zero_offset

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        _create_gptq_params(layer, in_features, sum(output_sizes), self.group_size, 8, dtype, device)

    def process_weights_after_loading(self, layer):
        K, G = layer.in_features, self.group_size
        q, zeros = _unpack(layer, 8, self.zero_offset)          # [K, N] 0..255, [K / G, N]
        scales = layer.scales.data
        g = _group_index(layer, K, G)
        for name in ("qzeros", "g_idx"):
            replace_param(layer, name, None)
        if K // G == 1 and bool((zeros == 128).all()):
            replace_param(layer, "qweight", (q - 128).to(torch.int8).t().contiguous())
            replace_param(layer, "scales", scales[0].to(layer.params_dtype).contiguous())
            return
        for name in ("qweight", "scales"):
            replace_param(layer, name, None)
        logger.info("gptq: %s is 8-bit with %s: dequantized to %s at load (no memory saved)",
                    _name(layer), f"{K // G} groups" if K // G > 1 else "asymmetric zeros",
                    layer.params_dtype)
        w = (q.float() - zeros.float()[g]) * scales.float()[g]   # [K, N]
        replace_param(layer, "weight", w.t().to(layer.params_dtype).contiguous())

    def apply(self, layer, x):
        if getattr(layer, "weight", None) is not None:
            return F.linear(x, layer.weight, layer.bias)
        lead, K = x.shape[:-1], x.shape[-1]
        y = quant_kernels().int8_weight_only_linear(x.reshape(-1, K), layer.qweight, layer.scales, layer.bias)
        return y.reshape(*lead, layer.out_features)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K] float32 (what ``apply`` multiplies by)."""
        if getattr(layer, "weight", None) is not None:
            return layer.weight.float()
        return quant_kernels().dequantize_int8(layer.qweight, layer.scales)


# ---------------------------------------------------------------------------------------------- config
class GptqConfig(QuantizationConfig):
    """vLLM's "gptq": a checkpoint whose config.json has ``{"quant_method": "gptq", ...}`` (module docstring).

    Args:
        bits: 4 or 8.
        group_size: G; -1 = all of K.
        zero_offset: 1 for v1 checkpoints (stored zero + 1), 0 for gptq_v2.
        modules_in_block_to_quantize: if given, only layers matching one of these names are quantized.
        modules_to_not_convert: layers stored unquantized.
    """

    name = "gptq"
    cpu_supported = True
    min_capability = (7, 0)   # the Triton kernels
    capability_note = "(Volta and newer; Triton kernels)"

    def __init__(self, bits: int, group_size: int, zero_offset: int = 1,
                 modules_in_block_to_quantize: list[str] | None = None,
                 modules_to_not_convert: list[str] | tuple[str, ...] = ()) -> None:
        self.bits = bits
        self.group_size = group_size
        self.zero_offset = zero_offset
        self.modules_in_block_to_quantize = modules_in_block_to_quantize
        self.modules_to_not_convert = list(modules_to_not_convert)

    @classmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "GptqConfig":
        bits, group_size = qc.get("bits"), qc.get("group_size", -1)
        if bits not in (4, 8):
            raise _refuse("bits", bits)
        if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise _refuse("group_size", group_size, " (a positive integer or -1)")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in _FORMATS:
            raise _refuse("checkpoint_format", fmt)
        if qc.get("lm_head"):
            raise _refuse("lm_head", qc["lm_head"], " (hayabusa keeps lm_head unquantized)")
        if qc.get("dynamic"):
            raise _refuse("dynamic", "...", " (per-module overrides)")
        blocks = qc.get("modules_in_block_to_quantize")
        if blocks is not None:   # a list of names, or (GPTQModel / transformers) a list of lists of names
            blocks = [n for b in blocks for n in ([b] if isinstance(b, str) else b)]
        return cls(bits, group_size, 1 if _FORMATS[fmt] == 1 else 0, blocks, qc.get("modules_to_not_convert") or ())

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        if is_ignored(layer_prefix, layer, self.modules_to_not_convert, substring=True):
            return None
        # all shards listed = quantized; none = stored unquantized; some = an error (is_ignored names them)
        if self.modules_in_block_to_quantize is not None and \
                not is_ignored(layer_prefix, layer, self.modules_in_block_to_quantize):
            return None
        K, f = layer.in_features, 32 // self.bits
        G = K if self.group_size == -1 else self.group_size
        check_divisible("gptq", layer_prefix, "in_features", K, G, f"group_size {G}")
        check_divisible("gptq", layer_prefix, "in_features", K, f, f"{f} rows per int32")
        for size in layer.output_sizes:
            check_divisible("gptq", layer_prefix, "out_features of a shard", size, f, f"{f} zero points per int32")
        if self.bits == 8:
            return Gptq8LinearMethod(G, self.zero_offset)
        check_divisible("gptq", layer_prefix, "group_size", G, 8, "the int4 kernel's groups are whole int32 rows")
        return Gptq4LinearMethod(G, self.zero_offset)
