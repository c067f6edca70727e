"""Run one workload on one engine: hayabusa (``LLM.generate``) or the HF Transformers baseline (``generate``).

Both return a ``RunResult`` with the same token accounting: prompt tokens once per request, output tokens = the
generated ids of every sample, each cut at the request's max_tokens. Times exclude a short warm-up (a few
requests of the same lengths with fresh random ids, 2 output tokens; W1P: 10 requests of its full lengths, which
preempt) so one-off JIT / autotune costs do not land in the measurement; preemption and CPU-tier counters in
``extra`` are the timed run's; startup_s is the wall time of engine construction (``LLM(...)`` / ``from_pretrained``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from hayabusa.bench.common import is_cuda, load_hf_model, peak_memory_bytes, reset_peak_memory, synchronize
from hayabusa.bench.workloads import BenchRequest, Workload, image_chat_messages, token_range

WARMUP_REQUESTS = 4
WARMUP_TOKENS = 2


@dataclass
class RunResult:
    """What one timed run measured. Times in seconds unless the name says ms."""

    elapsed_s: float                 # first request submitted -> last request finished
    num_requests: int
    num_sequences: int               # requests x n
    prompt_tokens: int
    output_tokens: int
    startup_s: float                 # engine construction (wall)
    ttft_ms: float | None = None     # median over requests, from submission of the whole batch
    tpot_ms: float | None = None     # median over sequences of (last - first token time) / (tokens - 1)
    tpot_mean_ms: float | None = None   # their mean (vLLM's bench prints both; W11's gain sits in some requests)
    peak_memory_bytes: int | None = None   # torch.cuda.max_memory_allocated since construction; None on CPU
    kv_cache_tokens: int | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def warmup_requests(workload: Workload, engine_warmup: bool = False) -> list[BenchRequest]:
    """Up to WARMUP_REQUESTS greedy requests with the workload's first prompt lengths and fresh ids (seed 1),
    WARMUP_TOKENS output tokens each (fresh ids so a prefix cache is not primed with the workload's prompts).

    ``engine_warmup=True`` (hayabusa's warm-up) and ``workload.warmup_requests`` = N > 0 (W1P): the first N
    requests' prompt lengths and their full max_tokens instead, with fresh ids, so the warm-up goes where the timed
    run goes (W1P: past the GPU cache, through preemption)."""
    rng = np.random.default_rng(1)
    if engine_warmup and workload.warmup_requests:
        lo, hi = token_range(workload.vocab_size)
        return [BenchRequest(rng.integers(lo, hi, size=len(r.prompt_token_ids)).tolist(), r.max_tokens)
                for r in workload.requests[:workload.warmup_requests]]
    reqs = workload.requests[:WARMUP_REQUESTS]
    if workload.has_images:   # fresh pixels of the same sizes (a prefix cache keyed by image content misses them)
        return [BenchRequest([], min(WARMUP_TOKENS, r.max_tokens), text=r.text,
                             images=[rng.integers(0, 256, im.shape, dtype=np.uint8) for im in r.images or []])
                for r in reqs]
    if workload.has_text:     # W11: short text of another document (its lines are not in the prefix cache)
        return [BenchRequest([], min(WARMUP_TOKENS, r.max_tokens), text=f"Copy this line: warm-up line {i}.",
                             answer_prefix="warm-up") for i, r in enumerate(reqs)]
    # Workloads whose prompts share a prefix (W5) warm up with a shared fresh prefix of the same length, so the
    # prefill of a request that hits the prefix cache (new tokens attending to cached ones) is warm as well.
    shared = _common_prefix_len([r.prompt_token_ids for r in reqs]) if len(reqs) > 1 else 0
    lo, hi = token_range(workload.vocab_size)
    prefix = rng.integers(lo, hi, size=shared).tolist()
    return [BenchRequest(prefix + rng.integers(lo, hi, size=len(r.prompt_token_ids) - shared).tolist(),
                         min(WARMUP_TOKENS, r.max_tokens))
            for r in reqs]


def _common_prefix_len(prompts: list[list[int]]) -> int:
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts[1:]):
            return i
    return n


# ---------------------------------------------------------------------------------------------------- hayabusa
def _sampling_params(r: BenchRequest, structured_output: str | None = None) -> Any:
    from hayabusa import SamplingParams

    constraint = None
    if structured_output == "json":   # the bundled extraction schema on every request
        from hayabusa.sampling_params import StructuredOutputsParams
        from hayabusa.structured_output.schemas import load_schema

        constraint = StructuredOutputsParams(json=load_schema("receipt"))
    return SamplingParams(n=r.n, temperature=r.temperature, seed=r.seed, max_tokens=r.max_tokens,
                          ignore_eos=True, detokenize=False, structured_outputs=constraint)


def _chat_text(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The chat template's text of ``messages`` (generation prompt added). Raises HayabusaValidationError naming
    ``model`` when the tokenizer has no chat template (W8 and W11 are chat workloads)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except ValueError as e:
        if "chat_template" not in str(e) and "chat template" not in str(e):
            raise
        from hayabusa.errors import HayabusaValidationError

        raise HayabusaValidationError(
            f"this workload renders its prompts with the model's chat template, and the tokenizer "
            f"({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')}) has none: use an instruct / "
            f"chat checkpoint (W11: a trained one, e.g. SmolLM2-135M-Instruct from "
            f"../shared/assets/tools/get_smollm2.sh) or give --tokenizer DIR with a chat template",
            parameter="model", value=getattr(tokenizer, "name_or_path", None)) from e


def bench_prompts(tokenizer: Any, reqs: list[BenchRequest]) -> list[dict[str, Any]]:
    """The engine prompts of `reqs`: token ids, or for an image request the chat template's text over its
    message (``image_chat_messages``) with ``multi_modal_data`` = its images as RGB PIL images."""
    out: list[dict[str, Any]] = []
    for r in reqs:
        if r.text and not r.images:   # W11: chat template over the text, then the answer's first words
            text = _chat_text(tokenizer, [{"role": "user", "content": r.text}])
            out.append({"prompt": text + (r.answer_prefix or "")})
            continue
        if not r.images:
            out.append({"prompt_token_ids": r.prompt_token_ids})
            continue
        from PIL import Image

        text = _chat_text(tokenizer, image_chat_messages(r))
        out.append({"prompt": text, "multi_modal_data": {"image": [Image.fromarray(a) for a in r.images]}})
    return out


def _generate(llm: Any, reqs: list[BenchRequest], use_tqdm: bool, structured_output: str | None = None,
              prompts: list[dict[str, Any]] | None = None) -> list[Any]:
    prompts = prompts or bench_prompts(llm.get_tokenizer(), reqs)
    return llm.generate(prompts, [_sampling_params(r, structured_output) for r in reqs], use_tqdm=use_tqdm)


def _engine_latencies(outs: list[Any], t_start: float) -> tuple[list[float], list[float]]:
    """(TTFT ms per request from t_start, TPOT ms per request) from RequestOutput.metrics (time.monotonic)."""
    ttft, tpot = [], []
    for o in outs:
        m = getattr(o, "metrics", None)
        if m is None or m.first_token_time is None:
            continue
        ttft.append(1e3 * (m.first_token_time - t_start))
        n = max(len(c.token_ids) for c in o.outputs)
        if n > 1 and m.last_token_time is not None:
            tpot.append(1e3 * (m.last_token_time - m.first_token_time) / (n - 1))
    return ttft, tpot


def model_weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers as held on the device (quantized weights at their packed size,
    scales included; the KV cache is not part of the model)."""
    return int(sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())))


def payoff_state(buckets: dict[Any, dict[str, Any]]) -> str:
    """The measured turn-off rule's state (``extra["spec_decode_payoff"]``: per batch-size bucket, ``speculating``,
    ``spec_steps``, ``plain_steps`` since the engine started) as "batch<=B spec|off (S spec / P plain steps), ...",
    buckets in ascending order (keys may be ints or their strings); "" for no buckets."""
    return ", ".join(f"batch<={b} {'spec' if st['speculating'] else 'off'} ({st['spec_steps']} spec / "
                     f"{st['plain_steps']} plain steps)"
                     for b, st in sorted(buckets.items(), key=lambda kv: int(kv[0])))


def _engine_notes(llm: Any, engine_args: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    engine = llm.llm_engine
    notes: list[str] = []
    kv = engine.kv_cache_manager
    graphs = getattr(engine.runner, "graphs", None)
    extra = {"engine_startup_s": round(getattr(engine, "startup_seconds", float("nan")), 3),
             "cuda_graphs": len(getattr(graphs, "sizes", []) or []) if graphs is not None else 0,
             "mixed_cuda_graphs": len(getattr(graphs, "mixed_graphs", {}) or {}) if graphs is not None else 0,
             "mixed_graph_replays": getattr(graphs, "num_mixed_replays", 0) if graphs is not None else 0,
             "cuda_graph_capture_s": round(getattr(graphs, "capture_seconds", 0.0), 3) if graphs else None,
             "num_steps": engine.stats.get("num_steps") if hasattr(engine, "stats") else None,
             "enable_prefix_caching": kv.enable_prefix_caching,
             "prefix_cache_hit_rate": round(kv.prefix_hit_rate, 4),
             "num_preemptions": engine.scheduler.num_preemptions,
             "num_swap_preemptions": getattr(engine.scheduler, "num_swap_preemptions", 0),
             **(kv.swap_stats() if hasattr(kv, "swap_stats") else {}),
             "weight_bytes": model_weight_bytes(engine.runner.model)}
    spec = engine.config.speculative_config
    if spec is not None:     # speculative decoding: counters since start (warm-up included)
        m = engine.get_metrics()
        drafted, accepted = m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]
        extra.update(speculative_config=dataclasses.asdict(spec), spec_decode_num_draft_tokens=drafted,
                     spec_decode_num_accepted_tokens=accepted,
                     spec_decode_acceptance_rate=round(accepted / drafted, 4) if drafted else None)
        notes.append(f"speculative decoding: {spec.method}, k={spec.num_speculative_tokens}, acceptance "
                     f"{accepted}/{drafted}")
        payoff = getattr(engine.scheduler.spec, "payoff", None)
        if payoff is not None:   # the measured turn-off rule: per batch-size bucket, its mode, steps and rates
            buckets = payoff.snapshot()
            extra["spec_decode_payoff"] = {str(b): st for b, st in buckets.items()}
            notes.append("disable_by_payoff: " + payoff_state(buckets))
    off = getattr(engine.runner, "offloader", None)
    if off is not None:      # cpu_offload_gb: weights streamed from CPU memory each forward
        extra.update(offloaded_layers=len(off.layer_indices), offloaded_bytes=off.offloaded_bytes,
                     offload_ring_bytes=off.ring_bytes, gpu_weight_bytes=extra["weight_bytes"] - off.saved_bytes)
        notes.append(f"cpu_offload_gb: {len(off.layer_indices)} of {off.num_layers} decoder layers "
                     f"({off.offloaded_bytes / 2**30:.2f} GiB) streamed from CPU memory each forward")
    encdec = getattr(engine.runner, "encdec", None)
    if encdec is not None:   # encoder-decoder (T5): encoder tokens run, warm-up included
        extra["encoder_tokens"] = encdec.num_encoder_tokens
    return notes, extra


# Engine counters of preemption and of the CPU tier that `extra` reports for the timed run alone (the warm-up's
# share under "warmup_" + name): W1P's warm-up preempts too.
TIMED_COUNTERS = ("num_preemptions", "num_swap_preemptions", "num_blocks_swapped_out", "num_blocks_swapped_in",
                  "cpu_prefix_cache_hit_blocks", "num_blocks_written_through")


def tier_counters(engine: Any) -> dict[str, int]:
    """The engine's TIMED_COUNTERS now (cumulative since construction; a counter the engine lacks is 0)."""
    kv = engine.kv_cache_manager
    out = {"num_preemptions": engine.scheduler.num_preemptions,
           "num_swap_preemptions": getattr(engine.scheduler, "num_swap_preemptions", 0),
           **(kv.swap_stats() if hasattr(kv, "swap_stats") else {})}
    return {k: int(out.get(k, 0)) for k in TIMED_COUNTERS}


def timed_counters(before: dict[str, int], after: dict[str, int],
                   warmup: dict[str, int] | None = None) -> dict[str, int]:
    """``{name: after - before}`` for the timed run, plus ``{"warmup_" + name: count}`` where the warm-up's count
    (``warmup``, default ``before``: the counters when the first timed run started) is not 0."""
    out = {k: after[k] - before[k] for k in TIMED_COUNTERS}
    out.update({f"warmup_{k}": v for k, v in (before if warmup is None else warmup).items() if v})
    return out


def step_time_breakdown(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The timed run's engine steps and host seconds (engine ``stats`` after minus before): scheduling, launching
    (input preparation and queueing), waiting for the device, collecting outputs. On a GPU ``wait_s`` is the time
    the host sat idle on the device; when it is small against the rest, the run was host-bound. On CPU the forward
    runs synchronously inside launch, so ``wait_s`` is ~0 and ``launch_s`` includes the model's compute: the split
    says nothing about host- vs device-bound there."""
    out: dict[str, Any] = {"timed_steps": after.get("num_steps", 0) - before.get("num_steps", 0)}
    if "num_overlapped_steps" in after:   # steps scheduled while the previous one was in flight (async)
        out["overlapped_steps"] = after["num_overlapped_steps"] - before.get("num_overlapped_steps", 0)
    for key in ("schedule_s", "launch_s", "wait_s", "collect_s"):
        if key in after:
            out["host_" + key] = round(after[key] - before.get(key, 0.0), 4)
    return out


def run_hayabusa(model_dir: str, workload: Workload, engine_args: dict[str, Any], warmup: bool = True,
                 use_tqdm: bool = True, structured_output: str | None = None, repeats: int = 1) -> RunResult:
    """Construct ``LLM(model_dir, **engine_args)``, warm up, and time ``generate`` over the workload.

    ``structured_output="json"``: every request is constrained to the bundled receipt schema (a constrained
    request ends when its JSON is complete, so outputs may be shorter than max_tokens; compare tokens/s). The
    warm-up compiles the grammar; its compile time is reported in ``extra["grammar_compile_s"]``.

    ``repeats`` = N > 1: the workload is timed N times on the one engine, the prefix cache reset before each run
    after the first (so no run finds another's prompts cached; state the engine keeps on purpose, such as
    speculative decoding's measured turn-off rule, carries over). The result is the run of median elapsed time (for
    even N the faster of the two middle runs), and ``extra`` lists every run's ``repeat_elapsed_s`` and
    ``repeat_output_throughput``. A workload of about a second (W1 on a small model) swings by 10-20 % between
    runs; its median is the claim. The run's preemption / tier counters are its own, the ``warmup_*`` ones the
    warm-up's; ``prefix_cache_hit_rate`` and speculative decoding's acceptance counts are the engine's since it
    started (all runs).

    The engine is deleted (and CUDA memory released) before returning, so sweeps can build the next one.

    Raises:
        ValueError: ``repeats`` < 1.
    """
    from hayabusa import LLM

    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1 (how many timed runs of the workload)")
    cuda = is_cuda(engine_args.get("device"))
    reset_peak_memory(cuda)
    t0 = time.perf_counter()
    llm = LLM(model_dir, **engine_args)
    startup_s = time.perf_counter() - t0
    try:
        if warmup and workload.name != "startup":
            warm = warmup_requests(workload, engine_warmup=True)
            # the first request alone: the others then hit its cached prefix (W1P: all at once, to preempt)
            parts = [warm] if workload.warmup_requests else [warm[:1], warm[1:]]
            for part in parts:
                if part:
                    _generate(llm, part, use_tqdm=False, structured_output=structured_output)
        prompts = bench_prompts(llm.get_tokenizer(), workload.requests)   # templates and PIL images: not timed
        runs: list[_TimedRun] = []
        for i in range(repeats):
            if i and not llm.reset_prefix_cache():
                raise RuntimeError("repeats: the prefix cache could not be reset between runs (requests still "
                                   "running); rerun with --repeats 1")
            runs.append(_timed_run(llm, workload, cuda, use_tqdm, structured_output, prompts))
        run = sorted(runs, key=lambda r: r.elapsed_s)[(repeats - 1) // 2]
        outs = run.outputs
        notes, extra = _engine_notes(llm, engine_args)
        extra.update(step_time_breakdown(run.stats_before, run.stats_after))
        extra.update(timed_counters(run.counters_before, run.counters_after, warmup=runs[0].counters_before))
        if repeats > 1:
            extra.update(repeats=repeats, repeat_elapsed_s=[round(r.elapsed_s, 6) for r in runs],
                         repeat_output_throughput=[round(_output_tokens(r.outputs) / r.elapsed_s, 2) for r in runs])
        if structured_output:
            extra["structured_output"] = structured_output
            extra["grammar_compile_s"] = sum(llm.llm_engine.structured_output.compile_seconds.values())
            notes.append(f"structured output: {structured_output} (bundled receipt schema on every request)")
        return RunResult(
            elapsed_s=run.elapsed_s, num_requests=len(outs), num_sequences=sum(len(o.outputs) for o in outs),
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
            output_tokens=_output_tokens(outs), startup_s=startup_s,
            ttft_ms=_median(run.ttft), tpot_ms=_median(run.tpot), tpot_mean_ms=_mean(run.tpot),
            peak_memory_bytes=peak_memory_bytes(cuda),
            kv_cache_tokens=int(llm.llm_engine.kv_cache_capacity_tokens), notes=notes, extra=extra)
    finally:
        del llm
        reset_peak_memory(cuda)


class _TimedRun(NamedTuple):
    elapsed_s: float
    outputs: list[Any]
    ttft: list[float]
    tpot: list[float]
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    counters_before: dict[str, int]
    counters_after: dict[str, int]


def _output_tokens(outs: list[Any]) -> int:
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


def _timed_run(llm: Any, workload: Workload, cuda: bool, use_tqdm: bool, structured_output: str | None,
               prompts: Any) -> _TimedRun:
    """One timed ``generate`` over the workload, with the engine's stats and tier counters before and after."""
    synchronize(cuda)
    stats0 = dict(llm.llm_engine.stats)
    counters0 = tier_counters(llm.llm_engine)
    t_mono, t1 = time.monotonic(), time.perf_counter()
    outs = _generate(llm, workload.requests, use_tqdm, structured_output, prompts)
    synchronize(cuda)
    elapsed = time.perf_counter() - t1
    ttft, tpot = _engine_latencies(outs, t_mono)
    return _TimedRun(elapsed, outs, ttft, tpot, stats0, dict(llm.llm_engine.stats), counters0,
                     tier_counters(llm.llm_engine))


# ---------------------------------------------------------------------------------------------------- HF
@dataclass
class _Seq:
    request_index: int
    prompt: list[int]
    max_tokens: int
    temperature: float


def _expand(reqs: list[BenchRequest]) -> list[_Seq]:
    """One sequence per sample: a request with n samples becomes n sequences (HF num_return_sequences)."""
    return [_Seq(i, r.prompt_token_ids, r.max_tokens, r.temperature) for i, r in enumerate(reqs) for _ in range(r.n)]


def _clock_criteria(cuda: bool, times: list[float]) -> Any:
    """A StoppingCriteria that never stops and records the time each new token exists (after a sync)."""
    from transformers import StoppingCriteria

    class _Clock(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            synchronize(cuda)
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return _Clock()


def _hf_batch(model: Any, seqs: list[_Seq], device: torch.device, pad_id: int = 0
              ) -> tuple[list[list[int]], list[float], float]:
    """Generate a left-padded batch. Returns (output ids per sequence cut at its max_tokens, token times, start)."""
    from transformers import StoppingCriteriaList

    width = max(len(s.prompt) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - len(s.prompt):] = torch.tensor(s.prompt)
        mask[row, width - len(s.prompt):] = 1
    temps = {s.temperature for s in seqs}
    assert len(temps) == 1, "one temperature per HF batch"
    temp = temps.pop()
    new = max(s.max_tokens for s in seqs)
    kw: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id)
    kw.update(dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp > 0 else dict(do_sample=False))
    times: list[float] = []
    cuda = device.type == "cuda"
    synchronize(cuda)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device),
                             stopping_criteria=StoppingCriteriaList([_clock_criteria(cuda, times)]), **kw)
    # encoder-decoder (T5): the prompt is the encoder input; the output is the decoder's, after its start token
    out = out[:, 1 if model.config.is_encoder_decoder else width:].tolist()
    return [o[: s.max_tokens] for o, s in zip(out, seqs)], times, start


def _hf_import(model_dir: str) -> None:
    """Import the model's transformers module now, so startup_s times loading, not Python imports."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING)

    cfg = AutoConfig.from_pretrained(model_dir)
    mapping = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING if cfg.is_encoder_decoder else MODEL_FOR_CAUSAL_LM_MAPPING
    mapping[type(cfg)]


def run_hf(model_dir: str, workload: Workload, batch_size: int | None = None, dtype: str | None = None,
           device: str | None = None, seed: int = 0, warmup: bool = True, use_tqdm: bool = True) -> RunResult:
    """Time HF ``generate`` over the workload in consecutive left-padded batches of `batch_size` sequences
    (default: all sequences at once, 1 for W3), greedy or sampled as the workload says, EOS suppressed by
    ``min_new_tokens = max_new_tokens``. A batch runs to its longest max_tokens; shorter requests keep only their
    own max_tokens ids (the extra steps are in the time: that is static batching's cost)."""
    dev = torch.device(device if device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    _hf_import(model_dir)
    reset_peak_memory(cuda)
    t0 = time.perf_counter()
    model = load_hf_model(model_dir, dtype, dev)
    startup_s = time.perf_counter() - t0
    torch.manual_seed(seed)
    try:
        if warmup and workload.name != "startup":
            _hf_batch(model, _expand(warmup_requests(workload))[:1], dev)
        reqs = workload.requests
        if batch_size == 1 and workload.hf_batch1_requests:   # W9: batch 1 over all 2,000 would take an hour
            reqs = reqs[:workload.hf_batch1_requests]
        seqs = _expand(reqs)
        bs = batch_size or len(seqs)
        batches = [seqs[i: i + bs] for i in range(0, len(seqs), bs)]
        if use_tqdm and len(batches) > 1:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc=f"HF {workload.name} batches of {bs}", dynamic_ncols=True)
        outputs, ttft, tpot, elapsed = _hf_run_batches(model, batches, dev)
        first_by_request: dict[int, float] = {}
        for s, t in zip(seqs, ttft):
            first_by_request[s.request_index] = min(t, first_by_request.get(s.request_index, t))
        return RunResult(
            elapsed_s=elapsed, num_requests=len(reqs), num_sequences=len(seqs),
            prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs), output_tokens=sum(len(o) for o in outputs),
            startup_s=startup_s, ttft_ms=_median(list(first_by_request.values())), tpot_ms=_median(tpot),
            tpot_mean_ms=_mean(tpot), peak_memory_bytes=peak_memory_bytes(cuda), kv_cache_tokens=None,
            extra={"hf_batch_size": bs, "attn_implementation": "sdpa", "dtype": str(model.dtype)})
    finally:
        del model
        reset_peak_memory(cuda)


def _hf_run_batches(model: Any, batches: Any, dev: torch.device
                    ) -> tuple[list[list[int]], list[float], list[float], float]:
    """Run batches back to back. Returns (outputs per sequence, TTFT ms per sequence from the start of the
    first batch, TPOT ms per sequence, elapsed s)."""
    outputs: list[list[int]] = []
    ttft: list[float] = []
    tpot: list[float] = []
    synchronize(dev.type == "cuda")
    t_start = time.perf_counter()
    for batch in batches:
        outs, times, _ = _hf_batch(model, batch, dev)
        outputs.extend(outs)
        for s in batch:
            ttft.append(1e3 * (times[0] - t_start))
            if s.max_tokens > 1:
                tpot.append(1e3 * (times[s.max_tokens - 1] - times[0]) / (s.max_tokens - 1))
    return outputs, ttft, tpot, time.perf_counter() - t_start
