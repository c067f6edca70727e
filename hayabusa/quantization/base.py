"""The quantization interface: a ``QuantizationConfig`` per scheme hands each ``Linear`` a ``LinearMethod``.

How a model gets quantized (model files never mention a scheme):
  1. ``build_model`` constructs the model inside ``set_quantization_config(cfg)``; every ``Linear`` built there
     defers creating its weights (it does not know its own module name yet).
  2. ``build_model`` walks ``model.named_modules()``: each ``Linear`` asks ``cfg.get_linear_method(name, layer)``
     (None = leave it unquantized; lm_head is never asked) and the method's ``create_weights`` registers the
     layer's parameters: what the checkpoint holds (fp8 ``weight`` + ``weight_scale``, packed int ``qweight``...)
     or, for online schemes, the high-precision ``weight``.
  3. ``load_weights`` fills them shard by shard through each parameter's ``weight_loader``.
  4. ``process_weights_after_loading`` turns them into what ``apply`` uses (online schemes quantize here and free
     the high-precision copy).
  5. ``Linear.forward(x)`` = ``layer.quant_method.apply(layer, x)``.

Parameter attributes read by ``Linear``'s shard loader (``hayabusa/model/layers/linear.py``) and by
``load_weights``:
  ``output_dim``     the dimension that holds output features (0 for a [N, K] weight, 1 for AWQ's [K, N/8]
                     ``qweight``); None = not split by shard: every shard's checkpoint tensor is the whole
                     parameter (e.g. GPTQ ``g_idx [K]``, identical for q/k/v).
  ``packed_factor``  output features per element along ``output_dim`` (8 for AWQ int4 packed in int32, else 1):
                     shard [start, end) of the outputs is elements [start / f, end / f).
  ``shard_indexed``  the parameter has one entry per shard ([num_shards]) and each shard's checkpoint tensor is a
                     scalar (per-tensor fp8 scales of merged q/k/v or gate/up).
  ``optional``       ``load_weights`` does not require it when the checkpoint has none of its tensors.
  ``weight_loader``  ``loader(param, tensor, shard_name | None)``; set by ``make_param`` to the layer's loader.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hayabusa.errors import HayabusaValidationError

_CURRENT: contextvars.ContextVar["QuantizationConfig | None"] = contextvars.ContextVar("hayabusa_quant_config",
                                                                                        default=None)


@contextlib.contextmanager
def set_quantization_config(cfg: "QuantizationConfig | None") -> Iterator[None]:
    """While active, ``Linear`` layers defer their weights to ``build_model`` (see the module docstring)."""
    token = _CURRENT.set(cfg)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_quantization_config() -> "QuantizationConfig | None":
    return _CURRENT.get()


def make_param(layer: nn.Module, name: str, data: torch.Tensor, output_dim: int | None = 0, packed_factor: int = 1,
               **attrs: Any) -> nn.Parameter:
    """Register ``data`` as parameter ``name`` of ``layer`` (no grad) with the loader attributes above; the
    ``weight_loader`` is ``layer.weight_loader`` (shard-aware, overridable e.g. by GPT-2's transposing Conv1D)."""
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim = output_dim  # type: ignore[attr-defined]
    p.packed_factor = packed_factor  # type: ignore[attr-defined]
    for k, v in attrs.items():
        setattr(p, k, v)
    p.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    layer.register_parameter(name, p)
    return p


def create_w8a8_checkpoint_params(layer: nn.Module, in_features: int, output_sizes: list[int], device: Any,
                                  weight_dtype: torch.dtype, weight_strategy: str, static_input: bool,
                                  zero_points: bool = False) -> None:
    """The parameters of a W8A8 checkpoint's Linear (FP8 or INT8, the same layout): ``weight`` [N, K] of
    ``weight_dtype``; ``weight_scale`` [N, 1] fp32 ("channel") or one fp32 per checkpoint shard ("tensor");
    ``input_scale`` one fp32 per shard when ``static_input``. ``zero_points``: also accept optional
    ``weight_zero_point`` / ``input_zero_point`` of the same shapes (int32; symmetric exports write zeros)."""
    N, S = sum(output_sizes), len(output_sizes)
    per_shard = dict(output_dim=None, shard_indexed=True)
    make_param(layer, "weight", torch.empty(N, in_features, dtype=weight_dtype, device=device))
    if weight_strategy == "channel":
        make_param(layer, "weight_scale", torch.empty(N, 1, dtype=torch.float32, device=device))
        if zero_points:
            make_param(layer, "weight_zero_point", torch.zeros(N, 1, dtype=torch.int32, device=device), optional=True)
    else:
        make_param(layer, "weight_scale", torch.empty(S, dtype=torch.float32, device=device), **per_shard)
        if zero_points:
            make_param(layer, "weight_zero_point", torch.zeros(S, dtype=torch.int32, device=device), optional=True,
                       **per_shard)
    if static_input:
        make_param(layer, "input_scale", torch.empty(S, dtype=torch.float32, device=device), **per_shard)
        if zero_points:
            make_param(layer, "input_zero_point", torch.zeros(S, dtype=torch.int32, device=device), optional=True,
                       **per_shard)


def per_channel_weight_scale(layer: nn.Module, weight_strategy: str) -> torch.Tensor:
    """A loaded W8A8 checkpoint's ``weight_scale`` as one fp32 per output channel [N]: "channel" as it is,
    "tensor" (one per shard) repeated over each shard's rows (exact, no requantization)."""
    if weight_strategy == "channel":
        return layer.weight_scale.data.float().reshape(-1)
    sizes = torch.tensor(layer.output_sizes, device=layer.weight_scale.device)
    return torch.repeat_interleave(layer.weight_scale.data.float(), sizes)


def replace_param(layer: nn.Module, name: str, data: torch.Tensor | None) -> None:
    """Swap parameter ``name`` for ``data`` (or remove it) after loading; the old storage is freed with it."""
    if name in layer._parameters:  # noqa: SLF001
        del layer._parameters[name]  # noqa: SLF001
    layer.__dict__.pop(name, None)   # a plain attribute left by an earlier replace_param(..., None)
    if data is None:
        setattr(layer, name, None)
    else:
        layer.register_parameter(name, nn.Parameter(data, requires_grad=False))


class class_or_instance_method:  # noqa: N801  (used like classmethod)
    """Like ``classmethod``, but bound to the instance when called on one (so instance attributes win)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __get__(self, obj: Any, owner: type) -> Any:
        return functools.partial(self.fn, owner if obj is None else obj)


class LinearMethod(ABC):
    """How one ``Linear`` stores and multiplies its weight. ``layer`` is the ``Linear``: it already has ``bias``
    ([N] in the model dtype, or None), ``in_features`` K, ``output_sizes`` (shards), ``out_features`` N."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int], dtype: torch.dtype,
                       device: torch.device | None) -> None:
        """Register the parameters the checkpoint (or, for online schemes, the high-precision weight) loads into.

        Args:
            layer: the Linear.
            in_features: K.
            output_sizes: output features of each shard (sum N).
            dtype: the model dtype (activations, bias, unquantized weights).
            device: where to allocate.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into what ``apply`` uses (quantize, repack, expand scales)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] (model dtype) -> y [T, N] (model dtype) = x W^T + bias. A method whose ``input_quant`` names
        a kind also takes a ``quantization/act_quant.QuantizedActivation`` ([T, K] quantized rows + scales) as x."""

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """An MLP's gate_up layer and its SiLU-and-mul in one step, [T, K] -> [T, N / 2], where the method has one
        (SmallMLinearMethod); None (the default): the MLP runs ``apply`` and the activation."""
        return None

    def input_quant(self, layer: nn.Module, M: int) -> str | None:
        """The per-token dynamic quantization ``apply`` would do to an x of M rows itself ("int8" or "fp8"), so
        that the kernel producing x may do it instead (``quantization/act_quant.py``); None (the default): x
        plain."""
        return None

    def prefers_quantized_input(self, layer: nn.Module, M: int, dtype: torch.dtype) -> bool:
        """Whether ``apply`` on M rows of ``dtype`` is faster with x quantized by its producer than plain, as
        measured (the CUDA default of ``quantization/act_quant.py``). False (the default): not measured to pay."""
        return False


class UnquantizedLinearMethod(LinearMethod):
    """Today's Linear: weight [N, K] in the model dtype, ``F.linear``."""

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        make_param(layer, "weight", torch.empty(sum(output_sizes), in_features, dtype=dtype, device=device))

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """Batch-invariant mode's Linear: the same weight, multiplied by ``kernels/batch_invariant.linear_bi`` (one K step
    and one split of K per weight shape, never per M; the launch's tiles per M), so a row's output does not depend on
    the other rows."""

    def apply(self, layer, x):
        from hayabusa.kernels.batch_invariant import linear_bi

        return linear_bi(x, layer.weight, layer.bias)

    def apply_silu_and_mul(self, layer, x):
        """On CUDA, an MLP's gate_up layer and its SiLU-and-mul in one launch (``bi_gemm.silu_and_mul_bi``: the
        two launches' bits) where it applies, else None (the caller runs ``apply`` and the activation; the CPU path
        is the mode's torch reference)."""
        if not x.is_cuda:
            return None
        from hayabusa.kernels.bi_gemm import silu_and_mul_bi

        return silu_and_mul_bi(x, layer.weight, layer.bias)


class SmallMLinearMethod(UnquantizedLinearMethod):
    """The small-M kernels' Linear (loader.use_small_m_linears): the same weight; 1-16 rows multiplied by
    ``kernels/small_m_linear.small_m_linear``, more by F.linear (``linear_small_m`` decides per call)."""

    def apply(self, layer, x):
        from hayabusa.kernels.small_m_linear import linear_small_m

        return linear_small_m(x, layer.weight, layer.bias)

    def apply_silu_and_mul(self, layer, x):
        """An MLP's gate_up layer and its SiLU-and-mul in one launch (``small_m_silu_linear``) where it applies,
        else None (the caller runs ``apply`` and the activation)."""
        from hayabusa.kernels.small_m_linear import silu_and_mul_small_m

        return silu_and_mul_small_m(x, layer.weight, layer.bias)


class QuantizationConfig(ABC):
    """One quantization scheme, as read from a checkpoint's ``quantization_config`` or asked for by name.

    Subclasses set ``name`` (vLLM's method name), ``cpu_supported`` and ``min_capability`` (lowest CUDA compute
    capability, None = no CUDA support), and implement ``from_hf_config`` / ``online`` / ``get_linear_method``.
    """

    name: str = ""
    cpu_supported: bool = True
    min_capability: tuple[int, int] | None = (7, 0)
    capability_note: str = ""   # e.g. "(Ada, Hopper)", printed after the required capability

    @classmethod
    @abstractmethod
    def from_hf_config(cls, qc: dict[str, Any]) -> "QuantizationConfig":
        """The scheme of a checkpoint whose config.json has ``"quantization_config": qc``.

        Raises:
            HayabusaValidationError: a variant of the scheme that hayabusa does not run (the message says which
                variants it does run).
        """

    @classmethod
    def online(cls) -> "QuantizationConfig":
        """``quantization=<name>`` on an unquantized checkpoint (quantize after loading).

        Raises:
            HayabusaValidationError: the scheme needs a checkpoint saved in its format.
        """
        raise HayabusaValidationError(
            f"quantization={cls.name!r} needs a checkpoint saved in that format (its config.json has a "
            f"quantization_config with quant_method {cls.name!r}); this checkpoint has none. To quantize an "
            "unquantized checkpoint while loading, use quantization='fp8', 'int8', 'int4' or 'w8a8_int8'.",
            parameter="quantization", value=cls.name)

    @abstractmethod
    def get_linear_method(self, layer_prefix: str, layer: nn.Module) -> LinearMethod | None:
        """The method for the Linear named ``layer_prefix`` (our module name; ``layer.checkpoint_prefixes`` holds
        the checkpoint's module name of each shard, e.g. q_proj/k_proj/v_proj for our qkv_proj). None = leave the
        layer unquantized (e.g. it is in the checkpoint's ignore list)."""

    def checkpoint_key(self, name: str) -> str:
        """The parameter name a checkpoint tensor loads into, where the scheme's tensor names cannot be parameter
        names as they are (bitsandbytes' ``weight.absmax``: a parameter name has no dots). Default: unchanged."""
        return name

    # ------------------------------------------------------------------ devices
    # Called on the class: what the scheme's least demanding variant needs (``methods_supported_on``); on an
    # instance: what this checkpoint's variant needs (``check_device``), where an instance sets its own
    # ``min_capability`` / ``capability_note`` (compressed-tensors: FP8 groups need 8.9, INT8 ones 8.0).
    @class_or_instance_method
    def supports(self_or_cls, device: torch.device) -> bool:
        if device.type == "cpu":
            return self_or_cls.cpu_supported
        if device.type == "cuda":
            cap = self_or_cls.min_capability
            return cap is not None and torch.cuda.get_device_capability(device) >= cap
        return False

    @class_or_instance_method
    def supported_devices(self_or_cls) -> str:
        """In words, e.g. "CPU, and CUDA GPUs with compute capability >= 8.9 (Ada, Hopper)"."""
        parts = ["CPU"] if self_or_cls.cpu_supported else []
        if self_or_cls.min_capability is not None:
            cap = ".".join(map(str, self_or_cls.min_capability))
            parts.append(f"CUDA GPUs with compute capability >= {cap} {self_or_cls.capability_note}".rstrip())
        return ", and ".join(parts) or "no device"

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


# ---------------------------------------------------------------------------------------------- layer names
def layer_names(layer_prefix: str, layer: nn.Module) -> list[str]:
    """The checkpoint module name of each shard of ``layer`` (set by ``build_model``), else [layer_prefix]."""
    return list(getattr(layer, "checkpoint_prefixes", None) or [layer_prefix])


def name_matches(name: str, pattern: str, substring: bool = False) -> bool:
    """compressed-tensors / vLLM matching: ``re:<regex>`` matches by ``re.match``; otherwise the module name
    equals the pattern, ends with ``.pattern`` (``"lm_head"``, ``"down_proj"``) or lies under it
    (``"model.layers.0"`` covers that layer's projections). With ``substring`` (AutoAWQ / GPTQ / bitsandbytes
    ``modules_to_not_convert``, as vLLM's ``is_layer_skipped_awq``), any substring of the name matches:
    ``"mlp"`` covers every MLP projection."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if substring:
        return pattern in name
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def is_ignored(layer_prefix: str, layer: nn.Module, patterns: list[str] | tuple[str, ...],
               substring: bool = False) -> bool:
    """Whether the checkpoint left this layer unquantized (``ignore`` / ``ignored_layers`` /
    ``modules_to_not_convert``). A merged layer whose shards disagree (q_proj ignored, k_proj not) cannot be one
    matrix.

    Raises:
        HayabusaValidationError: the shards of a merged layer disagree.
    """
    names = layer_names(layer_prefix, layer)
    hits = [any(name_matches(n, p, substring) for p in patterns) for n in names]
    if any(hits) and not all(hits):
        raise HayabusaValidationError(
            f"the checkpoint's quantization_config leaves {[n for n, h in zip(names, hits) if h]} unquantized but "
            f"not {[n for n, h in zip(names, hits) if not h]}; hayabusa runs them as one merged matrix "
            f"({layer_prefix}), which must be all quantized or all not.", parameter="model", value=layer_prefix)
    return bool(hits) and all(hits)
