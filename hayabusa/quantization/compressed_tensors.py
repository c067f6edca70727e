"""compressed-tensors checkpoints (llm-compressor / Neural Magic / Red Hat "FP8-dynamic", "FP8", "quantized.w8a8"
exports): the FP8 W8A8 schemes, run by ``fp8.Fp8LinearMethod``, and the INT8 W8A8 ones (SmoothQuant + GPTQ "W8A8"
recipes: the smoothing is already folded into the weights and norms), run by ``w8a8_int8.Int8W8A8LinearMethod``.

config.json (compressed-tensors' ``QuantizationConfig``, as vLLM reads it):
  {"quant_method": "compressed-tensors", "format": "float-quantized" | "naive-quantized",
   "config_groups": {"group_0": {"targets": ["Linear"],
       "weights": {"num_bits": 8, "type": "float", "strategy": "channel" | "tensor", "symmetric": true,
                   "dynamic": false},
       "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" | "tensor", "dynamic": bool},
       "output_activations": null}},
   "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": null}
Tensors per quantized layer: ``weight`` e4m3 [N, K]; ``weight_scale`` fp32/bf16 [N, 1] (channel) or one value
(tensor); ``input_scale`` one value when the activations are static.
INT8 W8A8 is the same with ``"format": "int-quantized"``, ``"type": "int"`` in weights and input_activations (both
symmetric), ``weight`` int8 [N, K]; some exports also write all-zero ``weight_zero_point`` / ``input_zero_point``
(accepted; a non-zero one is refused). Every group of one checkpoint may pick fp8 or int8 on its own.

``targets`` entries: "Linear" (every linear layer), a module name, or ``re:<regex>`` (matched with ``re.match``).
A layer matched by no group, or in ``ignore``, stays unquantized. Dynamic activations are quantized per token
(for "tensor" dynamic too: finer than the checkpoint asks, never coarser). Anything else (int4 schemes,
weight-only schemes, asymmetric (zero-point) activations or weights, block or group strategies, sparsity, a
non-fp8 ``kv_cache_scheme``) is refused by name. An fp8
``kv_cache_scheme`` is accepted: its k/v scales load into the Attention layers (used with kv_cache_dtype="fp8").
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.base import LinearMethod, QuantizationConfig, is_ignored, layer_names, name_matches
from hayabusa.quantization.fp8 import FP8_MIN_CAPABILITY, Fp8LinearMethod
from hayabusa.quantization.w8a8_int8 import (
    W8A8_INT8_CAPABILITY_NOTE,
    W8A8_INT8_MIN_CAPABILITY,
    Int8W8A8LinearMethod,
)

SUPPORTED = ("FP8 and INT8 W8A8 only: weights {num_bits: 8, type: float | int, strategy: channel | tensor, "
             "symmetric} with input_activations of the same type {num_bits: 8, symmetric, dynamic: true (strategy "
             "token | tensor) or dynamic: false (strategy tensor, static input_scale)}, format float-quantized | "
             "int-quantized (by type) or naive-quantized")
_FORMATS = {"float": ("float-quantized", "naive-quantized"), "int": ("int-quantized", "naive-quantized")}


def _refuse(what: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"compressed-tensors checkpoint: {what} is not supported; hayabusa runs "
                                   f"{SUPPORTED}.", parameter="quantization", value="compressed-tensors")


def _parse_scheme(name: str, group: dict[str, Any], fmt: str | None) -> tuple[str, str, bool]:
    """(type "float" | "int", weight strategy, static input) of one config group, or an error naming what is not
    supported."""
    fmt = group.get("format") or fmt
    w = group.get("weights") or {}
    a = group.get("input_activations")
    kind = w.get("type")
    if w.get("num_bits") != 8 or kind not in _FORMATS:
        raise _refuse(f"weights of {w.get('num_bits')} bits of type {kind!r} (group {name})")
    if fmt not in _FORMATS[kind]:
        raise _refuse(f"format {fmt!r} for {kind} weights (group {name})")
    if w.get("strategy") not in ("channel", "tensor") or w.get("dynamic") or not w.get("symmetric", True):
        raise _refuse(f"weight strategy {w.get('strategy')!r} (dynamic={w.get('dynamic')}, symmetric="
                      f"{w.get('symmetric', True)}) (group {name})")
    if not a:
        raise _refuse(f"weight-only {'fp8' if kind == 'float' else 'int8'} (no input_activations) (group {name})")
    if a.get("num_bits") != 8 or a.get("type") != kind:
        raise _refuse(f"input activations of {a.get('num_bits')} bits of type {a.get('type')!r} with {kind} "
                      f"weights (group {name})")
    if not a.get("symmetric", True):
        raise _refuse(f"asymmetric input activations (zero points, symmetric=false) (group {name})")
    dynamic = bool(a.get("dynamic"))
    if (dynamic and a.get("strategy") not in ("token", "tensor")) or (not dynamic and a.get("strategy") != "tensor"):
        raise _refuse(f"input activation strategy {a.get('strategy')!r} with dynamic={dynamic} (group {name})")
    if group.get("output_activations"):
        raise _refuse(f"output_activations (group {name})")
    return kind, w["strategy"], not dynamic


class CompressedTensorsConfig(QuantizationConfig):
    """vLLM's "compressed-tensors", FP8 and INT8 W8A8 schemes (module docstring).

    Args:
        groups: [(targets, type "float" | "int", weight strategy "channel" | "tensor", static input scale)] in
            config order.
        ignore: module names / ``re:`` patterns left unquantized.

    The class's device needs are its least demanding scheme's (INT8 W8A8: compute capability 8.0); an instance's
    are its checkpoint's (8.9 as soon as one group is FP8).
    """

    name = "compressed-tensors"
    cpu_supported = True
    min_capability = W8A8_INT8_MIN_CAPABILITY
    capability_note = "(INT8 W8A8 schemes: Ampere and newer; FP8 ones need 8.9: Ada, Hopper)"

    def __init__(self, groups: list[tuple[list[str], str, str, bool]], ignore: list[str]) -> None:
        self.groups = groups
        self.ignore = ignore
        if any(kind == "float" for _, kind, _, _ in groups):
            self.min_capability = FP8_MIN_CAPABILITY
            self.capability_note = "(Ada, Hopper: FP8 tensor cores)"
        else:
            self.min_capability = W8A8_INT8_MIN_CAPABILITY
            self.capability_note = W8A8_INT8_CAPABILITY_NOTE

    @classmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "CompressedTensorsConfig":
        kv = qc.get("kv_cache_scheme")
        if kv and not (kv.get("num_bits") == 8 and kv.get("type") == "float"):
            # an fp8 KV scheme only carries per-layer k/v scales: the loader puts them into the Attention layers,
            # and they are used when the engine runs with kv_cache_dtype="fp8" (vLLM's behaviour)
            raise _refuse(f"kv_cache_scheme {kv} (only an fp8 one: num_bits 8, type float)")
        if qc.get("sparsity_config"):
            raise _refuse("sparsity_config")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise _refuse("a quantization_config without config_groups")
        parsed = []
        for name, group in groups.items():
            kind, strategy, static = _parse_scheme(name, group, qc.get("format"))
            parsed.append((list(group.get("targets") or []), kind, strategy, static))
        return cls(parsed, list(qc.get("ignore") or []))

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        if is_ignored(layer_prefix, layer, self.ignore):
            return None
        schemes = set()
        for n in layer_names(layer_prefix, layer):
            # a group naming the module (or a regex matching it) wins over one that targets every "Linear"
            by_name = [g[1:] for g in self.groups if any(name_matches(n, t) for t in g[0])]
            by_class = [g[1:] for g in self.groups if "Linear" in g[0]]
            schemes.add((by_name or by_class or [None])[0])
        if len(schemes) > 1:
            raise HayabusaValidationError(
                f"compressed-tensors checkpoint: the shards of {layer_prefix} ({layer_names(layer_prefix, layer)}) "
                "fall in different quantization groups; hayabusa runs them as one merged matrix.",
                parameter="model", value=layer_prefix)
        hit = schemes.pop()
        if hit is None:
            return None
        kind, strategy, static = hit
        if kind == "int":
            return Int8W8A8LinearMethod(checkpoint_int8=True, weight_strategy=strategy, static_input=static)
        return Fp8LinearMethod(checkpoint_fp8=True, weight_strategy=strategy, static_input=static)
