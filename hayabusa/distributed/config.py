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
        tensor_parallel_size: ranks each layer is split over (inside each stage).
        pipeline_parallel_size: stages the decoder layers are split into (``get_pp_indices``); stage 0 holds the
            embedding, the last stage the final norm, lm_head and sampler.
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

    @property
    def driver_rank(self) -> int:
        """The global rank that returns the sampled tokens: the last stage's tp rank 0 (tp inner, pp outer)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The decoder layers [start, end) of stage ``pp_rank``: vLLM's rule (``vllm.distributed.utils``), an even
    split whose remainder goes one layer each to the stages before the last, from the second-to-last backwards
    (the last stage also runs the final norm, lm_head and sampler; 7 layers over 3 stages: 2, 3, 2)."""
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


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
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise _bad("distributed_executor_backend", backend, f"must be one of {EXECUTOR_BACKENDS} or None.")


def make_parallel_config(args: Any, model_config: Any, device: torch.device) -> ParallelConfig:
    """The engine's ParallelConfig, after the checks that need the model: a supported architecture, heads and
    MLP width that split evenly, no quantization, enough GPUs; with pipeline_parallel_size > 1 also a stage per
    layer at most and none of the features stages do not run (``check_pipeline_parallel``).

    Raises:
        HayabusaValidationError: naming tensor_parallel_size or pipeline_parallel_size (or quantization / device).
    """
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    backend = args.distributed_executor_backend or "mp"
    cfg = ParallelConfig(tp, pp, backend, "nccl" if device.type == "cuda" else "gloo")
    if cfg.world_size == 1 and backend != "ray":
        return cfg
    check_tensor_parallel(model_config, tp)
    if pp > 1:
        check_pipeline_parallel(args, model_config, pp, backend)
    if device.type == "cuda" and backend == "mp" and torch.cuda.device_count() < cfg.world_size:
        name, value = ("pipeline_parallel_size", pp) if pp > 1 else ("tensor_parallel_size", tp)
        raise _bad(name, value, f"needs {cfg.world_size} GPUs (tensor_parallel_size x pipeline_parallel_size); "
                   f"this machine has {torch.cuda.device_count()}.")
    return cfg


def pp_refusal(architecture: str, num_layers: int, pp: int) -> str | None:
    """Why the engine refuses to split this model into ``pp`` stages (the model's part of the rule), None when it
    can. The one rule for the engine (check_pipeline_parallel) and for ``hayabusa plan``."""
    if pp == 1:
        return None
    if architecture not in TP_ARCHITECTURES:
        return (f"{architecture} cannot be split into pipeline stages yet; pipeline parallelism supports "
                f"{', '.join(TP_ARCHITECTURES)}.")
    if pp > num_layers:
        return f"is more than the model's {num_layers} decoder layers (every stage needs one)."
    return None


def check_pipeline_parallel(args: Any, mc: Any, pp: int, backend: str) -> None:
    """Refuse, by name, what pipeline stages do not run: an architecture tensor parallelism cannot split
    (T5, vision models), more stages than decoder layers, the Ray backend, speculative decoding and
    cpu_offload_gb.

    Raises:
        HayabusaValidationError: naming pipeline_parallel_size.
    """
    why = pp_refusal(mc.architecture, mc.num_layers, pp)
    if why is None and backend == "ray":
        why = "runs with distributed_executor_backend='mp' only (Ray workers are tensor-parallel only)."
    if why is None and getattr(args, "speculative_config", None):
        why = "speculative decoding with pipeline stages is not supported; use one of them."
    if why is None and getattr(args, "cpu_offload_gb", 0):
        why = "cpu_offload_gb with pipeline stages is not supported (each stage holds only its layers already)."
    if why is not None:
        raise _bad("pipeline_parallel_size", pp, why)


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
