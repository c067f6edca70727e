"""LLMEngine: add_request / abort_request / step() -- the one place that calls the parts in order."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import time
from operator import itemgetter
from typing import Any

import torch

from hayabusa.config import EngineArgs, EngineConfig
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request, RequestStatus
from hayabusa.core.scheduler import Scheduler
from hayabusa.engine.encoder_decoder_inputs import output_prompt, process_encoder_decoder
from hayabusa.engine.input_processor import InputProcessor, PromptType
from hayabusa.engine.output_processor import OutputProcessor
from hayabusa.errors import HayabusaValidationError
from hayabusa.multimodal.processor import make_mm_processor
from hayabusa.outputs import RequestOutput
from hayabusa.sampling_params import SamplingParams
from hayabusa.structured_output import StructuredOutputManager
from hayabusa.executor import make_executor
from hayabusa.metrics_reader import Counter, Gauge, Metric, MetricsList, Vector

logger = logging.getLogger(__name__)


_TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "special_tokens_map",
                            "added_tokens", "tekken")


def _is_tokenizer_file(name: str) -> bool:
    """Whether a file name is one transformers reads a tokenizer from (tokenizer.json / tokenizer_config.json,
    vocab.json + merges.txt, vocab.txt, SentencePiece / tiktoken models, ...)."""
    return name.startswith(_TOKENIZER_FILE_PREFIXES) or name.endswith((".model", ".tiktoken"))


def load_tokenizer(path: str, trust_remote_code: bool, revision: str | None = None) -> Any:
    """The checkpoint's tokenizer (transformers AutoTokenizer). Raises HayabusaValidationError naming ``tokenizer``
    when there is none to load (e.g. a `hayabusa bench --make-model` checkpoint), with the two ways around it."""
    from transformers import AutoTokenizer

    try:
        if os.path.isdir(path) and not any(_is_tokenizer_file(name) for name in os.listdir(path)):
            # transformers 5 then builds a tokenizer from config.json's model_type alone: for T5 one of 104
            # special tokens (pad, eos, unk, 100 sentinels) that turns every word into <unk>
            raise ValueError("the folder has no tokenizer files")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
        if len(tokenizer) <= 1:
            # transformers 5 builds an empty tokenizer from config.json's model_type alone when the folder has no
            # tokenizer files: every text would become unknown ids and every grammar would allow nothing
            raise ValueError("the folder has no tokenizer files (transformers made an empty vocabulary)")
        return tokenizer
    except (OSError, ValueError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HayabusaValidationError(
            f"cannot load a tokenizer from {path!r} ({why}); give one with tokenizer=... (--tokenizer DIR), or "
            "skip_tokenizer_init=True (--skip-tokenizer-init) and send token ids.", parameter="tokenizer",
            value=path) from None


def as_request_id(request_id: Any) -> str:
    """A request id as the engine keys it: ``str(request_id)``, so any id works that vLLM takes (a ``uuid.UUID``,
    an int, ...) and the same object finds the request again (abort). Outputs carry the str form.

    Raises:
        HayabusaValidationError: the id's str form is empty.
    """
    rid = str(request_id)
    if not rid:
        raise HayabusaValidationError("request_id must be non-empty (any value whose str() is non-empty).",
                                      parameter="request_id", value=request_id)
    return rid


class RateLimitedLog:
    """Logs a message the first time, then at most once per ``interval`` seconds while the same message repeats,
    saying how many were left out (an engine that fails the same way on every pass must not flood the log).

    Args:
        logger: where to log.
        interval: seconds between two lines of the same message.
    """

    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}   # message -> (time logged, repeats left out since)

    def log(self, level: int, msg: str, exc_info: BaseException | None = None) -> bool:
        """Log ``msg`` (with the traceback of ``exc_info`` the first time) unless it was logged less than
        ``interval`` seconds ago. Returns whether a line was written."""
        now = time.monotonic()
        last = self._last.get(msg)
        if last is not None and now - last[0] < self.interval:
            self._last[msg] = (last[0], last[1] + 1)
            return False
        if len(self._last) > 256:
            self._last.clear()
        repeats = last[1] if last is not None else 0
        self._last[msg] = (now, 0)
        suffix = f" (and {repeats} more times in the last {self.interval:.0f} s)" if repeats else ""
        self.logger.log(level, msg + suffix, exc_info=exc_info if last is None else None)
        return True


def as_request_ids(request_ids: Any) -> list[str]:
    """One id or a collection of them (list, tuple, set) -> their str forms (see as_request_id)."""
    ids = request_ids if isinstance(request_ids, (list, tuple, set, frozenset)) else [request_ids]
    return [str(r) for r in ids]


class LLMEngine:
    """The synchronous engine.

    A step: ``Scheduler.schedule()`` -> ``ModelRunner.execute_model()`` -> ``Scheduler.update_from_output()`` ->
    ``OutputProcessor.process()`` (text, stop strings, n > 1 fan-in). Bad requests are rejected in
    ``add_request`` with a HayabusaValidationError and never reach the scheduler.

    Args:
        config: resolved engine config (``EngineArgs.create_engine_config()``).
    """

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        mc = config.model_config
        torch.manual_seed(config.seed)  # default generator for unseeded requests (CPU and CUDA)
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(
            mc.tokenizer, mc.trust_remote_code, mc.tokenizer_revision)
        self.runner = make_executor(config)   # the ModelRunner itself on one device; else worker processes
        self.num_blocks = self.runner.initialize_kv_cache()
        self.kv_cache_manager = KVCacheManager(self.num_blocks, config.cache_config.block_size,
                                               config.cache_config.enable_prefix_caching,
                                               num_cpu_blocks=self.runner.num_cpu_blocks)
        if config.cache_config.swap_space_bytes and not self.runner.num_cpu_blocks:
            logger.warning("swap_space=%.4g GiB holds no KV block of this model: the CPU KV tier is off (preempted "
                           "requests are recomputed, evicted prefixes are dropped); raise swap_space to use it.",
                           config.cache_config.swap_space_bytes / 2**30)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        if config.speculative_config is not None:
            from hayabusa.spec_decode.scheduling import SpecDecodeScheduling

            self.scheduler.spec = SpecDecodeScheduling(config.speculative_config,
                                                       config.scheduler_config.max_model_len)
        self.input_processor = InputProcessor(mc, self.tokenizer, make_mm_processor(mc))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, mc.vocab_size)
        self.startup_seconds = time.perf_counter() - t0
        # Token counters, and where a step's host time goes (seconds, summed over steps): scheduling, preparing
        # and queueing the device work, waiting for the device (the step's one sync), and turning tokens into
        # outputs. Little wait time means the device was starved (host-bound), not the other way round.
        self.stats = {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_steps": 0, "schedule_s": 0.0,
                      "launch_s": 0.0, "wait_s": 0.0, "collect_s": 0.0,
                      "num_overlapped_steps": 0}   # steps scheduled while the previous one was still in flight
        self.async_scheduling = config.async_scheduling
        self._pending = None                 # (SchedulerOutput, StepHandle) launched but not collected
        # pipeline_parallel_size M > 1: up to M steps in flight, oldest first (see _step_pipelined)
        self.pipeline_depth = config.scheduler_config.pipeline_depth
        self._in_pipeline: collections.deque = collections.deque()
        self.most_steps_in_flight = 0        # the most steps that were in flight at once
        self._collecting = None              # the SchedulerOutput whose results are being collected
        self.error_log = RateLimitedLog(logger)
        # speculative decoding's measured turn-off rule (spec_decode/payoff.py): each step's wall time, from its
        # schedule (or the previous step's collection, when later: steps overlap with async scheduling) to its
        # collected output, goes to the scheduler (record_step_time). ``clock``: seconds, injectable for tests.
        self.clock = time.perf_counter
        spec = self.scheduler.spec
        self._measure_steps = spec is not None and spec.payoff is not None
        self._step_start: dict[int, float] = {}   # step_id -> clock() before it was scheduled
        self._last_collect_end = float("-inf")
        logger.info("engine ready in %.2f s: %d KV blocks x %d tokens", self.startup_seconds, self.num_blocks,
                    config.cache_config.block_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Tokens the KV cache can hold."""
        return self.num_blocks * self.config.cache_config.block_size

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: Any, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, output_kind: str = "cumulative") -> None:
        """Validate and queue a request (n > 1 becomes n child requests sharing the prompt).

        request_id: any value whose ``str()`` is non-empty (a str, a ``uuid.UUID``, ...); the request is keyed
        and reported (``RequestOutput.request_id``) by that str, so abort_request with the same object finds it.

        output_kind: "cumulative" (step() returns the request's output so far whenever it changes), "delta" (what
        changed since the last output: RequestOutputKind.DELTA) or "final" (only once finished; text is then
        detokenized once at the end unless stop strings need it earlier).

        Raises:
            HayabusaValidationError: bad prompt or params, or an empty or duplicate request_id; nothing is queued then.
        """
        request_id = as_request_id(request_id)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise HayabusaValidationError("sampling_params must be a SamplingParams.", parameter="sampling_params",
                                          value=type(params).__name__)
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self._check_request_ids(request_id, child_ids)
        encoder_ids, encoder_text, mm_inputs = None, None, []
        if self.config.model_config.is_encoder_decoder:   # T5: the prompt is the encoder input
            encoder_text, ids, encoder_ids = process_encoder_decoder(self.input_processor, prompt, params)
            text = output_prompt(prompt, encoder_text)    # vLLM's: the decoder prompt's text (explicit form)
        else:
            text, ids, mm_inputs = self.input_processor.process_multimodal(prompt, params)
        max_tokens = self.input_processor.max_tokens(len(ids), params)
        eos = self.config.model_config.eos_token_ids
        # checked now (a bad schema is refused before anything is queued); compiled off the step's path
        grammar = None if params.structured_outputs is None else self.structured_output.grammar(
            params.structured_outputs)
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            child_params.all_stop_token_ids = set(child_params.stop_token_ids)
            child_params.bad_words_token_ids = params.bad_words_token_ids   # read-only, shared by the n samples
            child = Request(child_ids[i], ids, child_params, eos, max_tokens, arrival_time)
            child.encoder_prompt_token_ids = encoder_ids
            child.mm_inputs = mm_inputs     # shared by the n samples (read-only plain data)
            if grammar is not None:
                child.structured = self.structured_output.make_request(grammar, eos)
            children.append(child)
        self.output_processor.add_request(request_id, text, ids, params, children, output_kind,
                                          encoder_prompt=encoder_text)
        for child in children:
            self.scheduler.add_request(child)
        self.stats["num_prompt_tokens"] += len(ids)

    def _check_request_ids(self, request_id: str, child_ids: list[str]) -> None:
        """Refuse a request_id that is in use, or whose internal ids (``{i}_{request_id}`` for n > 1) are: every
        id of a request in flight, a user's or an internal one, names one request only.

        Raises:
            HayabusaValidationError: naming ``request_id``.
        """
        states, children, live = self.output_processor.states, self.output_processor.child_to_parent, \
            self.scheduler.requests
        if request_id in states or request_id in children or request_id in live:
            raise HayabusaValidationError(f"request_id {request_id!r} is already in use.", parameter="request_id",
                                          value=request_id)
        for cid in child_ids:
            if cid != request_id and (cid in states or cid in children or cid in live):
                raise HayabusaValidationError(
                    f"request_id {request_id!r} with n={len(child_ids)} needs the internal id {cid!r} for its "
                    f"sample {child_ids.index(cid)}, and a request in flight already uses that id; choose another "
                    "request_id.", parameter="request_id", value=request_id)

    def abort_request(self, request_ids: Any) -> list[RequestOutput]:
        """Abort requests (by the ids given to add_request, compared as str); their blocks are freed. Unknown ids
        are ignored."""
        request_ids = as_request_ids(request_ids)
        outs = []
        for rid in request_ids:
            state = self.output_processor.states.get(rid)
            if state is None:
                continue
            self._finish_children([s.request.request_id for s in state.samples], RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.abort(rid)
            if out is not None:
                outs.append(out)
        return outs

    def abort_all_after_error(self) -> list[str]:
        """Recover from a step that raised or was interrupted (an exception, Ctrl-C): forget the step in flight
        and abort every unfinished request, freeing its blocks, so the engine serves new requests. Requests that
        were mid-step may have advanced their state without their tokens; aborting them is the only consistent
        way on. Returns the aborted request ids."""
        self._pending = None
        self._in_pipeline.clear()
        self._collecting = None
        self.scheduler.forget_in_flight()
        self._step_start.clear()
        self.runner.forget_previous_step()
        ids = list(self.output_processor.states)
        self.abort_request(ids)
        self._abort_orphans()
        return ids

    def abort_after_failed_step(self) -> list[str]:
        """Recover from a step that raised, failing only the requests it must: the running ones (the batch the
        step was working on), those in a step scheduled but not collected (their state advanced without their
        tokens), and any the scheduler holds without an output state. Waiting requests that no step has touched
        since they were admitted or preempted go on, unless there is no such request to blame: then every request
        is aborted (a step that fails before it touches any request would otherwise fail on every pass). Returns
        the aborted request ids (as given to add_request)."""
        suspects = set(self.scheduler.in_flight_request_ids())
        suspects.update(r.request_id for r in self.scheduler.running)
        suspects.update(r.request_id for r in self.scheduler.waiting if r.num_output_placeholders)
        if self._collecting is not None:
            suspects.update(self._collecting.scheduled_req_ids)
        self._pending = None
        self._in_pipeline.clear()
        self._collecting = None
        self.scheduler.forget_in_flight()
        self._step_start.clear()
        self.runner.forget_previous_step()
        child_to_parent = self.output_processor.child_to_parent
        parents = list(dict.fromkeys(child_to_parent[c] for c in suspects if c in child_to_parent))
        if not parents:
            parents = list(self.output_processor.states)
        self.abort_request(parents)
        self._abort_orphans()
        return parents

    def _abort_orphans(self) -> None:
        """Finish scheduler requests that no output state refers to (nothing could ever end them)."""
        orphans = [rid for rid in self.scheduler.requests if rid not in self.output_processor.child_to_parent]
        if orphans:
            self.scheduler.finish_requests(orphans, RequestStatus.FINISHED_ABORTED)

    def shutdown(self) -> None:
        """End the worker processes (tensor_parallel_size > 1; they also end at interpreter exit). Idempotent."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Encode prompts and decode outputs with ``tokenizer`` from now on (requests in flight keep theirs)."""
        self.tokenizer = tokenizer
        self.input_processor.tokenizer = tokenizer
        self.output_processor.tokenizer = tokenizer
        # grammars compile against the tokenizer's vocabulary: a fresh manager for the new one
        self.structured_output = StructuredOutputManager(tokenizer, self.config.model_config.vocab_size)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_metrics(self) -> MetricsList:
        """Engine-wide metrics since start, as vLLM's ``LLMEngine.get_metrics()`` gives them: a list of
        ``hayabusa.metrics_reader`` Counter / Gauge / Vector objects (labels ``model_name``, ``engine="0"``):

        - Counters (int): ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:num_preemptions``;
          ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (prompt tokens looked up / found in the
          prefix cache); with the CPU KV tier (``swap_space``) ``hayabusa:num_swap_preemptions`` (preemptions whose
          KV went to the CPU), ``hayabusa:kv_blocks_swapped_out`` / ``hayabusa:kv_blocks_swapped_in`` (KV blocks
          copied GPU -> CPU / back), ``hayabusa:cpu_prefix_cache_hits`` (prefix-cache blocks restored from the CPU
          tier), as on /metrics; with speculative decoding ``vllm:spec_decode_num_drafts`` (request-steps that
          verified >= 1 proposal), ``vllm:spec_decode_num_draft_tokens`` (proposed tokens verified),
          ``vllm:spec_decode_num_accepted_tokens``.
        - With speculative decoding's measured turn-off rule (``disable_by_payoff``), per batch-size bucket (label
          ``bucket``: 1, 2, 4, ...): Counters ``hayabusa:spec_decode_payoff_plain_steps`` (steps the rule ran
          without proposals for unseeded requests: its decisions and its plain probes) and
          ``hayabusa:spec_decode_payoff_spec_steps`` (steps it let speculate), Gauge
          ``hayabusa:spec_decode_payoff_speculating`` (1.0: the bucket's chosen mode is speculation).
        - Vector (list of int, length num_speculative_tokens): ``vllm:spec_decode_num_accepted_tokens_per_pos``,
          element i = how many times the proposal at position i was accepted (non-increasing; sums to the
          accepted tokens).
        - Gauges (float, now): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
          ``vllm:kv_cache_usage_perc`` (fraction of the GPU KV blocks in use, 0..1).

        hayabusa's shorthand from before (the returned MetricsList is also a mapping): ``m["num_prompt_tokens"]``,
        ``"num_generation_tokens"``, ``"num_preemptions"``; with the CPU tier ``"num_swap_preemptions"``,
        ``"num_blocks_swapped_out"``, ``"num_blocks_swapped_in"``, ``"cpu_prefix_cache_hit_blocks"``; with
        speculative decoding ``"spec_decode_num_drafts"``, ``"spec_decode_num_draft_tokens"``,
        ``"spec_decode_num_accepted_tokens"``, ``"spec_decode_num_accepted_tokens_per_pos"`` (a list), with the
        measured rule ``"spec_decode_payoff_plain_steps"`` (all buckets)."""
        s, kv = self.scheduler, self.kv_cache_manager
        labels = {"model_name": self.config.model_config.model, "engine": "0"}
        metrics: list[Metric] = []
        shorthand: dict[str, int | list[int]] = {}

        def counter(name: str, value: int, key: str | None = None) -> None:
            metrics.append(Counter(name=name, labels=dict(labels), value=int(value)))
            if key is not None:
                shorthand[key] = int(value)

        counter("vllm:prompt_tokens", self.stats["num_prompt_tokens"], "num_prompt_tokens")
        counter("vllm:generation_tokens", self.stats["num_generation_tokens"], "num_generation_tokens")
        counter("vllm:num_preemptions", s.num_preemptions, "num_preemptions")
        counter("vllm:prefix_cache_queries", kv.num_query_tokens)
        counter("vllm:prefix_cache_hits", kv.num_hit_tokens)
        if kv.cpu is not None:   # the CPU KV tier: its counters (swap_stats' sizes are gauges, not counters)
            swap = kv.swap_stats()
            counter("hayabusa:num_swap_preemptions", s.num_swap_preemptions, "num_swap_preemptions")
            counter("hayabusa:kv_blocks_swapped_out", swap["num_blocks_swapped_out"], "num_blocks_swapped_out")
            counter("hayabusa:kv_blocks_swapped_in", swap["num_blocks_swapped_in"], "num_blocks_swapped_in")
            counter("hayabusa:cpu_prefix_cache_hits", swap["cpu_prefix_cache_hit_blocks"],
                    "cpu_prefix_cache_hit_blocks")
        if s.spec is not None:
            counter("vllm:spec_decode_num_drafts", s.spec_num_drafts, "spec_decode_num_drafts")
            counter("vllm:spec_decode_num_draft_tokens", s.spec_num_draft_tokens, "spec_decode_num_draft_tokens")
            counter("vllm:spec_decode_num_accepted_tokens", s.spec_num_accepted_tokens,
                    "spec_decode_num_accepted_tokens")
            per_pos = s.spec_num_accepted_tokens_per_pos
            k = max(s.spec.config.num_speculative_tokens, len(per_pos))
            per_pos = list(per_pos) + [0] * (k - len(per_pos))
            metrics.append(Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=dict(labels),
                                  values=per_pos))
            shorthand["spec_decode_num_accepted_tokens_per_pos"] = list(per_pos)
            if s.spec.payoff is not None:   # the measured turn-off rule, per batch-size bucket (label "bucket")
                buckets = s.spec.payoff.snapshot()
                for b, st in buckets.items():
                    blabels = dict(labels, bucket=str(b))
                    metrics.append(Counter(name="hayabusa:spec_decode_payoff_plain_steps", labels=dict(blabels),
                                           value=st["plain_steps"]))
                    metrics.append(Counter(name="hayabusa:spec_decode_payoff_spec_steps", labels=dict(blabels),
                                           value=st["spec_steps"]))
                    metrics.append(Gauge(name="hayabusa:spec_decode_payoff_speculating", labels=blabels,
                                         value=float(st["speculating"])))
                shorthand["spec_decode_payoff_plain_steps"] = sum(st["plain_steps"] for st in buckets.values())
        for name, value in (("vllm:num_requests_running", len(s.running)),
                            ("vllm:num_requests_waiting", len(s.waiting)),
                            ("vllm:kv_cache_usage_perc", kv.usage)):
            metrics.append(Gauge(name=name, labels=dict(labels), value=float(value)))
        return MetricsList(metrics, shorthand)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Returns False (nothing done) while requests are running."""
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pending is not None or bool(self._in_pipeline)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One step (see _step); requests whose grammar failed to compile end here, aborted."""
        outputs = self._step()
        if self.scheduler.grammar_failures:
            outputs += self._abort_grammar_failures()
        return outputs

    def _step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the (cumulative) outputs of the requests that changed.

        With async scheduling the next step is scheduled and launched before the previous step's tokens are
        collected, so the host's bookkeeping overlaps the device's work; outputs then trail by one step. (The
        runner keeps every request's token history itself, with the tokens still on the device, so penalties and
        min_tokens need no fallback to synchronous steps.) A step with structured-output requests is split in
        two: its model is queued, the previous step is collected (its tokens accepted by the grammars), then the
        step's bitmask is filled on the host while the device still runs the model, and the step samples under it.
        """
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        overlap = self.async_scheduling
        if not overlap and self._pending is not None:
            return self._collect(*self._drain())
        early: list[RequestOutput] = []
        if overlap and self._pending is not None and self._spec_needs_tokens():
            # speculative decoding: this step may carry proposals, which need its requests' last tokens (and a
            # verify step in flight leaves them unknown): collect the previous step first
            early = self._collect(*self._drain())
        start = self.clock() if self._measure_steps else 0.0
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if self._measure_steps and not sched.is_empty:
            self._step_start[sched.step_id] = start
        handle = self.runner.launch(sched) if not sched.is_empty else None
        if handle is not None and self._pending is not None:
            self.stats["num_overlapped_steps"] += 1
        constrained = handle is not None and bool(sched.structured_output_req_ids)
        if constrained and not overlap:
            # the model is queued: fill the grammar bitmask while the device runs it, then mask and sample
            handle = self.runner.sample_tokens(handle, self._grammar_bitmask(sched))
        self.stats["schedule_s"] += t1 - t0
        self.stats["launch_s"] += time.perf_counter() - t1
        if handle is None and self._pending is None:
            return early + self._nothing_to_run()
        if not overlap:  # handle is set here (an empty step with nothing pending returned above)
            self._pending = (sched, handle)
            return self._collect(*self._drain())
        previous = self._drain()
        outputs = self._collect(*previous) if previous is not None else early
        if constrained:  # the previous step's tokens are accepted: this step's mask, while its model runs
            t2 = time.perf_counter()
            handle = self.runner.sample_tokens(handle, self._grammar_bitmask(sched))
            self.stats["launch_s"] += time.perf_counter() - t2
        self._pending = (sched, handle) if handle is not None else None
        return outputs

    def _spec_needs_tokens(self) -> bool:
        """Speculative decoding under async scheduling: the step in flight verified proposals (its requests'
        token counts are unknown until it is collected), or the next step may carry proposals
        (``Scheduler.wants_proposals``: the turn-off rules leave some running request proposing)."""
        if self.scheduler.spec is None:
            return False
        return bool(self._pending[0].scheduled_spec_decode_tokens) or self.scheduler.wants_proposals()

    def _nothing_to_run(self) -> list[RequestOutput]:
        """No step was scheduled and none is in flight: end failed grammars, wait briefly for one being compiled,
        or abort the requests that block."""
        if self.scheduler.grammar_failures:
            return self._abort_grammar_failures()
        pending_grammars = self.scheduler.grammars_pending()
        if pending_grammars:  # nothing else to run: wait (briefly) for a grammar being compiled
            concurrent.futures.wait(pending_grammars, timeout=0.1, return_when=concurrent.futures.FIRST_COMPLETED)
            return []
        if self.scheduler.has_unfinished_requests():
            return self._fail_unschedulable()
        return []

    def _step_pipelined(self) -> list[RequestOutput]:
        """pipeline_parallel_size M > 1 (vLLM's batch queue): launch steps until M are in flight or nothing more
        can be scheduled, then collect the oldest. The scheduler skips a request whose sampled token is still in
        flight, so the steps in flight are micro-batches of disjoint sampling requests and each stage works on a
        different one (stage 0 on step N + 1 while stage 1 runs step N). A constrained step's bitmask is filled
        before it is sent: its requests' earlier tokens are collected already."""
        queue = self._in_pipeline
        if len(queue) < self.pipeline_depth:
            start = self.clock() if self._measure_steps else 0.0
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            t1 = time.perf_counter()
            if self._measure_steps and not sched.is_empty:
                self._step_start[sched.step_id] = start
            self.stats["schedule_s"] += t1 - t0
            if not sched.is_empty:
                handle = self.runner.launch(sched)
                if sched.structured_output_req_ids:
                    handle = self.runner.sample_tokens(handle, self._grammar_bitmask(sched))
                self.stats["launch_s"] += time.perf_counter() - t1
                queue.append((sched, handle))
                self.most_steps_in_flight = max(self.most_steps_in_flight, len(queue))
                if len(queue) < self.pipeline_depth:
                    return []   # fill the pipeline before waiting for its oldest step
        if not queue:
            return self._nothing_to_run()
        sched, handle = queue.popleft()
        t0 = time.perf_counter()
        result = self.runner.finish(handle)
        self.stats["wait_s"] += time.perf_counter() - t0
        return self._collect(sched, result)

    def _grammar_bitmask(self, sched):
        """The step's grammar bitmask, filled by the scheduler straight into the runner's pinned staging buffer
        when it has one (CUDA; executors have none: the mask is pickled to the workers)."""
        buffer = self.runner.grammar_bitmask_buffer(len(sched.structured_output_req_ids))
        return self.scheduler.grammar_bitmask(sched, buffer)

    def _abort_grammar_failures(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile (the scheduler never admitted them) end as aborted, logged."""
        failures, self.scheduler.grammar_failures = self.scheduler.grammar_failures, {}
        child_to_parent = self.output_processor.child_to_parent
        parents = list(dict.fromkeys(child_to_parent[c] for c in failures if c in child_to_parent))
        for rid, e in failures.items():
            self.error_log.log(logging.ERROR, f"structured output: the grammar of request {rid!r} failed to "
                                              f"compile ({type(e).__name__}: {e}); aborting it")
        outputs = self.abort_request(parents)
        self._abort_orphans()
        return outputs

    def _drain(self):
        """Wait for the pending step, if any: (its SchedulerOutput, its ModelRunnerOutput) or None."""
        if self._pending is None:
            return None
        sched, handle = self._pending
        self._pending = None
        t0 = time.perf_counter()
        result = self.runner.finish(handle)
        self.stats["wait_s"] += time.perf_counter() - t0
        return sched, result

    def _collect(self, sched, result) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._collecting = sched
        outputs = self._collect_outputs(sched, result)
        self._collecting = None
        self.stats["collect_s"] += time.perf_counter() - t0
        if self._measure_steps:
            self._time_step(sched.step_id)
        return outputs

    def _time_step(self, step_id: int) -> None:
        """A collected step's wall time for the measured turn-off rule: from its schedule, or from the previous
        step's collection when that came later (an overlapped step: the steps' times then add up to the wall
        time), to now; handed to the scheduler as plain seconds."""
        end = self.clock()
        start = self._step_start.pop(step_id, None)
        if start is not None:
            self.scheduler.record_step_time(step_id, end - max(start, self._last_collect_end))
        self._last_collect_end = end

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled and nothing is in flight, yet requests are unfinished: abort the ones that
        block (every running one, else the first waiting one: the KV cache cannot hold its next chunk) rather
        than failing the same way on every step. Returns their final outputs (finish_reason "abort")."""
        blocked = self.scheduler.blocked_request_ids()
        child_to_parent = self.output_processor.child_to_parent
        parents = list(dict.fromkeys(child_to_parent[c] for c in blocked if c in child_to_parent))
        self.error_log.log(logging.ERROR, f"the scheduler cannot schedule request(s) {parents or blocked} (the KV "
                                          "cache is too small for them, or their state is broken): aborting them")
        outputs = self.abort_request(parents)
        self._abort_orphans()
        return outputs

    def _collect_outputs(self, sched, result) -> list[RequestOutput]:
        updates = self.scheduler.update_from_output(sched, result.sampled_token_ids)   # [(request, new ids)]
        self.stats["num_steps"] += 1
        self.stats["num_generation_tokens"] += sum(map(len, map(itemgetter(1), updates)))   # new ids per request
        outputs, stop_hits = self.output_processor.process(updates, result.logprobs, result.prompt_logprobs)
        if stop_hits:
            self._finish_children(stop_hits, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _finish_children(self, child_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(child_ids, status)
