"""ParallelConfig: how many ranks, which backend; the checks that say "no" by name before any process starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hayabusa.errors import HayabusaValidationError

EXECUTOR_BACKENDS = ("mp", "ray")
# Architectures whose layers hayabusa/model/layers/tensor_parallel.py knows how to shard.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "GPT2LMHeadModel", "Gemma2ForCausalLM")


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks of one engine. ``world_size == 1`` runs in the engine process (no executor, no collectives).

    Attributes:
        tensor_parallel_size: ranks each layer is split over.
        pipeline_parallel_size: stages the layers are split into (1 today).
        backend: "mp" (spawned processes on this machine) or "ray".
        dist_backend: torch.distributed backend of the workers: "nccl" on CUDA, "gloo" on CPU.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    backend: str = "mp"
    dist_backend: str = "gloo"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _bad(name: str, value: Any, why: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"{name}={value!r}: {why}", parameter=name, value=value)


def check_parallel_args(tp: Any, pp: Any, backend: Any) -> None:
    """EngineArgs checks that need no model: positive ints, a known backend.

    Raises:
        HayabusaValidationError: naming the parameter.
    """
    for name, v in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(name, v, "must be a positive integer.")
    if pp != 1:
        raise _bad("pipeline_parallel_size", pp, "only 1 is supported in this version (tensor_parallel_size "
                   "splits a model over several GPUs).")
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise _bad("distributed_executor_backend", backend, f"must be one of {EXECUTOR_BACKENDS} or None.")


def make_parallel_config(args: Any, model_config: Any, device: torch.device) -> ParallelConfig:
    """The engine's ParallelConfig, after the checks that need the model: a supported architecture, heads and
    MLP width that split evenly, no quantization, enough GPUs.

    Raises:
        HayabusaValidationError: naming tensor_parallel_size (or quantization / device).
    """
    tp = args.tensor_parallel_size
    backend = args.distributed_executor_backend or "mp"
    cfg = ParallelConfig(tp, args.pipeline_parallel_size, backend, "nccl" if device.type == "cuda" else "gloo")
    if cfg.world_size == 1 and backend != "ray":
        return cfg
    check_tensor_parallel(model_config, tp)
    if device.type == "cuda" and backend == "mp" and torch.cuda.device_count() < cfg.world_size:
        raise _bad("tensor_parallel_size", tp, f"needs {cfg.world_size} GPUs; this machine has "
                   f"{torch.cuda.device_count()}.")
    return cfg


def tp_refusal(architecture: str, num_heads: int, num_kv_heads: int, intermediate: int, quantized: bool,
               tp: int) -> tuple[str, str] | None:
    """Why the engine refuses to split this model ``tp`` ways, as (parameter, reason); None when it can.
    The one rule for the engine (check_tensor_parallel) and for ``hayabusa plan``'s suggestion."""
    if tp == 1:
        return None
    if architecture not in TP_ARCHITECTURES:
        return "tensor_parallel_size", (f"{architecture} cannot be split over ranks yet; tensor parallelism "
                                        f"supports {', '.join(TP_ARCHITECTURES)}.")
    if quantized:
        return "quantization", "quantized linears are not sharded yet; use an unquantized checkpoint or " \
                               "tensor_parallel_size=1."
    if num_heads % tp:
        return "tensor_parallel_size", f"must divide the number of attention heads ({num_heads})."
    if num_kv_heads % tp and tp % num_kv_heads:
        return "tensor_parallel_size", (f"must divide the number of KV heads ({num_kv_heads}) or be a multiple of "
                                        "it (then KV heads are replicated).")
    if intermediate % tp:
        return "tensor_parallel_size", f"must divide the MLP width (intermediate_size={intermediate})."
    return None


def check_tensor_parallel(mc: Any, tp: int) -> None:
    """Refuse, by name, a model that cannot be split ``tp`` ways.

    Raises:
        HayabusaValidationError: naming tensor_parallel_size, or quantization for a quantized model.
    """
    hf = mc.hf_config
    inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * mc.hidden_size
    why = tp_refusal(mc.architecture, mc.num_heads, mc.num_kv_heads, inter, mc.quant_config is not None, tp)
    if why is None:
        return
    name, reason = why
    if name == "quantization":
        raise HayabusaValidationError(f"quantization={mc.quant_config.name!r} with tensor_parallel_size={tp}: "
                                      f"{reason}", parameter="quantization", value=mc.quant_config.name)
    raise _bad("tensor_parallel_size", tp, reason)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank holds: an even split, or 1 (replicated) when there are fewer KV heads than ranks."""
    return max(1, num_kv_heads // tp)
