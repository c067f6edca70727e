"""bitsandbytes checkpoints (transformers ``BitsAndBytesConfig`` exports, ``save_pretrained`` of a model loaded with
``load_in_8bit`` / ``load_in_4bit``): 8-bit LLM.int8() weights (Dettmers et al., arXiv:2208.07339) and 4-bit NF4 /
FP4 weights (QLoRA, Dettmers et al., arXiv:2305.14314).

config.json:
  {"quant_method": "bitsandbytes", "load_in_8bit": bool, "load_in_4bit": bool, "llm_int8_skip_modules": [...],
   "bnb_4bit_quant_type": "nf4" | "fp4", "bnb_4bit_use_double_quant": bool, "bnb_4bit_quant_storage": "uint8"}

8-bit (no bitsandbytes needed): tensors per Linear [N, K]
  weight         int8 [N, K]    row-major ("row" format)
  SCB            fp32 [N]       absmax of each output row
  weight_format  uint8 scalar   0 = row (older col32 / col_turing / col_ampere layouts are refused)
  W[n, k] = weight[n, k] * SCB[n] / 127
runs on hayabusa's W8A16 int8 kernel with scales = SCB / 127 in the model dtype. Activations stay in the model
dtype: bitsandbytes' own LLM.int8() matmul also quantizes activations to int8 (outlier columns above
``llm_int8_threshold`` excepted), so hayabusa computes the dequantized weights' product more exactly than
bitsandbytes would, not bit for bit like it.

4-bit (needs ``pip install bitsandbytes``; run through its ``matmul_4bit``, as vLLM does): tensors per Linear
  weight                                  uint8 [N * K / 2, 1]   two codes per byte, the first in the high nibble,
                                                                 over W [N, K] flattened row-major
  weight.absmax                           fp32 [N * K / blocksize], or uint8 with double quantization
  weight.quant_map                        fp32 [16]              the code table (NF4 or FP4)
  weight.nested_absmax, .nested_quant_map fp32                   double quantization of absmax (blocks of 256)
  weight.quant_state.bitsandbytes__nf4    uint8                  JSON: quant_type, blocksize, dtype, shape, ...
  W.flat[i] = quant_map[code[i]] * absmax[i // blocksize]
The dotted names become ``weight_absmax``, ... (``checkpoint_key``). Each shard of a merged q/k/v or gate/up has
its own quantization state, so such a layer runs one ``matmul_4bit`` per shard.

Refused by name: neither load_in_8bit nor load_in_4bit, a quant type other than nf4 / fp4, a quant storage other
than uint8, ``llm_int8_has_fp16_weight``, and 4-bit without bitsandbytes installed.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.base import LinearMethod, QuantizationConfig, is_ignored, make_param, replace_param
from hayabusa.quantization.packed import quant_kernels

# checkpoint suffix -> our parameter name (nn.Module parameter names cannot contain dots)
_PIECES = {"absmax": "weight_absmax", "quant_map": "weight_quant_map", "nested_absmax": "weight_nested_absmax",
           "nested_quant_map": "weight_nested_quant_map", "quant_state": "weight_quant_state"}


def _refuse(field: str, value: Any, extra: str = "") -> HayabusaValidationError:
    return HayabusaValidationError(
        f"bitsandbytes checkpoint with {field}={value!r} is not supported{extra}; hayabusa runs bitsandbytes "
        "load_in_8bit checkpoints (row format) and load_in_4bit checkpoints (nf4 / fp4, with or without double "
        "quantization, uint8 storage; these need the bitsandbytes package).", parameter="quantization",
        value=f"bitsandbytes {field}={value!r}")


def import_bitsandbytes():
    """The bitsandbytes module. Raises HayabusaValidationError saying how to install it."""
    try:
        import bitsandbytes
    except Exception as e:   # ImportError, or a broken native library
        raise HayabusaValidationError(
            f"this checkpoint is quantized with bitsandbytes 4-bit, which runs through the bitsandbytes package; "
            f"it could not be imported ({type(e).__name__}: {e}). Install it: pip install bitsandbytes",
            parameter="quantization", value="bitsandbytes") from None
    return bitsandbytes


# ---------------------------------------------------------------------------------------------- 8 bits
class Bnb8bitLinearMethod(LinearMethod):
    """LLM.int8() checkpoint weights on the int8 kernel (module docstring): after loading ``qweight [N, K] int8``
    and ``scales [N]`` (model dtype) = SCB / 127."""

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        N = sum(output_sizes)
        make_param(layer, "weight", torch.empty(N, in_features, dtype=torch.int8, device=device))
        make_param(layer, "SCB", torch.empty(N, dtype=torch.float32, device=device))
        make_param(layer, "weight_format", torch.zeros(len(output_sizes), dtype=torch.uint8, device=device),
                   output_dim=None, shard_indexed=True, optional=True)

    def process_weights_after_loading(self, layer):
        fmt = layer.weight_format.data
        if bool((fmt != 0).any()):
            names = {1: "col32", 2: "col_turing", 3: "col_ampere"}
            raise _refuse("weight_format", names.get(int(fmt.max()), int(fmt.max())), " (only the row format)")
        q, scb = layer.weight.data, layer.SCB.data
        for name in ("weight", "SCB", "weight_format"):
            replace_param(layer, name, None)
        replace_param(layer, "qweight", q.contiguous())
        replace_param(layer, "scales", (scb.float() / 127.0).to(layer.params_dtype))

    def apply(self, layer, x):
        lead, K = x.shape[:-1], x.shape[-1]
        y = quant_kernels().int8_weight_only_linear(x.reshape(-1, K), layer.qweight, layer.scales, layer.bias)
        return y.reshape(*lead, layer.out_features)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K] float32 (what ``apply`` multiplies by)."""
        return quant_kernels().dequantize_int8(layer.qweight, layer.scales)


# ---------------------------------------------------------------------------------------------- 4 bits
class Bnb4bitLinearMethod(LinearMethod):
    """NF4 / FP4 checkpoint weights through bitsandbytes (module docstring). After loading the layer holds
    ``weight`` uint8 [N * K / 2, 1] and, per shard, a bitsandbytes ``QuantState`` (``bnb_states``) and the shard's
    byte range of ``weight`` (``bnb_ranges``)."""

    def __init__(self, double_quant: bool) -> None:
        self.double_quant = double_quant

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        K, N = in_features, sum(output_sizes)
        w = make_param(layer, "weight", torch.empty(N * K // 2, 1, dtype=torch.uint8, device=device))
        w.weight_loader = lambda p, t, shard=None: self._load_bytes(layer, p, t, shard)  # type: ignore[attr-defined]
        layer.bnb_pieces = [{} for _ in output_sizes]     # shard -> piece -> checkpoint tensor, until processed
        dtypes = {"weight_absmax": torch.uint8 if self.double_quant else torch.float32,
                  "weight_quant_map": torch.float32, "weight_quant_state": torch.uint8,
                  "weight_nested_absmax": torch.float32, "weight_nested_quant_map": torch.float32}
        for name, dt in dtypes.items():
            p = make_param(layer, name, torch.empty(0, dtype=dt, device=device), output_dim=None,
                           optional=name.startswith("weight_nested"))
            p.weight_loader = lambda p, t, shard=None, n=name: self._stash(layer, n, t, shard)  # type: ignore

    @staticmethod
    def _shard_index(layer: nn.Module, shard: str | None) -> int:
        return layer.shard_names.index(shard) if shard is not None else 0

    def _load_bytes(self, layer, param, loaded, shard):
        start, end = layer.shard_range(shard)
        K = layer.in_features
        target = param.data[start * K // 2: end * K // 2]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs 4-bit bytes {tuple(target.shape)} "
                             f"(shard {shard!r})")
        target.copy_(loaded)

    def _stash(self, layer, name, loaded, shard):
        layer.bnb_pieces[self._shard_index(layer, shard)][name] = loaded

    def process_weights_after_loading(self, layer):
        from bitsandbytes.functional import QuantState

        K, states, ranges = layer.in_features, [], []
        start = 0
        for pieces, n in zip(layer.bnb_pieces, layer.output_sizes):
            meta = json.loads(bytes(pieces["weight_quant_state"].cpu().tolist()).decode("utf-8"))
            if list(meta.get("shape") or []) != [n, K]:
                name = (getattr(layer, "checkpoint_prefixes", None) or ["this layer"])[0]
                raise HayabusaValidationError(
                    f"bitsandbytes: {name} 4-bit quant_state has shape {meta.get('shape')}, the model expects "
                    f"[{n}, {K}] for this shard.", parameter="model", value=name)
            qs = {k.replace("weight_", "", 1): v for k, v in pieces.items() if k != "weight_quant_state"}
            qs[f"quant_state.bitsandbytes__{meta['quant_type']}"] = pieces["weight_quant_state"]
            states.append(QuantState.from_dict(qs, device=layer.weight.device))
            ranges.append((start * K // 2, (start + n) * K // 2))
            start += n
        for name in _PIECES.values():
            replace_param(layer, name, None)
        del layer.bnb_pieces
        layer.bnb_states, layer.bnb_ranges = states, ranges

    def apply(self, layer, x):
        import bitsandbytes as bnb

        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        ys = [bnb.matmul_4bit(x2, layer.weight[a:b].t(), st) for (a, b), st in zip(layer.bnb_ranges,
                                                                                  layer.bnb_states)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*lead, layer.out_features)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K] float32, by bitsandbytes' ``dequantize_4bit`` of each shard."""
        from bitsandbytes.functional import dequantize_4bit

        return torch.cat([dequantize_4bit(layer.weight[a:b], st).float()
                          for (a, b), st in zip(layer.bnb_ranges, layer.bnb_states)], dim=0)


# ---------------------------------------------------------------------------------------------- config
class BitsAndBytesConfig(QuantizationConfig):
    """vLLM's "bitsandbytes": a checkpoint saved with bitsandbytes 8-bit or 4-bit weights (module docstring).

    Args:
        load_in_4bit: 4-bit (NF4 / FP4) weights, else 8-bit.
        double_quant: 4-bit absmax values are themselves quantized (``bnb_4bit_use_double_quant``).
        skip_modules: checkpoint module names stored unquantized (``llm_int8_skip_modules``).
    """

    name = "bitsandbytes"
    cpu_supported = True
    min_capability = (7, 0)
    capability_note = "(8-bit: the Triton int8 kernel; 4-bit: bitsandbytes' kernels)"

    def __init__(self, load_in_4bit: bool, double_quant: bool = False,
                 skip_modules: list[str] | tuple[str, ...] = ()) -> None:
        self.load_in_4bit = load_in_4bit
        self.double_quant = double_quant
        self.skip_modules = list(skip_modules)

    @classmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "BitsAndBytesConfig":
        four = bool(qc.get("load_in_4bit", qc.get("_load_in_4bit", False)))
        eight = bool(qc.get("load_in_8bit", qc.get("_load_in_8bit", False)))
        if four == eight:
            raise _refuse("load_in_4bit / load_in_8bit", (four, eight), " (exactly one must be true)")
        if qc.get("llm_int8_has_fp16_weight"):
            raise _refuse("llm_int8_has_fp16_weight", True)
        if four:
            quant_type = qc.get("bnb_4bit_quant_type", "fp4")
            if quant_type not in ("nf4", "fp4"):
                raise _refuse("bnb_4bit_quant_type", quant_type)
            storage = str(qc.get("bnb_4bit_quant_storage") or "uint8").replace("torch.", "")
            if storage != "uint8":
                raise _refuse("bnb_4bit_quant_storage", storage)
            import_bitsandbytes()
        return cls(four, bool(qc.get("bnb_4bit_use_double_quant", False)), qc.get("llm_int8_skip_modules") or ())

    def checkpoint_key(self, name: str) -> str:
        """``...proj.weight.absmax`` -> ``...proj.weight_absmax``; ``...weight.quant_state.bitsandbytes__nf4`` ->
        ``...weight_quant_state`` (the quant type is inside that tensor's JSON)."""
        head, sep, tail = name.rpartition(".weight.")
        if not sep:
            return name
        piece = "quant_state" if tail.startswith("quant_state.") else tail
        return f"{head}.{_PIECES[piece]}" if piece in _PIECES else name

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        if is_ignored(layer_prefix, layer, self.skip_modules, substring=True):
            return None
        if not self.load_in_4bit:
            return Bnb8bitLinearMethod()
        if layer.in_features % 2:
            raise HayabusaValidationError(f"bitsandbytes 4-bit: {layer_prefix} has an odd in_features "
                                          f"({layer.in_features}); hayabusa needs whole bytes per row.",
                                          parameter="model", value=layer_prefix)
        return Bnb4bitLinearMethod(self.double_quant)
