"""The OpenAI-compatible HTTP server: FastAPI routes, API-key check, OpenAI-shaped errors, SSE, metrics, uvicorn.

    app = build_app(engine, ["my-model"], api_key="sk-...", chat_template=None)
    run_server(app, host="127.0.0.1", port=8000)          # or ServerThread(app).start() in a test

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics, GET /version.
Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``: bad JSON (malformed, too deep, an
integer beyond 64 bits, NaN / Infinity, a lone surrogate), a failed field check, a HayabusaValidationError (its
``.parameter`` becomes ``param``) -> 400; a Host not on the allow list -> 400; a wrong or missing key -> 401 (routes
under /v1, and /metrics, /docs, /openapi.json unless made public); a foreign Origin -> 403; a body over
``max_request_body_bytes`` -> 413; a body not received within ``request_body_timeout`` -> 408 (connection
closed); a request head (request line and headers) not received within ``header_timeout`` of the connection
opening or of its last response -> the connection is closed; a Content-Type other than JSON -> 415; a dead engine
or a server shutting down -> 503; anything else -> 500 (a bug, logged once with its traceback). None of them
closes the connection (but a 413 whose body was not read, and a 408).

Bodies over 64 KiB are parsed and validated on a worker thread, after cheap structural bounds (request_checks.py:
how many arrays, objects, prompts, messages, stop strings; 400 naming the field). Per-request CPU work (chat
templates, tokenization) runs on a thread pool, so one large request does not stall the
other clients' streams; a request's own chat template is refused unless ``trust_request_chat_template``, and then
runs under a time limit. On shutdown, open requests get ``shutdown_timeout`` seconds to finish; then each open
stream ends with an error event and ``[DONE]``.

A client that disconnects -- mid-stream or while waiting for a non-streamed answer -- cancels its handler, and
that aborts its engine requests (their KV blocks are freed at the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import threading
import time
from typing import Any, Awaitable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hayabusa import __version__
from hayabusa.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from hayabusa.entrypoints.openai import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT,
                                         DEFAULT_REQUEST_HEADER_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT)
from hayabusa.entrypoints.openai.middleware import (LOOPBACK_HOSTS, APIKeyMiddleware, HostOriginMiddleware,
                                                    InternalErrorMiddleware)
from hayabusa.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList,
                                                  OpenAIError, error_body)
from hayabusa.entrypoints.openai.request_checks import (OFF_LOOP_BODY_BYTES, PromptLimit, check_request_shape,
                                                        parse_json_object, read_body, split_token_prompt)
from hayabusa.entrypoints.openai.serving import OpenAIServing, ServerShuttingDown, SSEStream, sse
from hayabusa.errors import HayabusaValidationError

logger = logging.getLogger(__name__)

# Histogram buckets (seconds), as vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


# ---------------------------------------------------------------------------------------------------- metrics
class ServerMetrics:
    """Prometheus metrics (vLLM's names with the ``hayabusa:`` prefix), in a registry of this app's own.

    Engine state (running / waiting sequences, KV usage, token and preemption counters, prefix-cache lookups) is
    read from ``AsyncLLMEngine.get_stats()`` at scrape time; per-request latencies are observed when a request
    ends: TTFT (arrival at the server -> first token), TPOT (first -> last token, per token after the first),
    end-to-end latency.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)
        self.ttft = Histogram("hayabusa:time_to_first_token_seconds", "Time to first token (server side).", names,
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("hayabusa:time_per_output_token_seconds", "Time per output token after the first.",
                              names, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("hayabusa:e2e_request_latency_seconds", "End-to-end request latency.", names,
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.success = Counter("hayabusa:request_success", "Finished completions by finish reason.",
                               names + ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, self.labels))

    def on_request_finished(self, *, ttft: float | None, tpot: float | None, e2e: float, prompt_tokens: int,
                            generation_tokens: int, finish_reasons: list[str]) -> None:
        if ttft is not None:
            self.ttft.labels(**self.labels).observe(ttft)
        if tpot is not None:
            self.tpot.labels(**self.labels).observe(tpot)
        self.e2e.labels(**self.labels).observe(e2e)
        for reason in finish_reasons:
            self.success.labels(**self.labels, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the engine's stats snapshot at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, labels: dict[str, str]) -> None:
        self.engine = engine
        self.labels = labels

    def collect(self):
        s = self.engine.get_stats()
        keys, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=keys)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=keys)
            c.add_metric(values, value)
            return c

        yield gauge("hayabusa:num_requests_running", "Sequences in the running batch.", s["num_requests_running"])
        yield gauge("hayabusa:num_requests_waiting", "Sequences waiting to be scheduled.", s["num_requests_waiting"])
        yield gauge("hayabusa:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s["kv_cache_usage"])
        yield counter("hayabusa:prompt_tokens", "Prompt tokens received.", s["num_prompt_tokens"])
        yield counter("hayabusa:generation_tokens", "Tokens generated.", s["num_generation_tokens"])
        yield counter("hayabusa:num_preemptions", "Preemptions (recompute or swap).", s["num_preemptions"])
        if "num_blocks_swapped_out" in s:   # the KV cache's CPU tier (swap_space)
            yield counter("hayabusa:num_swap_preemptions", "Preemptions whose KV went to the CPU tier.",
                          s["num_swap_preemptions"])
            yield counter("hayabusa:kv_blocks_swapped_out", "KV blocks copied GPU -> CPU.", s["num_blocks_swapped_out"])
            yield counter("hayabusa:kv_blocks_swapped_in", "KV blocks copied CPU -> GPU.", s["num_blocks_swapped_in"])
            yield counter("hayabusa:cpu_prefix_cache_hits", "Prefix-cache blocks restored from the CPU tier.",
                          s["cpu_prefix_cache_hit_blocks"])
            yield gauge("hayabusa:cpu_kv_cache_usage_perc", "Fraction of the CPU tier's blocks in use (0..1).",
                        s["num_used_cpu_kv_blocks"] / s["num_cpu_kv_blocks"] if s["num_cpu_kv_blocks"] else 0.0)
        if "prefix_cache_queries" in s:
            queries, hits = s["prefix_cache_queries"], s.get("prefix_cache_hits", 0)
            yield counter("hayabusa:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
            yield counter("hayabusa:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
            yield gauge("hayabusa:prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.",
                        hits / queries if queries else 0.0)
        if "spec_decode_num_draft_tokens" in s:   # speculative decoding (vLLM's counter names)
            yield counter("hayabusa:spec_decode_num_draft_tokens", "Speculative tokens proposed.",
                          s["spec_decode_num_draft_tokens"])
            yield counter("hayabusa:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                          s["spec_decode_num_accepted_tokens"])
        if "spec_decode_payoff_plain_steps" in s:   # the measured turn-off rule (disable_by_payoff)
            yield counter("hayabusa:spec_decode_payoff_plain_steps", "Steps speculative decoding's measured "
                          "turn-off rule ran without proposals.", s["spec_decode_payoff_plain_steps"])


# ---------------------------------------------------------------------------------------------------- ASGI pieces
async def _wait_for_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """A server-sent-events response that watches for the client going away: then the stream is cancelled and
    its body closed, which aborts the engine requests behind it."""

    def __init__(self, body: SSEStream) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.sse_body = body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.sse_body:              # bytes, ready to write
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (OSError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 -- a bug: log it once, end the stream as OpenAI clients expect
                logger.error("streaming response failed", exc_info=e)
                end = sse(error_body(f"Internal server error: {type(e).__name__}", "internal_server_error"))
                await send({"type": "http.response.body", "body": end + sse("[DONE]"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streamer = asyncio.ensure_future(stream())
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, listener):
                t.cancel()
            await asyncio.gather(streamer, listener, return_exceptions=True)
            await self.sse_body.aclose()


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (its finally blocks abort the engine requests)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return None


async def _parse(request: Request, model: type[BaseModel], max_body_bytes: int, limit: PromptLimit,
                 body_timeout: float) -> Any:
    """Read, parse and validate the body; a body over OFF_LOOP_BODY_BYTES on a worker thread (the event loop
    keeps serving the others meanwhile), after the structural bounds of ``check_request_shape`` (``limit``: the
    longest token-id prompt, an encoder-decoder model's encoder limit, and the 400 for a longer one)."""
    body = await read_body(request, max_body_bytes, body_timeout)
    if len(body) <= OFF_LOOP_BODY_BYTES:
        return _validate(body, model, limit)
    return await asyncio.to_thread(_validate, body, model, limit)


def _validate(body: bytes, model: type[BaseModel], limit: PromptLimit) -> Any:
    data = parse_json_object(body, lambda d: check_request_shape(d, limit))
    data, token_prompt = split_token_prompt(data)
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None
    if token_prompt is not None:
        req.prompt = token_prompt
    return req


def _validation_error(errors: list[dict]) -> OpenAIError:
    """The first failing field; a value that fits none of a union's types gets all of their complaints."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    same = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1]]
    if len(same) > 1:
        msgs = "; ".join(dict.fromkeys(str(e.get("msg")) for e in same))
        return OpenAIError(400, f"{param}: invalid value ({msgs}); got {str(first.get('input'))[:100]!r}",
                           param=param)
    where = ".".join(loc) or "body"
    return OpenAIError(400, f"{where}: {first.get('msg')} (got {str(first.get('input'))[:100]!r})", param=param)


def _error_response(e: OpenAIError) -> JSONResponse:
    # 408: the rest of the body may still come; the connection is closed rather than read on.
    return JSONResponse(e.body(), status_code=e.status, headers={"Connection": "close"} if e.status == 408 else None)


# ---------------------------------------------------------------------------------------------------- the app
def build_app(engine: AsyncLLMEngine, model_names: list[str], *, api_key: str | None = None,
              chat_template: str | None = None, model_path: str | None = None,
              trust_request_chat_template: bool = False,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT,
              allowed_hosts: list[str] | tuple[str, ...] | None = LOOPBACK_HOSTS,
              allowed_origins: list[str] | tuple[str, ...] = (), public_docs_and_metrics: bool = False,
              media_policy: Any = None) -> FastAPI:
    """The FastAPI app over a running AsyncLLMEngine.

    Args:
        engine: the engine (the caller owns it and shuts it down).
        model_names: served model names; requests must name one of them (or none: the first).
        api_key: when set, /v1 routes (and /metrics, /docs, /redoc, /openapi.json unless
            ``public_docs_and_metrics``) need ``Authorization: Bearer <api_key>``.
        chat_template: a Jinja template text that replaces the tokenizer's chat template.
        model_path: the model as loaded (a folder or Hub id): also accepted as ``model`` in requests, never shown.
        trust_request_chat_template: accept a request's own ``chat_template`` (rendered under a time limit).
        max_request_body_bytes: larger bodies get 413.
        request_body_timeout: seconds to receive a whole body once the headers are in; then 408, connection closed.
        allowed_hosts: Host header names accepted (any port); None: any ("*" in the list too).
        allowed_origins: browser origins allowed cross-site (CORS on for them; "*": any); the server's own
            origin is always allowed.
        media_policy: where chat images may come from (``entrypoints/media.MediaPolicy``; default: data URLs only).
    """
    metrics = ServerMetrics(engine, model_names[0])
    serving = OpenAIServing(engine, model_names, chat_template, metrics.on_request_finished,
                            model_aliases=[model_path] if model_path else [],
                            trust_request_chat_template=trust_request_chat_template, media_policy=media_policy)
    app = FastAPI(title="hayabusa", version=__version__)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics
    # add_middleware puts each one outside the ones before: a request meets Host/Origin, CORS, key, then the rest.
    app.add_middleware(InternalErrorMiddleware)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, public_docs_and_metrics=public_docs_and_metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in allowed_origins)
    app.add_middleware(HostOriginMiddleware, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins)
    created = int(time.time())
    mc = engine.engine.config.model_config
    max_model_len = mc.max_model_len
    # the longest token-id prompt the structural check lets through: encoder-decoder (T5) prompts are encoder
    # inputs, limited by the model's encoder limit, not by max_model_len (the decoder's)
    max_prompt_len = PromptLimit(max_model_len, mc.max_encoder_len if mc.is_encoder_decoder else None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(HayabusaValidationError)
    async def _validation(_: Request, e: HayabusaValidationError) -> JSONResponse:
        return _error_response(OpenAIError(400, str(e), param=e.parameter))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(list(e.errors())))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return _error_response(OpenAIError(503, f"The engine is not running: {e}"))

    @app.exception_handler(ServerShuttingDown)
    async def _shutting_down(_: Request, e: ServerShuttingDown) -> JSONResponse:
        return _error_response(OpenAIError(503, str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return _error_response(OpenAIError(503, str(e)))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [ModelCard(id=name, created=created, root=name, max_model_len=max_model_len)
                 for name in model_names]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest, max_request_body_bytes, max_prompt_len,
                           request_body_timeout)
        return _respond(await _until_disconnect(request, serving.completions(req)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest, max_request_body_bytes, max_prompt_len,
                           request_body_timeout)
        return _respond(await _until_disconnect(request, serving.chat(req)))

    return app


def _respond(result: Any) -> Response:
    if result is None:                       # the client went away; nobody reads this
        return Response(status_code=499)
    if isinstance(result, SSEStream):
        return SSEResponse(result)
    return Response(json.dumps(result, ensure_ascii=False), media_type="application/json")


# ---------------------------------------------------------------------------------------------------- running
class _HeaderDeadline:
    """Mixed into uvicorn's HTTP protocol (h11 or httptools): a connection must deliver a whole request head within
    ``header_timeout`` seconds of opening, and of each response ending; otherwise it is closed. uvicorn's own
    keep-alive timer is cancelled by any byte, so a client trickling header bytes (or a connection that never
    sends one) was held forever. Body reads have their own limit (``request_body_timeout``)."""

    header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT
    _header_timer: asyncio.TimerHandle | None = None

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_if_request_open(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_header_deadline()

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_header_deadline()
        super().on_response_complete()      # may start a pipelined request (then the deadline is off again)
        self._disarm_if_request_open()


def http_protocol(header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT) -> type:
    """uvicorn's HTTP protocol class as its ``http="auto"`` picks it (httptools when installed, else h11), with the
    request-head deadline of ``_HeaderDeadline`` (``header_timeout`` seconds, > 0).

    Raises:
        HayabusaValidationError: header_timeout is not a positive number (names ``header_timeout``).
    """
    if isinstance(header_timeout, bool) or not isinstance(header_timeout, (int, float)) or not header_timeout > 0:
        raise HayabusaValidationError(f"header_timeout must be a positive number of seconds, got {header_timeout!r}.",
                                      parameter="header_timeout", value=header_timeout)
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        class Protocol(_HeaderDeadline, HttpToolsProtocol):
            def on_headers_complete(self) -> None:
                super().on_headers_complete()
                self._disarm_header_deadline()
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class Protocol(_HeaderDeadline, H11Protocol):       # type: ignore[no-redef]
            def handle_events(self) -> None:
                super().handle_events()
                self._disarm_if_request_open()
    Protocol.header_timeout = header_timeout
    return Protocol




class Server(uvicorn.Server):
    """uvicorn's server, with a drain on shutdown: new connections are refused at once, open requests get
    ``shutdown_timeout`` seconds to finish, then every one still open ends -- a stream with an error event and
    ``[DONE]``, a non-streamed request with a 503 -- instead of being cut off mid-body."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        # uvicorn cancels what is left some time after our deadline: by then every response has ended.
        config.timeout_graceful_shutdown = shutdown_timeout + 5.0
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        serving = getattr(getattr(self.config.app, "state", None), "serving", None)
        timer = None
        if isinstance(serving, OpenAIServing):
            def end_open_requests() -> None:
                n = serving.end_open_requests(f"the server is shutting down (open requests had "
                                              f"{self.shutdown_timeout:g} s to finish)")
                if n:
                    logger.warning("shutdown: ended %d request(s) still open after %g s", n, self.shutdown_timeout)
            timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, end_open_requests)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               access_log: bool = True, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
               header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT) -> None:
    """Serve until interrupted (SIGINT / SIGTERM), then drain for up to ``shutdown_timeout`` seconds. A connection
    that does not send a whole request head within ``header_timeout`` seconds (of opening, or of its last response)
    is closed.

    Everything built so far (torch, the model, the app) is moved out of the garbage collector's reach first
    (``gc.freeze``, as vLLM does after startup): streaming allocates fast enough to trigger full collections, and
    each one would otherwise walk that whole heap (100+ ms) while every stream waits.
    """
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=5, http=http_protocol(header_timeout))
    try:
        Server(config, shutdown_timeout).run()
    except KeyboardInterrupt:   # uvicorn re-raises the SIGINT it already shut down on: no traceback for Ctrl-C
        pass


class ServerThread:
    """Serve an app on a background thread (tests, notebooks): ``with ServerThread(app) as s: s.url``.

    Binds ``host:port`` first (port 0 = a free one), so the port is known before the server starts.
    ``header_timeout``: seconds a connection has to send a request head (see ``run_server``).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_timeout: float = 2.0, header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = Server(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=5,
                                            http=http_protocol(header_timeout)), shutdown_timeout)
        self.thread = threading.Thread(target=self._run, name="hayabusa-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float | None = None) -> None:
        self.server.should_exit = True
        self.thread.join(self.server.shutdown_timeout + 10.0 if timeout is None else timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
