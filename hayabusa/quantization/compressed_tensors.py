"""compressed-tensors checkpoints (llm-compressor / Neural Magic / Red Hat "FP8-dynamic", "FP8" exports): the FP8
W8A8 schemes, run by ``fp8.Fp8LinearMethod``.

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

``targets`` entries: "Linear" (every linear layer), a module name, or ``re:<regex>`` (matched with ``re.match``).
A layer matched by no group, or in ``ignore``, stays unquantized. Dynamic activations are quantized per token
(for "tensor" dynamic too: finer than the checkpoint asks, never coarser). Anything else (int8 / int4 schemes,
weight-only fp8, block or group strategies, sparsity, a non-fp8 ``kv_cache_scheme``) is refused by name. An fp8
``kv_cache_scheme`` is accepted: its k/v scales load into the Attention layers (used with kv_cache_dtype="fp8").
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.quantization.base import LinearMethod, QuantizationConfig, is_ignored, layer_names, name_matches
from hayabusa.quantization.fp8 import FP8_MIN_CAPABILITY, Fp8LinearMethod

SUPPORTED = ("FP8 W8A8 only: weights {num_bits: 8, type: float, strategy: channel | tensor, symmetric} with "
             "input_activations {num_bits: 8, type: float, dynamic: true (strategy token | tensor) or dynamic: "
             "false (strategy tensor, static input_scale)}, format float-quantized or naive-quantized")


def _refuse(what: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"compressed-tensors checkpoint: {what} is not supported; hayabusa runs "
                                   f"{SUPPORTED}.", parameter="quantization", value="compressed-tensors")


def _parse_scheme(name: str, group: dict[str, Any], fmt: str | None) -> tuple[str, bool]:
    """(weight strategy, static input) of one config group, or an error naming what is not supported."""
    fmt = group.get("format") or fmt
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"format {fmt!r} (group {name})")
    w = group.get("weights") or {}
    a = group.get("input_activations")
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise _refuse(f"weights of {w.get('num_bits')} bits of type {w.get('type')!r} (group {name})")
    if w.get("strategy") not in ("channel", "tensor") or w.get("dynamic") or not w.get("symmetric", True):
        raise _refuse(f"weight strategy {w.get('strategy')!r} (dynamic={w.get('dynamic')}, symmetric="
                      f"{w.get('symmetric', True)}) (group {name})")
    if not a:
        raise _refuse(f"weight-only fp8 (no input_activations) (group {name})")
    if a.get("num_bits") != 8 or a.get("type") != "float" or not a.get("symmetric", True):
        raise _refuse(f"input activations of {a.get('num_bits')} bits of type {a.get('type')!r} (group {name})")
    dynamic = bool(a.get("dynamic"))
    if (dynamic and a.get("strategy") not in ("token", "tensor")) or (not dynamic and a.get("strategy") != "tensor"):
        raise _refuse(f"input activation strategy {a.get('strategy')!r} with dynamic={dynamic} (group {name})")
    if group.get("output_activations"):
        raise _refuse(f"output_activations (group {name})")
    return w["strategy"], not dynamic


class CompressedTensorsConfig(QuantizationConfig):
    """vLLM's "compressed-tensors", FP8 W8A8 schemes (module docstring).

    Args:
        groups: [(targets, weight strategy "channel" | "tensor", static input scale)] in config order.
        ignore: module names / ``re:`` patterns left unquantized.
    """

    name = "compressed-tensors"
    cpu_supported = True
    min_capability = FP8_MIN_CAPABILITY
    capability_note = "(Ada, Hopper: FP8 tensor cores)"

    def __init__(self, groups: list[tuple[list[str], str, bool]], ignore: list[str]) -> None:
        self.groups = groups
        self.ignore = ignore

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
            strategy, static = _parse_scheme(name, group, qc.get("format"))
            parsed.append((list(group.get("targets") or []), strategy, static))
        return cls(parsed, list(qc.get("ignore") or []))

    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        if is_ignored(layer_prefix, layer, self.ignore):
            return None
        schemes = set()
        for n in layer_names(layer_prefix, layer):
            # a group naming the module (or a regex matching it) wins over one that targets every "Linear"
            by_name = [(s, st) for targets, s, st in self.groups if any(name_matches(n, t) for t in targets)]
            by_class = [(s, st) for targets, s, st in self.groups if "Linear" in targets]
            schemes.add((by_name or by_class or [None])[0])
        if len(schemes) > 1:
            raise HayabusaValidationError(
                f"compressed-tensors checkpoint: the shards of {layer_prefix} ({layer_names(layer_prefix, layer)}) "
                "fall in different quantization groups; hayabusa runs them as one merged matrix.",
                parameter="model", value=layer_prefix)
        hit = schemes.pop()
        if hit is None:
            return None
        return Fp8LinearMethod(checkpoint_fp8=True, weight_strategy=hit[0], static_input=hit[1])
