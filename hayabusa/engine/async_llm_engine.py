"""AsyncLLMEngine: the LLMEngine stepped by a background thread, with one async stream of outputs per request.

vLLM's ``AsyncLLMEngine`` / ``AsyncLLM`` interface::

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="Qwen/Qwen2.5-0.5B-Instruct"))
    async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=16), "req-0"):
        print(out.outputs[0].text)          # cumulative: the text so far; out.finished on the last one
    await engine.abort("req-1")

Threads: the model step is blocking torch code, so one dedicated engine thread owns the LLMEngine and everything
it touches (scheduler, KV blocks, detokenizers). The event loop talks to it through a FIFO command queue (add,
abort) and gets outputs back through one inbox per event loop: the engine thread appends each step's outputs of
all that loop's requests and wakes the loop (``call_soon_threadsafe``) only when the loop is not already working
through earlier outputs::

    event loop                          engine thread
    add_request -> AddCommand ------->  LLMEngine.add_request (validation) -> fut result / exception
    abort       -> AbortCommand ----->  LLMEngine.abort_request (blocks freed)
    stream.get  <-- _deliver(inbox) <-- inbox += [(id, RequestOutput | error), ...]  <-- step()

Why the inbox: waking a loop is a syscall, which releases the GIL, and the engine thread then waits for the GIL
until the loop has written that step's SSE chunks. Under load (the loop still busy with the last step's chunks)
the hand-off costs no syscall, so the engine thread launches the next step at once and the loop's Python work
overlaps the device's. A stream keeps only the newest cumulative output, so a slow consumer never makes the engine
wait or a queue grow.
A consumer that stops early (break, exception, cancellation, client disconnect) aborts its request. A step that
raises fails the requests in flight with that error and the engine goes on with new ones.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch

from hayabusa.compat import check_priority
from hayabusa.config import EngineArgs
from hayabusa.engine.input_processor import PromptType
from hayabusa.engine.llm_engine import LLMEngine, as_request_id, as_request_ids
from hayabusa.errors import HayabusaValidationError
from hayabusa.multimodal.processor import preprocess_prompt_images
from hayabusa.outputs import RequestOutput
from hayabusa.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or it failed in a way it could not recover from)."""


class EngineStepError(RuntimeError):
    """A step of the engine raised; the requests that were in flight end with this error (``__cause__``)."""


@dataclass
class AsyncEngineArgs(EngineArgs):
    """``EngineArgs`` plus the async engine's own options (vLLM's names).

    Args:
        disable_log_requests: do not log each request's arrival (id, prompt length, sampling parameters).
    """

    disable_log_requests: bool = False


@dataclass
class AddCommand:
    """Add a request; ``future`` gets None once the engine accepted it, or the validation error."""

    request_id: str
    prompt: PromptType
    params: SamplingParams | None
    arrival_time: float
    loop: asyncio.AbstractEventLoop                 # whose inbox gets the request's outputs
    future: concurrent.futures.Future


@dataclass
class AbortCommand:
    """Abort requests (unknown or finished ids are ignored); ``future`` (None: nobody waits) gets None when done."""

    request_ids: list[str]
    future: concurrent.futures.Future | None = None


@dataclass
class StopCommand:
    """Stop the engine thread."""


Command = AddCommand | AbortCommand | StopCommand


# RequestOutputKind -> LLMEngine.add_request's output_kind
_OUTPUT_KINDS = {RequestOutputKind.CUMULATIVE: "cumulative", RequestOutputKind.DELTA: "delta",
                 RequestOutputKind.FINAL_ONLY: "final"}


class RequestStream:
    """The outputs of one request, from the engine thread to one consumer.

    Only the newest cumulative output is kept (each output holds everything so far; DELTA outputs not read yet
    are merged into one, ``RequestOutput.add``; a FINAL_ONLY request has one). Iterate it with
    ``async for``; ``close()`` aborts the request unless it has finished.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None   # the future get() awaits (one consumer), else None
        self.finished = False      # the engine has sent the last output (or an error)
        self._consumed_last = False
        self.delta = False         # RequestOutputKind.DELTA: outputs not read yet are merged

    def _put(self, out: RequestOutput) -> None:
        if self.delta and self._latest is not None:
            self._latest.add(out)       # deltas not read yet are merged, never dropped
        else:
            self._latest = out
        self.finished = self.finished or out.finished
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The newest output not yet returned (waits for one). Raises the request's error, if it failed."""
        if self._consumed_last and self._latest is None:
            raise EOFError(f"request {self.request_id!r} has finished; its last output was already returned.")
        while self._latest is None and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._latest is not None:
            out, self._latest = self._latest, None
            self._consumed_last = out.finished
            return out
        raise self._error

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._consumed_last:
                yield await self.get()
        finally:
            self.close()

    def close(self) -> None:
        """Stop following the request; aborts it in the engine if it has not finished."""
        if not self.finished:
            self.finished = True
            self._engine._abort_nowait(self.request_id)
        self._engine._drop_stream(self)


class _Inbox:
    """Outputs on their way from the engine thread to one event loop.

    The engine thread appends, then schedules ``_deliver`` on the loop unless one is already scheduled; the loop
    takes everything there is, and keeps looking (``call_soon``, no syscall) for as long as it finds more, so a
    busy loop is never woken by a syscall. Only ``scheduled`` is shared state that both threads write; the order
    of the writes (engine: append, then read the flag; loop: clear the flag, then look once more) means an output
    is never left behind.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque = collections.deque()
        self.scheduled = False
        self.num_requests = 0          # requests in flight from this loop (engine thread only)


def cuda_device_index(device: torch.device) -> int | None:
    """The CUDA device index a thread should make current for ``device``; None for non-CUDA devices.
    ``torch.device("cuda")`` (no index) means the caller's current device, read here in the caller's thread."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


class AsyncLLMEngine:
    """vLLM's async engine: many concurrent ``generate()`` calls share one continuously batched LLMEngine.

    Args:
        engine: a constructed LLMEngine; it is used from the engine thread only from now on.
        log_requests: log each request's arrival.
        start_engine_loop: start the engine thread now (else on the first request).
    """

    def __init__(self, engine: LLMEngine, log_requests: bool = True, start_engine_loop: bool = True) -> None:
        self.engine = engine
        self.log_requests = log_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}            # touched only by event-loop threads
        # Touched only by the engine thread: the inbox of each request in flight, and of each loop with requests.
        self._req_inbox: dict[str, _Inbox] = {}
        self._inboxes: dict[asyncio.AbstractEventLoop, _Inbox] = {}
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._stats: dict[str, Any] = {}
        # The engine thread's CUDA device, as an index: torch.cuda.set_device refuses a bare torch.device("cuda")
        # (no index), which is what device="auto"/"cuda" resolve to; that error killed the engine thread on GPUs.
        device = engine.config.device_config.device
        self._cuda_index = cuda_device_index(device)
        self._update_stats()
        if start_engine_loop:
            self.start_background_loop()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True) -> "AsyncLLMEngine":
        """Build the LLMEngine (load weights, size the KV cache) in this thread, then start the engine thread."""
        engine = LLMEngine(engine_args.create_engine_config())
        log = not getattr(engine_args, "disable_log_requests", False)
        return cls(engine, log_requests=log, start_engine_loop=start_engine_loop)

    # ------------------------------------------------------------------ public API
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    async def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def get_model_config(self) -> Any:
        return self.engine.config.model_config

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine thread is not running."""
        if self._dead is not None or not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self._dead!r}")

    def get_stats(self) -> dict[str, Any]:
        """A snapshot taken by the engine thread after its last step: num_requests_running / _waiting (sequences),
        kv_cache_usage (0..1), num_kv_blocks, num_free_kv_blocks, num_preemptions, num_prompt_tokens,
        num_generation_tokens, num_steps; prefix_cache_queries / _hits (tokens) when the KV manager counts them;
        spec_decode_num_draft_tokens / _accepted_tokens with speculative decoding, spec_decode_payoff_plain_steps
        with its measured turn-off rule (steps it ran without proposals, all batch-size buckets)."""
        return dict(self._stats)

    async def add_request(self, request_id: Any, prompt: PromptType, sampling_params: SamplingParams | None = None,
                          arrival_time: float | None = None, lora_request: Any = None, priority: int = 0,
                          trace_headers: Any = None) -> RequestStream:
        """Queue a request and wait until the engine has accepted it.

        priority: 0 (vLLM's keyword; requests run first come, first served, so another value is refused);
        trace_headers: accepted and ignored (vLLM's OpenTelemetry headers).

        Returns:
            Its RequestStream (iterate it for cumulative RequestOutputs).

        Raises:
            HayabusaValidationError: a bad prompt or parameter, an empty request_id (ids are compared as
                ``str(request_id)``) or one already in use, a non-zero ``priority``; nothing is queued.
            EngineDeadError: the engine thread has stopped.
        """
        if lora_request is not None:
            raise HayabusaValidationError("LoRA adapters are not supported; pass lora_request=None or leave it out.",
                                          parameter="lora_request", value=repr(lora_request)[:80])
        check_priority(priority, None)
        self._check_alive()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):   # images: preprocessed off the engine thread
            prompt = await asyncio.get_running_loop().run_in_executor(
                None, preprocess_prompt_images, self.engine.input_processor.mm_processor, prompt)
        request_id = as_request_id(request_id)
        if request_id in self._streams:
            raise HayabusaValidationError(f"request_id {request_id!r} is already in use.", parameter="request_id",
                                          value=request_id)
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id)
        # (params that are not SamplingParams: the engine refuses them)
        stream.delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        self._streams[request_id] = stream
        fut: concurrent.futures.Future = concurrent.futures.Future()
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(AddCommand(request_id, prompt, sampling_params, arrival_time, loop, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            stream.close()                  # the add may still happen: the abort queued behind it undoes it
            raise
        except BaseException:
            stream.finished = True
            self._drop_stream(stream)
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: Any,
                       arrival_time: float | None = None, lora_request: Any = None, priority: int = 0,
                       trace_headers: Any = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs until it finishes (``out.finished``): cumulative ones, or as
        ``sampling_params.output_kind`` says (RequestOutputKind.DELTA: only what is new in each; FINAL_ONLY: the
        last one alone).

        request_id: any value whose ``str()`` is non-empty (a str, a ``uuid.uuid4()``, ...); the engine keys the
        request by that str (``out.request_id``), so ``abort`` with the same object finds it.

        An abort (``await engine.abort(request_id)``) ends the stream with an output whose finish_reason is
        "abort". Leaving the loop early (break, an exception, task cancellation) aborts the request.

        Raises:
            HayabusaValidationError: at the first iteration, for a bad prompt or parameter or a duplicate id.
            EngineStepError: a step failed while this request was in flight.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time, lora_request=lora_request,
                                        priority=priority)
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            stream.close()

    async def abort(self, request_id: Any) -> None:
        """Abort requests: one id or a list/tuple/set of them, compared as ``str(id)`` (unknown or finished ids are
        ignored); returns once their KV blocks are freed."""
        ids = as_request_ids(request_id)
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(AbortCommand(ids, fut))
        await asyncio.wrap_future(fut)

    def fail_open_requests(self, error: BaseException) -> int:
        """End every open stream with ``error`` (its consumer gets it after the outputs
        it has not read yet) and abort their requests in the engine. Call it from the event loop. Returns how many
        streams were ended."""
        streams = list(self._streams.values())
        for stream in streams:
            stream._fail(error)
            self._drop_stream(stream)
            self._abort_nowait(stream.request_id)
        return len(streams)

    def start_background_loop(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hayabusa-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread and the engine's worker processes; requests still in flight end with
        EngineDeadError."""
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()
            return
        self._commands.put(StopCommand())
        self._thread.join(timeout)
        self.engine.shutdown()     # worker processes (tensor_parallel_size > 1) end with the thread

    # ------------------------------------------------------------------ event-loop side helpers
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead!r}") from self._dead
        if self._thread is None:
            self.start_background_loop()

    def _abort_nowait(self, request_id: str) -> None:
        self._commands.put(AbortCommand([request_id]))

    def _drop_stream(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _deliver(self, inbox: _Inbox) -> None:
        """Runs on the event loop: hand each output or error in the inbox to its stream, then look again after the
        streams' consumers have run (while there is more, the engine thread does not need to wake the loop)."""
        items = inbox.items
        if not items:
            inbox.scheduled = False
            if not items:                   # looked once more after clearing the flag: nothing was added
                return
            inbox.scheduled = True
        streams = self._streams
        while items:
            rid, item = items.popleft()
            stream = streams.get(rid)
            if stream is None:
                continue
            if isinstance(item, BaseException):
                stream._fail(item)
            else:
                stream._put(item)
            if stream.finished:
                self._drop_stream(stream)   # the id is free again; the consumer still holds the stream
        inbox.loop.call_soon(self._deliver, inbox)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)   # the current device is per thread
        try:
            self._loop_forever()
        except BaseException as e:  # noqa: BLE001 -- the thread must report why it died
            logger.exception("the engine thread died")
            self._dead = e
        else:
            self._dead = EngineDeadError("the engine was shut down")
        self._fail_all(self._dead)
        self._refuse_pending_commands()

    def _loop_forever(self) -> None:
        while True:
            outbox: list[tuple[str, RequestOutput | BaseException]] = []
            idle = not self.engine.has_unfinished_requests()
            for cmd in self._drain(block=idle):
                if isinstance(cmd, StopCommand):
                    return
                self._apply(cmd, outbox)
            if self.engine.has_unfinished_requests():
                try:
                    outbox.extend((o.request_id, o) for o in self.engine.step())
                except Exception as e:  # noqa: BLE001 -- one bad step must not stop the server
                    self._recover_from_step_error(e, outbox)
                    if getattr(e, "engine_dead", False):   # a worker process is gone: no step can run again
                        self._send(outbox)
                        raise
            self._update_stats()
            self._send(outbox)

    def _drain(self, block: bool) -> list[Command]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd: Command, outbox: list) -> None:
        if isinstance(cmd, AddCommand):
            rid, loop, fut = cmd.request_id, cmd.loop, cmd.future
            if not fut.set_running_or_notify_cancel():
                return                      # the caller gave up before the engine saw the request
            try:
                kind = getattr(cmd.params, "output_kind", RequestOutputKind.CUMULATIVE)   # bad params: refused
                self.engine.add_request(rid, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                        output_kind=_OUTPUT_KINDS[kind])
            except BaseException as e:  # noqa: BLE001 -- goes back to the caller
                fut.set_exception(e)
                return
            inbox = self._inboxes.get(loop)
            if inbox is None:
                inbox = self._inboxes[loop] = _Inbox(loop)
            inbox.num_requests += 1
            self._req_inbox[rid] = inbox
            fut.set_result(None)
            if self.log_requests:
                # %r: an id cannot forge a log line; shortened, so that a long id or many stop strings cannot
                # make it huge (up to 128 characters of the id, 1000 of the parameters)
                logger.info("request %.128r: %.1000s", rid, cmd.params)
        elif isinstance(cmd, AbortCommand):
            ids, fut = cmd.request_ids, cmd.future
            if fut is not None and not fut.set_running_or_notify_cancel():
                fut = None                  # the caller stopped waiting; abort all the same
            try:
                outbox.extend((o.request_id, o) for o in self.engine.abort_request(ids))
            except BaseException as e:  # noqa: BLE001
                if fut is not None:
                    fut.set_exception(e)
                    return
                raise
            if fut is not None:
                fut.set_result(None)

    def _recover_from_step_error(self, error: Exception, outbox: list) -> None:
        err = EngineStepError(f"engine step failed: {type(error).__name__}: {error}")
        err.__cause__ = error
        # the same failure on every pass is logged once per interval, with its traceback the first time
        self.engine.error_log.log(logging.ERROR, f"engine step failed ({type(error).__name__}: {error}); failing "
                                                 "the requests it was running", exc_info=error)
        ids = self.engine.abort_after_failed_step()  # frees their blocks; raising here kills the thread
        outbox.extend((rid, err) for rid in ids)

    def _send(self, outbox: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Put outputs in the inbox of their request's event loop; wake a loop only if it is not already busy
        with its inbox (at most one thread-safe call per loop and step)."""
        if not outbox:
            return
        req_inbox = self._req_inbox
        touched: dict[_Inbox, list] = {}
        for rid, item in outbox:
            inbox = req_inbox.get(rid)
            if inbox is None:
                continue
            if inbox in touched:
                touched[inbox].append((rid, item))
            else:
                touched[inbox] = [(rid, item)]
            if isinstance(item, BaseException) or item.finished:
                del req_inbox[rid]
                inbox.num_requests -= 1
                if inbox.num_requests == 0 and self._inboxes.get(inbox.loop) is inbox:
                    del self._inboxes[inbox.loop]      # a loop that comes back gets a new inbox
        for inbox, items in touched.items():
            inbox.items.extend(items)       # first append, then read the flag (see _Inbox)
            try:
                if inbox.loop.is_closed():
                    raise RuntimeError("event loop is closed")
                if not inbox.scheduled:
                    inbox.scheduled = True
                    inbox.loop.call_soon_threadsafe(self._deliver, inbox)
            except RuntimeError:            # that loop is closed: nobody is listening any more
                inbox.items.clear()
                if self._inboxes.get(inbox.loop) is inbox:
                    del self._inboxes[inbox.loop]
                live = [rid for rid, i in list(req_inbox.items()) if i is inbox]
                for rid in live:
                    del req_inbox[rid]
                self._commands.put(AbortCommand(live))

    def _fail_all(self, error: BaseException) -> None:
        err = error if isinstance(error, EngineDeadError) else EngineDeadError(f"the engine stopped: {error!r}")
        self._send([(rid, err) for rid in list(self._req_inbox)])

    def _refuse_pending_commands(self) -> None:
        """After the thread stops: callers still waiting on an add or an abort get an answer."""
        for cmd in self._drain(block=False):
            fut = None if isinstance(cmd, StopCommand) else cmd.future
            if fut is None or not fut.set_running_or_notify_cancel():
                continue
            if isinstance(cmd, AddCommand):
                fut.set_exception(EngineDeadError(f"the engine has stopped: {self._dead!r}"))
            else:
                fut.set_result(None)

    def _update_stats(self) -> None:
        eng = self.engine
        sched, kv = eng.scheduler, eng.kv_cache_manager
        stats = {"num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
                 "kv_cache_usage": kv.usage, "num_kv_blocks": eng.num_blocks,
                 "num_free_kv_blocks": kv.num_free_blocks, "num_preemptions": sched.num_preemptions,
                 **eng.stats}
        if hasattr(kv, "swap_stats"):   # the CPU tier (swap_space)
            stats.update(kv.swap_stats(), num_swap_preemptions=sched.num_swap_preemptions)
        # Prefix-cache lookups in tokens (vLLM's prefix_cache_queries / _hits), when the KV manager counts them.
        for name, attr in (("prefix_cache_queries", "num_query_tokens"), ("prefix_cache_hits", "num_hit_tokens")):
            value = getattr(kv, attr, None)
            if isinstance(value, int):
                stats[name] = value
        if sched.spec is not None:   # speculative decoding: vLLM's counter names
            stats["spec_decode_num_draft_tokens"] = sched.spec_num_draft_tokens
            stats["spec_decode_num_accepted_tokens"] = sched.spec_num_accepted_tokens
            if sched.spec.payoff is not None:   # steps the measured turn-off rule ran without proposals
                stats["spec_decode_payoff_plain_steps"] = sum(b.num_plain_steps
                                                              for b in sched.spec.payoff.buckets.values())
        self._stats = stats
