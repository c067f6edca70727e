"""Engine arguments -> frozen configs. Every derived value is computed here, once.

``EngineArgs`` carries vLLM's argument names and defaults; ``EngineArgs.create_engine_config`` resolves the model
folder or Hub id, reads its HF config, and returns a ``VllmConfig``-like bundle of ``ModelConfig``,
``CacheConfig``, ``SchedulerConfig`` and ``DeviceConfig``. Unknown keyword arguments are rejected by name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator

import torch

from hayabusa.errors import HayabusaValidationError, is_int as _is_int

logger = logging.getLogger(__name__)

# CPU has no "memory utilization" to profile: the KV cache gets this many bytes unless kv_cache_memory_bytes says
# otherwise (vLLM's CPU backend default, VLLM_CPU_KVCACHE_SPACE=4 GiB), capped at what max_num_seqs sequences of
# max_model_len tokens can use.
CPU_KV_CACHE_DEFAULT_BYTES = 4 << 30

# Model dtype names (and aliases) that ``dtype=`` accepts -> torch dtype.
DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# kv_cache_dtype (vLLM's names) -> dtype of the KV-cache tensors; "auto" = the model dtype. "fp8" means e4m3.
# FP8 formats: arXiv:2209.05433; scales and semantics: vLLM's kv_cache_dtype (see model/layers/attention.py).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


# vLLM's default of max_num_batched_tokens (chunked prefill on): 8192, or max_num_seqs when that is larger.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def default_max_num_batched_tokens(max_num_seqs: int) -> int:
    """max_num_batched_tokens when it is not given (the engine and ``hayabusa plan`` both use this)."""
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of K and V for one token over all layers: 2 x layers x kv_heads x head_dim x element size."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size


# vLLM engine arguments that hayabusa accepts (so vLLM scripts run unchanged) and does not act on: name -> why.
# A value other than the field's default logs one warning naming the argument (README: "Accepted and ignored").
IGNORED_ARGS: dict[str, str] = {
    "tokenizer_mode": "the tokenizer is always transformers' AutoTokenizer (the fast one when the checkpoint has it)",
    "max_seq_len_to_capture": "CUDA graphs are captured per decode batch size (cuda_graph_sizes, max_num_seqs), "
                              "for any sequence length",
    "disable_log_stats": "hayabusa logs no periodic stats (the server's /metrics has them)",
    "enable_chunked_prefill": "chunked prefill is always on (max_num_batched_tokens bounds each step)",
    "disable_custom_all_reduce": "the all-reduce is torch.distributed's (NCCL / gloo); there is no custom one",
    "compilation_config": "hayabusa does not use torch.compile; CUDA graphs are set by enforce_eager and "
                          "cuda_graph_sizes",
    "num_scheduler_steps": "every step is scheduled (async scheduling overlaps the host's work instead)",
    "reasoning_parser": "the offline engine returns the whole text; reasoning is not split out",
}

# EngineArgs fields that are not command-line flags: each command names the model its own way (positional or
# --model), and compilation_config is a Python dict.
NOT_CLI_ARGS = frozenset({"model", "compilation_config"})
# Short spellings of flags that vLLM accepts too.
CLI_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",)}


def cli_arg_type(f: dataclasses.Field) -> Any:
    """How a flag parses its value: "bool" (``--x`` / ``--no-x``), "list" (one or more ints), int, float or str."""
    first = str(f.type).split("|")[0].strip()
    if first == "bool":
        return "bool"
    if first.startswith("list["):
        return "list"
    return {"int": int, "float": float}.get(first, str)


def optional_field(f: dataclasses.Field) -> bool:
    """Whether a field's type admits None (``bool | None``: None is its default, e.g. batch_invariant, where the
    environment variable decides)."""
    return str(f.type).replace(" ", "").endswith("|None")


def _arg_docs(cls: type) -> dict[str, str]:
    """name -> help text, from the ``Args:`` sections of ``cls``'s and its bases' docstrings (an entry may name
    several arguments: "revision, tokenizer_revision: ..." or "a / b: ...")."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        text = (klass.__doc__ or "").split("Args:", 1)
        if len(text) < 2:
            continue
        names: list[str] = []
        for line in text[1].splitlines():
            m = re.match(r"^\s{8}([a-z_][a-z0-9_ ,/]*):\s*(.*)$", line)
            if m:
                names = [n for n in re.split(r"[ ,/]+", m.group(1)) if n]
                for n in names:
                    docs[n] = m.group(2)
            elif line.strip() and names:
                for n in names:
                    docs[n] += " " + line.strip()
    return docs


def _bad(parameter: str, value: Any, why: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"{parameter}={value!r}: {why}", parameter=parameter, value=value)


@contextlib.contextmanager
def _as_draft_model_error(draft: str) -> Iterator[None]:
    """Errors raised while reading the draft / head checkpoint say so, so they are not read as the target's: those
    about its path (raised as ``model``: resolve_model_dir, ModelConfig) name ``speculative_config.model``; the
    others (``max_model_len`` beyond the draft's context, ...) keep their parameter, with the draft named first."""
    try:
        yield
    except HayabusaValidationError as e:
        if e.parameter in ("model", None):
            raise type(e)(f"speculative_config.model={draft!r}: {e}", parameter="speculative_config.model",
                          value=draft) from None
        if str(e).startswith("speculative_config"):
            raise
        raise e.prefixed(f"the draft (speculative_config.model={draft!r})") from None


def cpu_offload_refusal(architecture: str, is_encoder_decoder: bool) -> str | None:
    """Why a model cannot run with cpu_offload_gb > 0, or None when it can: the engine's rule, which
    ``hayabusa plan`` applies too (encoder-decoder models such as T5 are refused by name)."""
    if is_encoder_decoder:
        return f"weight offload is not supported for encoder-decoder models ({architecture}) yet."
    return None


@dataclass
class EngineArgs:
    """Arguments of ``LLM(...)`` and ``AsyncEngineArgs`` (vLLM's names, defaults and meanings).

    tokenizer_mode, max_seq_len_to_capture, disable_log_stats, enable_chunked_prefill,
    disable_custom_all_reduce and compilation_config are accepted so that vLLM scripts run, and ignored
    (``IGNORED_ARGS`` says why); a value other than the default logs a warning naming the argument.

    Args:
        model: HF model folder (config.json + *.safetensors) or Hub id.
        tokenizer: tokenizer folder or Hub id; defaults to ``model``.
        dtype: "auto" (the checkpoint's dtype; float32 checkpoints run in bfloat16 on CUDA and float32 on CPU),
            "float32", "float16", "bfloat16" (aliases accepted), or a ``torch.dtype``.
        seed: seed of the default random generator (unseeded requests).
        max_model_len: context length (prompt + output tokens); default: the model's max_position_embeddings.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most tokens in one step (chunked prefill splits longer prompts); default 8192.
        gpu_memory_utilization: fraction of total GPU memory the engine may use (weights + activations + KV).
        block_size: tokens per KV-cache block.
        enforce_eager: disable CUDA graphs.
        skip_tokenizer_init: no tokenizer; prompts must be token ids and outputs carry no text.
        trust_remote_code: allow code from the checkpoint (transformers' option); off by default.
        download_dir: Hub cache folder.
        kv_cache_memory_bytes: KV-cache size in bytes, bypassing profiling.
        kv_cache_dtype: "auto" (the model dtype), "fp8" = "fp8_e4m3" (torch.float8_e4m3fn) or "fp8_e5m2"
            (torch.float8_e5m2): the KV cache stores fp8(x / scale) with per-layer k/v scales from the checkpoint
            (1.0 when it has none), halving KV bytes per token against bf16 (vLLM's names and semantics).
        num_gpu_blocks_override: number of KV blocks, bypassing profiling.
        device: "auto" (CUDA when available), "cuda", "cuda:N" or "cpu".
        load_format: "auto"/"safetensors" (default, safe), or "pt" to allow pickle ``.bin`` checkpoints, which can
            run arbitrary code: only for checkpoints you trust.
        revision, tokenizer_revision: passed to transformers / huggingface_hub.
        tensor_parallel_size: GPUs (CPU processes) the model is split over, Megatron-style (hayabusa/distributed/);
            > 1 runs the model in that many worker processes (hayabusa/executor/).
        pipeline_parallel_size: stages
            the decoder layers are split into (vLLM's split; each stage's ranks hold only their layers and their
            KV cache; tensor_parallel_size ranks inside each stage: tp x pp worker processes, mp backend only;
            up to pp micro-batches of disjoint requests in flight, which replaces async_scheduling).
        distributed_executor_backend: "mp" (worker processes on this machine; the default when
            tensor_parallel_size > 1) or "ray" (workers placed by Ray; ``pip install hayabusa[ray]``).
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes (default on, as in vLLM).
        cuda_graph_sizes: decode batch sizes captured in CUDA graphs (default: 1, 2, 4, 8, then every 16 up to
            min(max_num_seqs, 512)).
        cpu_offload_gb: GiB of weights per GPU kept in pinned CPU memory (vLLM's meaning): the fewest whole decoder
            layers that hold that much, evenly spread over the stack, stream to the GPU each forward through a
            ring of two layer-sized buffers, the next layer copied while one computes
            (hayabusa/worker/cpu_offload.py; quantized models move their packed weights; CUDA graphs capture the
            copies). More than the model has offloads every decoder layer (logged). The whole model must still
            fit on the GPU while it loads (the layers move to CPU memory after loading). The KV-cache sizing sees the weights no longer
            resident and the ring. With tensor_parallel_size > 1 each rank offloads that much of its shard; a
            draft model (speculative decoding) stays resident; encoder-decoder models are refused by name. On a
            CPU device it is accepted and changes nothing (logged).
        swap_space: GiB of CPU memory for the KV cache's CPU tier per rank (vLLM's meaning and default, 4):
            preempted requests' KV is swapped there instead of recomputed (see preemption_mode), and prefix-cache
            blocks evicted from the GPU move there and come back on a prefix hit. It holds a draft model's KV too
            (speculative decoding); each tensor-parallel rank keeps its own tier of its KV heads. 0 turns the tier
            off. More than the host's available memory (over the ranks) is an error.
        preemption_mode: "swap" (a preempted request's KV goes to the CPU tier and comes back), "recompute" (it
            is recomputed), or None: swap long contexts (at least ``SWAP_MIN_TOKENS`` computed tokens), recompute
            short ones. vLLM's name. A request with images or prompt_logprobs is always recomputed.
        max_logprobs: most logprobs a request may ask for.
        quantization: "fp8" (FP8 W8A8; FP8 checkpoints are detected), "int8" / "int4" (weight-only W8A16 /
            W4A16 g128), "w8a8_int8" (INT8 W8A8), "compressed-tensors" (FP8 / INT8 W8A8), "awq", "gptq",
            "bitsandbytes" (checkpoint formats, detected);
            default: the checkpoint's quantization_config, if any. See hayabusa/quantization/.
        allowed_local_media_path: chat images given as file:// URLs are read only from under this folder
            (default "": no local files).
        allowed_media_domains: host names whose http(s) image URLs may be fetched (default: none; remote fetching
            is off, stricter than vLLM).
        async_scheduling: schedule and launch step N+1 before step N's tokens are back, so host work overlaps
            the GPU (vLLM's async scheduling). Default: on for CUDA, off on CPU (nothing to overlap there).
        limit_mm_per_prompt: most multimodal items per prompt, e.g. {"image": 5} (a JSON string on the command
            line); vLLM's meaning and default (V1: 999 per modality). Only for models with a vision tower.
        num_scheduler_steps, reasoning_parser: accepted for vLLM compatibility and ignored (IGNORED_ARGS).
        speculative_config: speculative decoding, vLLM's dict (a JSON string on the command line), e.g.
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}, {"method": "draft_model",
            "model": DIR, "num_speculative_tokens": 4} with a smaller checkpoint of the same tokenizer, or
            {"method": "eagle" / "eagle3", "model": HEAD, "num_speculative_tokens": 3} with a public EAGLE /
            EAGLE-3 head for a Llama / Qwen2 target (pickle-only heads need load_format="pt"); null / {} = off.
            The README's "Speculative decoding" lists every key, the turn-off rules included. With async_scheduling (default on CUDA) a step that carries no proposals (the
            turn-off rules have speculation off for every running request) still overlaps the previous one; a
            step with proposals waits for the previous step's tokens. EAGLE runs every step synchronously.
        batch_invariant: a request's token ids and logprobs do not depend on the other requests in its steps,
            max_num_seqs / max_num_batched_tokens, prompt chunking, prefix-cache hits or CUDA graphs (fixed-tile
            GEMM, one attention configuration, per-row reductions; hayabusa/batch_invariant.py). Also on with
            the environment variable HAYABUSA_BATCH_INVARIANT=1 (or, when that is unset, vLLM's
            VLLM_BATCH_INVARIANT=1) when left at None (an explicit False wins over the variables). Quantization,
            tensor parallelism and speculative decoding are refused in the mode; T5 and vision models run in it.
    """

    model: str = ""
    tokenizer: str | None = None
    dtype: Any = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    download_dir: str | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    device: str = "auto"
    load_format: str = "auto"
    revision: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_mode: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_prefix_caching: bool | None = None
    max_seq_len_to_capture: int = 8192
    cuda_graph_sizes: list[int] | None = None
    disable_log_stats: bool = True
    swap_space: float = 4
    cpu_offload_gb: float = 0
    preemption_mode: str | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    enable_chunked_prefill: bool | None = None
    disable_custom_all_reduce: bool = False
    compilation_config: Any = None
    async_scheduling: bool | None = None
    max_logprobs: int = 20
    limit_mm_per_prompt: Any = None
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    num_scheduler_steps: int = 1
    reasoning_parser: str | None = None
    speculative_config: Any = None
    batch_invariant: bool | None = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        """Build from keyword arguments; an unknown name raises HayabusaValidationError naming it."""
        from hayabusa.compat import pop_unsupported_engine_args

        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = dict(kwargs)
        pop_unsupported_engine_args(kwargs)     # vLLM features not here yet: "not supported yet", not "unknown"
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise HayabusaValidationError(
                f"unknown engine argument(s): {', '.join(unknown)}. Known: {', '.join(sorted(names))}.",
                parameter=unknown[0], value=kwargs[unknown[0]])
        return cls(model=model, **kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only: Collection[str] | None = None,
                     helps: dict[str, str] | None = None) -> Any:
        """Add one flag per field (vLLM's spelling: ``--max-num-seqs``; booleans as ``--x`` / ``--no-x``) to
        ``parser``, in an argument group; the one place every ``hayabusa`` command gets its engine flags from.
        Unset flags stay None, so ``cli_kwargs`` passes only what was given and EngineArgs' defaults apply.

        Args:
            parser: the command's parser.
            only: the field names to add (default: every field but ``NOT_CLI_ARGS``).
            helps: help texts that replace the docstring's for this command (name -> text).
        Returns:
            The argument group (``parser.add_argument_group``) holding the flags.
        """
        group = parser.add_argument_group("engine arguments (EngineArgs; unset flags keep its defaults)")
        docs = _arg_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in NOT_CLI_ARGS or (only is not None and f.name not in only):
                continue
            names = ["--" + f.name.replace("_", "-"), *CLI_ALIASES.get(f.name, ())]
            kind = cli_arg_type(f)
            default = f.default if f.default is not dataclasses.MISSING else None
            doc = (helps or {}).get(f.name) or docs.get(f.name, "")
            if f.name in IGNORED_ARGS:
                doc = f"accepted for vLLM compatibility and ignored: {IGNORED_ARGS[f.name]}"
            # a None default means "derived" (the docstring says from what): only a real value is printed
            help_text = (doc if default is None else f"{doc} [EngineArgs default: {default}]").strip()
            if kind == "bool":
                group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            elif kind == "list":
                group.add_argument(*names, dest=f.name, type=str if "list[str" in str(f.type) else int, nargs="+",
                                   default=None, help=help_text)
            else:
                group.add_argument(*names, dest=f.name, type=kind, default=None, help=help_text)
        return group

    @classmethod
    def cli_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The engine arguments given on the command line (flags added by ``add_cli_args``; None = not given)."""
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                if f.name not in NOT_CLI_ARGS and getattr(args, f.name, None) is not None}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **kwargs: Any) -> "EngineArgs":
        """EngineArgs from parsed flags (``add_cli_args``), plus ``kwargs`` (e.g. ``model=``) over them."""
        merged = {**cls.cli_kwargs(args), **kwargs}
        return cls.from_kwargs(merged.pop("model", ""), **merged)

    def create_engine_config(self) -> "EngineConfig":
        """Validate and derive every config. Reads the model's config.json (no weights)."""
        from hayabusa.envs import check_switches

        check_switches()   # a bad on/off environment switch is named now, whatever the model loads
        self._verify_args()
        self._warn_ignored_args()
        device = resolve_device(self.device)
        model_config = ModelConfig.from_args(self, device)
        from hayabusa.distributed.config import make_parallel_config

        # the parallel checks that need the model first: a refused size is named before any warning about the rest
        parallel_config = make_parallel_config(self, model_config, device)
        max_len = model_config.max_model_len
        if model_config.batch_invariant:
            from hayabusa.batch_invariant import check_batch_invariant

            check_batch_invariant(model_config, self.tensor_parallel_size, self.speculative_config,
                                  from_env=self.batch_invariant is None)
        if model_config.is_encoder_decoder and self.enable_prefix_caching:
            logger.warning("enable_prefix_caching is off for encoder-decoder models (%s): a decoder's KV depends on "
                           "its encoder input, so equal decoder prefixes share nothing.", model_config.architecture)
        batched = self.max_num_batched_tokens or default_max_num_batched_tokens(self.max_num_seqs)
        if batched < self.max_num_seqs:
            raise _bad("max_num_batched_tokens", batched, f"must be >= max_num_seqs ({self.max_num_seqs}).")
        scheduler_config = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
                                           max_model_len=max_len, max_num_encoder_input_tokens=batched,
                                           preemption_mode=self.preemption_mode,
                                           pipeline_depth=self.pipeline_parallel_size)
        cache_config = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, num_gpu_blocks_override=self.num_gpu_blocks_override,
            cache_dtype=self.kv_cache_dtype,
            kv_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, model_config.dtype, device),
            swap_space_bytes=check_swap_space(self.swap_space,
                                              self.tensor_parallel_size * self.pipeline_parallel_size),
            cpu_offload_bytes=self._cpu_offload_bytes(device, model_config),
            # encoder-decoder: a decoder's KV depends on its encoder input, so equal decoder prefixes share nothing
            enable_prefix_caching=not model_config.is_encoder_decoder and (
                True if self.enable_prefix_caching is None else bool(self.enable_prefix_caching)))
        from hayabusa.spec_decode.config import parse_speculative_config

        spec = parse_speculative_config(self.speculative_config)
        if spec is not None and spec.num_speculative_tokens >= max_len:
            # a request holds at most max_model_len - 1 tokens after its first, so no step can verify more; the
            # runner sizes per-step buffers by k (R x (k + 1) on CUDA) and the metrics a vector of length k
            raise _bad("speculative_config.num_speculative_tokens", spec.num_speculative_tokens,
                       f"must be less than max_model_len ({max_len}): no request can verify more proposals.")
        draft_config = None
        if spec is not None and spec.method == "draft_model":
            with _as_draft_model_error(spec.model):
                draft_config = ModelConfig.from_args(dataclasses.replace(
                    self, model=spec.model, tokenizer=None, quantization=None, max_model_len=max_len,
                    speculative_config=None), device)
            if draft_config.vocab_size != model_config.vocab_size or model_config.is_encoder_decoder \
                    or draft_config.is_encoder_decoder:
                raise _bad("speculative_config.model", spec.model,
                           f"the draft must be a decoder-only model with the target's vocabulary "
                           f"({model_config.vocab_size} tokens; it has {draft_config.vocab_size}).")
        if spec is not None and spec.method in ("eagle", "eagle3"):
            from hayabusa.spec_decode.eagle_config import EagleHeadConfig

            with _as_draft_model_error(spec.model):
                draft_config = EagleHeadConfig.from_target(spec.method, spec.model, model_config,
                                                           self.trust_remote_code, self.load_format)
        if spec is not None and spec.method in ("eagle", "eagle3") and self.async_scheduling:
            logger.warning("async_scheduling is off with EAGLE speculative decoding: its head reads every step's "
                           "tokens on the host.")
        sizes = self.cuda_graph_sizes
        capture_max = min(self.max_num_seqs, max(sizes) if sizes else 512)
        if spec is not None and parallel_config.world_size > 1:
            raise _bad("speculative_config", self.speculative_config, "speculative decoding with "
                       f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet; use one of them.")
        cfg = EngineConfig(model_config=model_config, cache_config=cache_config,
                           scheduler_config=scheduler_config,
                           device_config=DeviceConfig(device=device),
                           enforce_eager=self.enforce_eager or device.type != "cuda",
                           cuda_graph_sizes=sorted(set(sizes)) if sizes else None,
                           max_cuda_graph_batch=capture_max, seed=self.seed or 0,
                           # pipeline stages overlap steps their own way (micro-batches: _step_pipelined)
                           # speculation: steps without proposals overlap; those with proposals run
                           # synchronously (LLMEngine._step); EAGLE's head reads host tokens: synchronous
                           async_scheduling=False if self.pipeline_parallel_size > 1
                           or (spec is not None and spec.method in ("eagle", "eagle3"))
                           else (device.type == "cuda")
                           if self.async_scheduling is None else bool(self.async_scheduling),
                           speculative_config=spec, draft_model_config=draft_config,
                           parallel_config=parallel_config)
        if cache_config.swap_space_bytes and self.preemption_mode == "swap":
            # the target's K + V of one block, all KV heads (a draft's bytes come on top: the engine warns then)
            need = model_config.kv_bytes_per_token(cache_config.kv_dtype) * cache_config.block_size
            if cache_config.swap_space_bytes < need:
                raise _bad("swap_space", self.swap_space, f"holds no KV block ({need / 2**20:.2f} MiB each for "
                           "this model), so preemption_mode='swap' could never swap; give at least "
                           f"{need / 2**30:.4f} GiB.")
        return cfg

    def _cpu_offload_bytes(self, device: torch.device, model_config: "ModelConfig") -> int:
        """cpu_offload_gb in bytes where it does something: on CUDA, and on CPU only in the test-only fake-device
        mode (worker/cpu_offload.py); else 0 (logged). Encoder-decoder models are refused by name."""
        if not self.cpu_offload_gb:
            return 0
        from hayabusa.worker.cpu_offload import FAKE_ENV, fake_device_offload

        why = cpu_offload_refusal(model_config.architecture, model_config.is_encoder_decoder)
        if why is not None:   # before the CPU no-op, so a CPU trial run learns it too
            raise _bad("cpu_offload_gb", self.cpu_offload_gb, why)
        if device.type == "cpu" and not fake_device_offload():
            logger.warning("cpu_offload_gb=%s is accepted and changes nothing on a CPU device (the weights are in "
                           "CPU memory already).", self.cpu_offload_gb)
            return 0
        if device.type == "cpu":
            logger.info("cpu_offload_gb=%s on a CPU device in the fake-device mode (%s): the offload path runs with "
                        "CPU copies (tests).", self.cpu_offload_gb, FAKE_ENV)
        return int(self.cpu_offload_gb * (1 << 30))

    def _warn_ignored_args(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        for name, why in IGNORED_ARGS.items():
            value = getattr(self, name)
            if value != defaults[name]:
                logger.warning("%s=%r is accepted for vLLM compatibility and ignored: %s.", name, value, why)

    def _verify_args(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise _bad("model", self.model, "give a model folder or a Hugging Face Hub id.")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise _bad("batch_invariant", self.batch_invariant, "must be True or False (or None: "
                       "HAYABUSA_BATCH_INVARIANT, else VLLM_BATCH_INVARIANT, decides).")
        for f in dataclasses.fields(self):   # on / off arguments: a string such as "no" must not read as on
            v = getattr(self, f.name)
            if str(f.type) in ("bool", "bool | None") and not (isinstance(v, bool) or (v is None and "None" in
                                                                                       str(f.type))):
                raise _bad(f.name, v, "must be True or False" + (" (or None: derived)." if "None" in str(f.type)
                                                                  else "."))
        positive = ("max_num_seqs", "block_size")
        for name in positive:
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise _bad(name, v, "must be a positive integer.")
        if self.block_size % 16 and self.block_size not in (1, 2, 4, 8):
            raise _bad("block_size", self.block_size, "must be 1, 2, 4, 8 or a multiple of 16.")
        if not _is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise _bad("max_logprobs", self.max_logprobs, "must be a non-negative integer.")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise _bad(name, v, "must be a positive integer or None.")
        if self.seed is not None and (not _is_int(self.seed) or not -(2 ** 63) <= self.seed < 2 ** 64):
            # torch.manual_seed's range (a 64-bit seed, negative values wrapped)
            raise _bad("seed", self.seed, "must be an integer in [-2**63, 2**64) or None.")
        gmu = self.gpu_memory_utilization
        if not isinstance(gmu, (int, float)) or isinstance(gmu, bool) or not 0.0 < gmu <= 1.0:
            raise _bad("gpu_memory_utilization", gmu, "must be a number in (0, 1].")
        sizes = self.cuda_graph_sizes
        if sizes is not None and (not isinstance(sizes, (list, tuple)) or not sizes
                                  or not all(_is_int(n) and n >= 1 for n in sizes)):
            raise _bad("cuda_graph_sizes", sizes, "must be a non-empty list of positive integers (batch sizes to "
                       "capture) or None.")
        for name in ("tokenizer", "revision", "tokenizer_revision"):   # else a Hub lookup retries for a minute
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise _bad(name, v, "must be a string (a folder or Hub id; a revision: a branch, tag or commit) "
                           "or None.")
        if self.download_dir is not None and not isinstance(self.download_dir, (str, os.PathLike)):
            raise _bad("download_dir", self.download_dir, "must be a folder path or None.")
        domains = self.allowed_media_domains
        if domains is not None and (not isinstance(domains, (list, tuple)) or not all(isinstance(d, str)
                                                                                      for d in domains)):
            raise _bad("allowed_media_domains", domains, "must be a list of host names (e.g. ['example.com']) "
                       "or None.")
        from hayabusa.distributed.config import check_parallel_args

        check_parallel_args(self.tensor_parallel_size, self.pipeline_parallel_size,
                            self.distributed_executor_backend)
        if self.load_format not in ("auto", "safetensors", "pt"):
            raise _bad("load_format", self.load_format, "must be 'auto', 'safetensors' or 'pt'.")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("kv_cache_dtype", self.kv_cache_dtype,
                       f"must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}.")
        if self.quantization is not None:
            from hayabusa.quantization import normalize_method_name

            normalize_method_name(self.quantization)   # unknown names fail here, listing the known ones
        from hayabusa.multimodal.processor import check_limit_mm_per_prompt

        self.limit_mm_per_prompt = check_limit_mm_per_prompt(self.limit_mm_per_prompt) or None
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise _bad("preemption_mode", self.preemption_mode, "must be 'swap', 'recompute' or None (auto).")
        if not isinstance(self.swap_space, (int, float)) or isinstance(self.swap_space, bool) \
                or not 0 <= self.swap_space < float("inf"):
            raise _bad("swap_space", self.swap_space, "must be a non-negative number of GiB.")
        if self.preemption_mode == "swap" and not self.swap_space:
            raise _bad("preemption_mode", self.preemption_mode, "needs swap_space > 0 (the CPU tier it swaps to).")
        if not isinstance(self.cpu_offload_gb, (int, float)) or isinstance(self.cpu_offload_gb, bool) \
                or not 0 <= self.cpu_offload_gb < float("inf"):
            raise _bad("cpu_offload_gb", self.cpu_offload_gb, "must be a non-negative number of GiB.")


def available_host_memory() -> int:
    """Bytes of host memory available now (MemAvailable; psutil's reading when /proc/meminfo is absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def check_swap_space(swap_space: float, num_ranks: int = 1) -> int:
    """swap_space GiB (per rank, as vLLM's "per GPU": each tensor-parallel rank keeps a CPU tier of its KV heads)
    -> bytes per rank, refused by name when ``num_ranks`` tiers need more host memory than is available. vLLM's
    default (4 GiB) shrinks to half the available memory (over the ranks) instead, with a warning."""
    want = int(swap_space * (1 << 30))
    avail = available_host_memory()
    if want * num_ranks <= avail:
        return want
    if swap_space == EngineArgs.swap_space:
        logger.warning("swap_space=%s GiB (the default) x %d rank(s) is more than the %.1f GiB of host memory "
                       "available: the KV cache's CPU tier gets %.1f GiB per rank.", swap_space, num_ranks,
                       avail / 2**30, avail / 2**31 / num_ranks)
        return avail // 2 // num_ranks
    raise _bad("swap_space", swap_space, f"{swap_space} GiB of CPU memory for the KV cache's CPU tier x {num_ranks} "
               f"rank(s) is more than the {avail / 2**30:.1f} GiB of host memory available; lower swap_space (0 "
               "turns the tier off).")


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda if available, else cpu. Raises HayabusaValidationError for CUDA without a GPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise _bad("device", device, f"not a torch device ({e}).") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise _bad("device", device, "CUDA is not available on this machine; use device='cpu'.")
    if dev.type not in ("cuda", "cpu"):
        raise _bad("device", device, "supported devices are 'cuda' and 'cpu'.")
    return dev


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV-cache tensors' dtype. Raises HayabusaValidationError for e4m3 on a CUDA GPU older than compute
    capability 8.9 (Ada / Hopper): Triton has no fp8e4nv there; fp8_e5m2 is the format it can convert."""
    dtype = KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype
    from hayabusa.quantization.fp8 import FP8_MIN_CAPABILITY

    if (dtype == torch.float8_e4m3fn and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY):
        raise _bad("kv_cache_dtype", kv_cache_dtype, "fp8 e4m3 needs compute capability >= 8.9 (Ada, Hopper); this "
                   f"GPU is {torch.cuda.get_device_capability(device)}. Use 'fp8_e5m2' or 'auto'.")
    return dtype


def resolve_dtype(dtype: Any, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise _bad("dtype", dtype, "must be float32, float16 or bfloat16.")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if config_dtype in (None, torch.float32):
            return torch.bfloat16
        return config_dtype
    if dtype not in DTYPES:
        raise _bad("dtype", dtype, f"must be 'auto' or one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model (read from its HF config)."""

    model: str                 # local folder with the checkpoint (Hub ids resolved to the snapshot folder)
    tokenizer: str | None
    hf_config: Any             # transformers.PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    trust_remote_code: bool
    skip_tokenizer_init: bool
    load_format: str
    revision: str | None
    tokenizer_revision: str | None
    eos_token_ids: tuple[int, ...] = ()
    quant_config: Any = None           # hayabusa.quantization.QuantizationConfig, checked against the device
    max_logprobs: int = 20             # most logprobs a request may ask for (vLLM's engine argument)
    # Encoder-decoder models (T5): the prompt is the encoder input, the decoder starts from decoder_start_token_id;
    # num_layers / num_kv_heads / head_dim describe the decoder, whose layers hold self- and cross-attention KV.
    is_encoder_decoder: bool = False
    decoder_start_token_id: int | None = None
    # the longest encoder input: the model's (config.json's n_positions, else 512), whatever max_model_len (which
    # limits the decoder alone and may not exceed it); None for decoder-only models
    max_encoder_len: int | None = None
    multimodal_config: Any = None      # the whole HF config of a model with a vision tower (vision_config), else None
    limit_mm_per_prompt: Any = None    # {modality: most items per prompt} (EngineArgs), None = vLLM's default
    batch_invariant: bool = False   # EngineArgs.batch_invariant, HAYABUSA_ / VLLM_BATCH_INVARIANT=1

    @classmethod
    def from_args(cls, args: EngineArgs, device: torch.device) -> "ModelConfig":
        from hayabusa.model.loader import resolve_model_dir
        from hayabusa.model.registry import resolve_architecture

        model_dir = resolve_model_dir(args.model, revision=args.revision, download_dir=args.download_dir,
                                      allow_pt=args.load_format == "pt")
        hf_config = load_hf_config(model_dir, args.trust_remote_code, args.revision)
        arch = resolve_architecture(hf_config)
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        enc_dec = bool(getattr(text_config, "is_encoder_decoder", False))
        derived = derive_encoder_decoder_max_len(text_config) if enc_dec else derive_max_model_len(text_config)
        max_len = args.max_model_len or derived
        if args.max_model_len and derived and args.max_model_len > derived:
            raise _bad("max_model_len", args.max_model_len,
                       f"is larger than the model's maximum context ({derived} tokens, from config.json).")
        num_heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        num_layers = text_config.num_hidden_layers
        if enc_dec:  # T5: heads of d_kv, and the KV cache belongs to the decoder's layers
            head_dim = text_config.d_kv
            num_layers = getattr(text_config, "num_decoder_layers", None) or num_layers
        config_dtype = getattr(text_config, "dtype", None)
        if config_dtype is None and "torch_dtype" in getattr(text_config, "__dict__", {}):
            config_dtype = text_config.__dict__["torch_dtype"]
        if isinstance(config_dtype, str):
            config_dtype = DTYPES.get(config_dtype)
        eos = eos_token_ids(model_dir, text_config)
        from hayabusa.batch_invariant import batch_invariant_requested
        from hayabusa.quantization import check_device, get_quantization_config

        quant_config = get_quantization_config(args.quantization, hf_config)
        if quant_config is not None:
            check_device(quant_config, device)
        return cls(model=model_dir, tokenizer=args.tokenizer or model_dir, hf_config=text_config,
                   architecture=arch, dtype=resolve_dtype(args.dtype, config_dtype, device), max_model_len=max_len,
                   vocab_size=text_config.vocab_size, num_layers=num_layers,
                   num_heads=num_heads,
                   num_kv_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
                   head_dim=head_dim, hidden_size=text_config.hidden_size,
                   trust_remote_code=args.trust_remote_code, skip_tokenizer_init=args.skip_tokenizer_init,
                   load_format=args.load_format, revision=args.revision, tokenizer_revision=args.tokenizer_revision,
                   eos_token_ids=eos, quant_config=quant_config, max_logprobs=args.max_logprobs,
                   is_encoder_decoder=enc_dec,
                   decoder_start_token_id=decoder_start_token_id(model_dir, text_config) if enc_dec else None,
                   max_encoder_len=derived if enc_dec else None,
                   multimodal_config=hf_config if getattr(hf_config, "vision_config", None) is not None else None,
                   limit_mm_per_prompt=args.limit_mm_per_prompt,
                   batch_invariant=batch_invariant_requested(args.batch_invariant))

    @property
    def quantization(self) -> str | None:
        """The method that runs ("fp8", "int4", ...; None = unquantized)."""
        return self.quant_config.name if self.quant_config is not None else None

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V for one token over all layers: 2 x layers x kv_heads x head_dim x element size."""
        elem = torch.empty((), dtype=dtype or self.dtype).element_size()
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, elem)


def load_hf_config(model_dir: str, trust_remote_code: bool, revision: str | None = None) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code, revision=revision)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise _bad("trust_remote_code", trust_remote_code,
                       f"the checkpoint needs custom code ({e}); pass trust_remote_code=True only if you trust it."
                       ) from None
        unsupported = _unsupported_architecture_error(model_dir)
        if unsupported is not None:
            raise unsupported from None
        raise


def _unsupported_architecture_error(model_dir: str) -> Exception | None:
    """transformers could not read config.json (e.g. a ``model_type`` it does not know): when none of the file's
    ``architectures`` is one hayabusa runs, the UnsupportedModelError (listing the supported ones) to raise instead
    of transformers' message; None otherwise."""
    import json
    import os
    import types

    from hayabusa.errors import UnsupportedModelError
    from hayabusa.model.registry import resolve_architecture

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    try:
        resolve_architecture(types.SimpleNamespace(architectures=archs if isinstance(archs, list) else None))
    except UnsupportedModelError as e:
        return e
    return None


def derive_max_model_len(cfg: Any) -> int:
    """The model's context length: the smallest of the usual config keys that are set, times the RoPE scaling
    factor for the types whose config keeps the pre-scaling length there (vLLM's rule: linear, yarn (from
    ``original_max_position_embeddings``); not llama3 / longrope, whose configs hold the scaled length)."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
    values = [getattr(cfg, k) for k in keys if isinstance(getattr(cfg, k, None), int)]
    length = min(values) if values else 2048
    if values and (getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None)):
        from hayabusa.model.layers.rotary import rope_parameters

        rope = rope_parameters(cfg)
        if rope["rope_type"] in ("linear", "yarn") and rope.get("factor"):
            if rope["rope_type"] == "yarn" and rope.get("original_max_position_embeddings"):
                length = rope["original_max_position_embeddings"]
            length = int(length * rope["factor"])
    return length


def derive_encoder_decoder_max_len(cfg: Any) -> int:
    """T5 has relative positions and no hard limit: ``n_positions`` when config.json has it (the original
    checkpoints say 512), else 512, the length T5 was trained at (and its tokenizers' model_max_length)."""
    n = getattr(cfg, "n_positions", None)
    return n if isinstance(n, int) and n > 0 else 512


def decoder_start_token_id(model_dir: str, cfg: Any) -> int:
    """The decoder's first token, as transformers' generate picks it: generation_config.json, else config.json,
    else the pad id (T5's convention), else 0."""
    import json

    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            v = json.load(f).get("decoder_start_token_id")
        if isinstance(v, int):
            return v
    for name in ("decoder_start_token_id", "pad_token_id"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    return 0


def eos_token_ids(model_dir: str, cfg: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (may be a list, as in Llama 3 / Qwen2.5), else config.json."""
    import json

    ids: list[int] = []
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
    if not ids:
        eos = getattr(cfg, "eos_token_id", None)
        ids = eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
    return tuple(ids)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    cache_dtype: str = "auto"                 # kv_cache_dtype as given ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    enable_prefix_caching: bool = True
    kv_dtype: torch.dtype | None = None       # dtype of the cache tensors (resolved; None = the model dtype)
    swap_space_bytes: int = 0                 # the KV cache's CPU tier per rank (swap_space; 0 = none)
    cpu_offload_bytes: int = 0                # weights per GPU kept in CPU memory (cpu_offload_gb; 0 = none)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # encoder (vision tower) budget per step, in encoder output tokens (vLLM's max_num_encoder_input_tokens; its
    # default: max_num_batched_tokens); an image larger than the budget runs alone in its step
    max_num_encoder_input_tokens: int = 0
    preemption_mode: str | None = None        # "swap", "recompute", None = auto (core/cpu_kv_tier.prefer_swap)
    # steps in flight at once (pipeline_parallel_size: one per stage, vLLM's batch queue); > 1: micro-batches of
    # disjoint sampling requests (a running request whose sampled token is still in flight waits for it)
    pipeline_depth: int = 1


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    enforce_eager: bool
    cuda_graph_sizes: list[int] | None
    max_cuda_graph_batch: int
    seed: int = 0
    async_scheduling: bool = False
    speculative_config: Any = None            # hayabusa.spec_decode.SpeculativeConfig, or None (off)
    draft_model_config: Any = None            # the draft's ModelConfig ("draft_model"), or EagleHeadConfig ("eagle[3]")
    extra: dict = field(default_factory=dict)
    parallel_config: Any = None   # hayabusa.distributed.config.ParallelConfig (None: one process, no ranks)
