"""OpenAI requests -> prompts + SamplingParams -> AsyncLLMEngine -> OpenAI responses and SSE chunks.

One handler per endpoint: ``OpenAIServing.completions`` and ``.chat``. Each validates the request (model name,
prompt length, sampling fields), adds one engine request per prompt, and returns either the finished response
(a dict) or an async generator of SSE lines. Bad input raises ``OpenAIError`` or ``HayabusaValidationError``
before anything is sent; server.py turns both into OpenAI's JSON error with status 400.

Streaming: the engine's outputs are cumulative, so each choice's delta is ``text[len(sent):]`` and
``token_ids[n_sent:]`` (the engine's text only grows, and holds back split UTF-8 characters and partial stop
strings). A chunk goes out whenever a choice has new tokens or finishes, as vLLM does. At high concurrency the
server writes one chunk per request per step, so a chunk is built from pre-serialized pieces (the header, the
field names) around ``json`` encodings of the values that change; the bytes are exactly ``json.dumps`` of the
chunk's dict (``ensure_ascii=False``), as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from hayabusa.engine.async_llm_engine import AsyncLLMEngine, RequestStream
from hayabusa.engine.input_processor import check_prompt_length
from hayabusa.entrypoints.chat_utils import render_chat
from hayabusa.entrypoints.media import MediaPolicy, check_placeholders, extract_images
from hayabusa.entrypoints.openai import REQUEST_CHAT_TEMPLATE_TIME_LIMIT
from hayabusa.entrypoints.openai.protocol import (MAX_LOGPROBS, UNSUPPORTED_FIELDS, ChatCompletionRequest,
                                                  CompletionRequest, OpenAIError, SamplingFields, error_body)
from hayabusa.entrypoints.openai.request_checks import (MAX_PROMPTS, PromptLimit, TimeLimitExceeded,
                                                        run_with_time_limit)
from hayabusa.errors import ChatTemplateError, HayabusaValidationError
from hayabusa.outputs import LOGPROB_JSON_FLOOR, Logprob, RequestOutput, logprobs_json
from hayabusa.sampling_params import SamplingParams, StructuredOutputsParams
from hayabusa.structured_output.manager import parse_grammar

logger = logging.getLogger(__name__)

# Most completions per request (n x prompts): a bound on what one HTTP request can ask of the engine.
MAX_CHOICES = MAX_PROMPTS
# Threads for per-request CPU work (template rendering, tokenization): the tokenizers release the GIL, so a long
# prompt being tokenized does not stall the event loop and the other clients' streams.
NUM_PREPROCESS_THREADS = 4



_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from ``response_format`` (``json_schema`` / ``json_object``; ``text`` is
    none), ``structured_outputs`` (vLLM's extra body) or the legacy ``guided_*`` fields; at most one of them.

    Raises:
        OpenAIError: 400 naming the field: an unknown response_format type, a json_schema without a schema, two
            constraints, or an invalid schema / regex / choice / grammar (checked here, before anything is queued).
    """
    try:
        given = _constraints_of(req)
    except HayabusaValidationError as e:
        raise OpenAIError(400, str(e), param=e.parameter) from None
    if len(given) > 1:
        raise OpenAIError(400, f"give one output constraint, got {', '.join(n for n, _ in given)}.",
                          param=given[1][0])
    if not given:
        return None
    name, params = given[0]
    try:
        parse_grammar(params)
    except HayabusaValidationError as e:
        raise OpenAIError(400, f"{name}: {e}", param=name) from None
    return params


def _constraints_of(req: SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    """(request field, constraint) for each constraint the request gives."""
    given: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, (dict, str)):
                raise OpenAIError(400, "response_format of type 'json_schema' needs json_schema.schema (a JSON "
                                  "schema object).", param="response_format")
            given.append(("response_format", StructuredOutputsParams(json=schema)))
        elif kind == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind != "text":
            raise OpenAIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                              f"{ascii(kind)[:40]}.", param="response_format")
    if req.structured_outputs is not None:
        given.append(("structured_outputs", StructuredOutputsParams.from_value(dict(req.structured_outputs))))
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            given.append((name, StructuredOutputsParams(**{kind: value},
                                                        whitespace_pattern=req.guided_whitespace_pattern)))
    return given


class ServerShuttingDown(RuntimeError):
    """The server is shutting down and ended this request (503; a stream gets an error event and [DONE])."""


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


# json.dumps(str, ensure_ascii=False) without building an encoder per call (the C encoder json.dumps uses).
_json_str = json.encoder.encode_basestring


def _json(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)``, fast for the values of a streamed chunk (None, str, int)."""
    if value is None:
        return "null"
    if type(value) is str:
        return _json_str(value)
    return json.dumps(value, ensure_ascii=False)


def _chunk_prefix(header: dict[str, Any]) -> str:
    """``json.dumps({**header, "choices": [...]})`` up to the first choice: ``data: {"id": ..., "choices": [``."""
    return "data: " + json.dumps(header, ensure_ascii=False)[:-1] + ', "choices": ['


def _error_event(e: BaseException) -> bytes:
    """The last event of a stream that ends in an error (``[DONE]`` follows)."""
    kind = ("service_unavailable" if isinstance(e, ServerShuttingDown) else
            "internal_server_error" if isinstance(e, RuntimeError) else "invalid_request_error")
    return sse(error_body(str(e), kind))


class SSEStream:
    """The body of a streaming response: SSE events as bytes; ``aclose()`` aborts its engine requests that have
    not finished, even when iteration never started (a client gone before the first chunk)."""

    def __init__(self, chunks: AsyncIterator[bytes], streams: list[RequestStream]) -> None:
        self.chunks = chunks
        self.streams = streams

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks

    async def aclose(self) -> None:
        try:
            await self.chunks.aclose()
        finally:
            for s in self.streams:
                s.close()


class RequestTimer:
    """Server-side latencies of one HTTP request (all its prompts and choices), reported once at the end."""

    def __init__(self, on_finish: Callable[..., None] | None) -> None:
        self.on_finish = on_finish
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens: dict[tuple[int, int], int] = {}

    def update(self, prompt_index: int, out: RequestOutput) -> None:
        num_tokens = self.num_tokens
        for c in out.outputs:
            key = (prompt_index, c.index)
            n = len(c.token_ids)
            if n > num_tokens.get(key, 0):
                num_tokens[key] = n
                self.last_token = time.monotonic()
                self.first_token = self.first_token or self.last_token

    def finish(self, outputs: list[RequestOutput]) -> None:
        if self.on_finish is None:
            return
        end = time.monotonic()
        longest = max(self.num_tokens.values(), default=0)
        ttft = None if self.first_token is None else self.first_token - self.start
        tpot = (self.last_token - self.first_token) / (longest - 1) if longest > 1 else None
        self.on_finish(ttft=ttft, tpot=tpot, e2e=end - self.start,
                       prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                       generation_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
                       finish_reasons=[c.finish_reason or "abort" for o in outputs for c in o.outputs])


def _clamp(lp: float) -> float:
    return max(lp, LOGPROB_JSON_FLOOR)   # JSON has no -inf (vLLM clamps the same way)


def _token_str(token_id: int, lp: Logprob) -> str:
    """The token's text, or vLLM's "token_id:N" when there is none (no tokenizer)."""
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)


class OpenAIServing:
    """The /v1/completions and /v1/chat/completions handlers.

    Args:
        engine: the running AsyncLLMEngine.
        model_names: names accepted in the ``model`` field (the first is reported in responses).
        chat_template: a Jinja chat template that replaces the tokenizer's, or None.
        on_request_finished: called with the request's latencies and token counts (metrics), or None.
        model_aliases: further names accepted in ``model`` (the model's path); responses show model_names[0].
        trust_request_chat_template: accept a request's ``chat_template`` (else 400); it renders under
            ``REQUEST_CHAT_TEMPLATE_TIME_LIMIT`` seconds.
        media_policy: where chat images may come from (``entrypoints/media.py``); default: data URLs only.
    """

    def __init__(self, engine: AsyncLLMEngine, model_names: list[str], chat_template: str | None = None,
                 on_request_finished: Callable[..., None] | None = None, model_aliases: list[str] | None = None,
                 trust_request_chat_template: bool = False, media_policy: MediaPolicy | None = None) -> None:
        self.engine = engine
        self.media_policy = media_policy or MediaPolicy()
        self.model_names = model_names
        self.model_aliases = set(model_aliases or []) - set(model_names)
        self.chat_template = chat_template
        self.on_request_finished = on_request_finished
        self.trust_request_chat_template = trust_request_chat_template
        self.request_chat_template_time_limit = REQUEST_CHAT_TEMPLATE_TIME_LIMIT
        self.tokenizer = engine.engine.tokenizer
        # a model with an image processor (multimodal); a text-only model refuses image content parts
        self.takes_images = getattr(getattr(engine.engine, "input_processor", None), "mm_processor", None) is not None
        mc = engine.engine.config.model_config
        self.max_model_len = mc.max_model_len
        # encoder-decoder (T5): the prompt is the encoder input (at most the model's max_encoder_len tokens); the
        # decoder starts from one token, which is what max_model_len bounds with the completion
        self.is_encoder_decoder = mc.is_encoder_decoder
        self.max_encoder_len = mc.max_encoder_len
        self.prompt_limit = PromptLimit(mc.max_model_len, mc.max_encoder_len if mc.is_encoder_decoder else None)
        self.max_prompt_chars = self.prompt_limit.tokens * _longest_token_chars(self.tokenizer)
        self.preprocess = concurrent.futures.ThreadPoolExecutor(NUM_PREPROCESS_THREADS,
                                                                thread_name_prefix="hayabusa-preprocess")

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run CPU work (tokenization, a template) on the preprocessing threads."""
        return await asyncio.get_running_loop().run_in_executor(self.preprocess, fn, *args)

    def end_open_requests(self, message: str) -> int:
        """End every open request with ServerShuttingDown (shutdown after the drain). Returns how many."""
        return self.engine.fail_open_requests(ServerShuttingDown(message))

    def _check_prompt_chars(self, num_chars: int, param: str, truncating: bool) -> None:
        """A cheap bound before tokenizing: a text longer than the prompt limit (max_model_len; encoder-decoder:
        max_encoder_len) x the longest vocabulary token cannot fit, so it is refused without spending the
        tokenizer's time on it."""
        if num_chars > self.max_prompt_chars and not truncating:
            raise self.prompt_limit.too_many_chars(num_chars, self.max_prompt_chars, param)

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, req: CompletionRequest) -> dict[str, Any] | SSEStream:
        model = self._check_common(req)
        if req.suffix:
            raise OpenAIError(400, "suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(400, f"best_of={req.best_of} is not supported; leave it unset or equal to n.",
                              param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}.",
                              param="logprobs")
        if self.is_encoder_decoder and (req.echo or req.prompt_logprobs is not None):
            name = "echo" if req.echo else "prompt_logprobs"
            raise OpenAIError(400, f"{name} is not supported for encoder-decoder models (the prompt is the "
                                   "encoder's input, which has no next-token logprobs).", param=name)
        if req.use_beam_search:
            return await self._beam_search_completion(req, model)
        prompt_lp = self._completion_prompt_logprobs(req)
        # vLLM: echo with max_tokens=0 scores the prompt alone (one token is generated and dropped)
        echo_only = bool(req.echo) and req.max_tokens == 0
        prompts = await self._completion_prompts(req)
        self._check_num_choices(req.n * len(prompts))
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        params = []
        for i, (_, ids) in enumerate(prompts):
            try:
                params.append(self._sampling_params(req, 1 if self.is_encoder_decoder else len(ids),
                                                    1 if echo_only else req.max_tokens, req.logprobs))
                params[-1].prompt_logprobs = prompt_lp
            except OpenAIError as e:
                if len(prompts) > 1:
                    e.message = f"prompt[{i}]: {e.message}"    # which prompt of the request's list
                raise
        echo_texts = [self._prompt_text(t, ids) if req.echo else "" for t, ids in prompts]
        streams = await self._add_all(rid, prompts, params)
        header = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
        if req.stream:
            return SSEStream(self._stream_completion(header, req, streams, echo_texts,
                                                     [ids for _, ids in prompts]), streams)
        outs = await self._collect(streams)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                text, entries = ("", []) if echo_only else (c.text, c.logprobs or [])
                lp = None
                if req.logprobs is not None:
                    lp = self._echo_logprobs(out, entries) if req.echo else self._completion_logprobs(entries, 0)
                choices.append({"index": i * req.n + c.index, "text": echo_texts[i] + text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if req.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = logprobs_json(out.prompt_logprobs)
                if req.return_token_ids:   # vLLM: the prompt's ids as the engine got them, the output's ids
                    choices[-1].update(prompt_token_ids=list(prompts[i][1]),
                                       token_ids=[] if echo_only else list(c.token_ids))
        return {**header, "choices": choices, "usage": self._usage(outs), "system_fingerprint": None}

    async def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise OpenAIError(400, "prompt must not be empty.", param="prompt")
        self._check_num_choices(req.n * len(items))           # before any tokenizing
        texts = [item for item in items if isinstance(item, str)]
        truncating = req.truncate_prompt_tokens is not None
        for text in texts:
            self._check_prompt_chars(len(text), "prompt", truncating)
        if texts:
            if self.tokenizer is None:
                self._tokenize("", req.add_special_tokens, "prompt")      # raises: no tokenizer
            encoded = iter(await self._off_loop(self._tokenize_all, texts, req.add_special_tokens))
        out = []
        for item in items:
            if isinstance(item, str):
                ids, text = next(encoded), item
            else:
                ids, text = list(item), None
            out.append((text, self._truncate_and_check(ids, req, "prompt")))
        return out

    def _tokenize_all(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [self._tokenize(t, add_special_tokens, "prompt") for t in texts]

    async def _stream_completion(self, header: dict, req: CompletionRequest, streams: list[RequestStream],
                                 echo_texts: list[str], prompt_ids: list[list[int]] | None = None
                                 ) -> AsyncIterator[bytes]:
        usage_opts = req.stream_options
        continuous_usage = bool(usage_opts and usage_opts.continuous_usage_stats)
        timer = RequestTimer(self.on_request_finished)
        prefix = _chunk_prefix(header)
        n = req.n
        sent_text: dict[tuple[int, int], int] = {}
        sent_ids: dict[tuple[int, int], int] = {}
        last: dict[int, RequestOutput] = {}

        echo_only = bool(req.echo) and req.max_tokens == 0   # the prompt alone: the generated token is dropped
        echo_chars: dict[int, int] = {}     # echo with logprobs: the prompt tokens' characters (text_offset base)

        def chunks(pi: int, out: RequestOutput) -> bytes:
            """The SSE events of one output: one per choice with new tokens, or that finished, or to echo."""
            last[pi] = out
            events = []
            for c in out.outputs:
                key = (pi, c.index)
                n_ids = sent_ids.get(key, 0)
                first = key not in sent_text      # this choice's first event
                echo = echo_texts[pi] if first else ""
                n_tok = len(c.token_ids)
                finish_reason = c.finish_reason
                if n_ids < 0 or not (n_tok > n_ids or finish_reason or echo):
                    continue                      # finished already, or nothing new for this choice
                n_text = sent_text.get(key, 0)
                text = "" if echo_only else c.text
                entries = [] if echo_only else (c.logprobs or [])[n_ids:]
                if req.logprobs is None:
                    lp = "null"
                elif echo:      # the first event: the prompt's tokens and logprobs, then the output's so far
                    lp = json.dumps(self._echo_logprobs(out, entries), ensure_ascii=False)
                    echo_chars[pi] = self._prompt_chars(out)
                else:
                    lp = json.dumps(self._completion_logprobs(entries, n_text + echo_chars.get(pi, 0)),
                                    ensure_ascii=False)
                sent_text[key] = len(text)
                sent_ids[key] = -1 if finish_reason is not None else n_tok
                usage = f', "usage": {json.dumps(self._usage([out]))}' if continuous_usage else ""
                ids = ""
                if req.return_token_ids:   # vLLM: the new ids of each chunk; the prompt's in the choice's first
                    ids = (f', "prompt_token_ids": {json.dumps(list(prompt_ids[pi])) if first else "null"}'
                           f', "token_ids": {json.dumps([] if echo_only else list(c.token_ids[n_ids:]))}')
                events.append(f'{prefix}{{"index": {pi * n + c.index}, "text": {_json_str(echo + text[n_text:])}, '
                              f'"logprobs": {lp}, "finish_reason": {_json(finish_reason)}, '
                              f'"stop_reason": {_json(c.stop_reason)}{ids}}}]{usage}}}\n\n')
            return "".join(events).encode()

        try:
            async for pi, out in self._merge(streams, timer):
                data = chunks(pi, out)
                if data:
                    yield data
            outs = [last[i] for i in sorted(last)]
            if usage_opts and usage_opts.include_usage:
                yield sse({**header, "choices": [], "usage": self._usage(outs)})
            timer.finish(outs)
        except (HayabusaValidationError, RuntimeError) as e:
            yield _error_event(e)
        finally:
            for s in streams:
                s.close()
        yield sse("[DONE]")

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | SSEStream:
        model = self._check_common(req)
        # "required" or a named function asks for a tool call, which hayabusa cannot make: refused with or
        # without tools (without them it was silently ignored, and the answer was plain text).
        if req.tool_choice not in (None, "none", "auto"):
            raise OpenAIError(400, "tool calling is not supported (tool_choice must be 'none' or 'auto'), got "
                              f"{ascii(req.tool_choice)[:100]}.", param="tool_choice")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}.",
                              param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        self._check_num_choices(req.n)
        self._check_prompt_chars(_conversation_chars(req), "messages", req.truncate_prompt_tokens is not None)
        text, images = await self._render_chat(req)
        self._check_prompt_chars(len(text), "messages", req.truncate_prompt_tokens is not None)   # tools, a template
        ids = self._truncate_and_check(await self._off_loop(self._tokenize, text, req.add_special_tokens,
                                                            "messages"), req, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._sampling_params(req, len(ids), max_tokens, k, max_tokens_param=(
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"))
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            streams = await self._add_all(rid, [(text, ids)], [params],
                                          {"image": images} if images else None)
        except HayabusaValidationError as e:
            if e.parameter == "prompt":
                e.parameter = "messages"
            raise
        header = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
        if req.stream:
            return SSEStream(self._stream_chat({**header, "object": "chat.completion.chunk"}, req, streams[0], k,
                                               ids if req.return_token_ids else None), streams)
        out = (await self._collect(streams))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None if k is None else {"content": self._chat_logprobs(c.logprobs or [], k)},
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        if req.return_token_ids:   # vLLM: the prompt's ids as the engine got them, each choice's output ids
            for choice, c in zip(choices, out.outputs):
                choice["token_ids"] = list(c.token_ids)
            header["prompt_token_ids"] = list(ids)
        return {**header, "choices": choices, "usage": self._usage([out]), "system_fingerprint": None}

    async def _render_chat(self, req: ChatCompletionRequest) -> tuple[str, list[Any]]:
        """The conversation as prompt text, rendered exactly as LLM.chat renders it (chat_utils.render_chat), on a
        preprocessing thread; a request's own template (when trusted) on a thread of its own, under a time limit.
        Images in the messages are decoded (or fetched, when the media policy allows) on a preprocessing thread
        first; returns (text, images)."""
        template = self.chat_template
        if req.chat_template is not None:
            if not self.trust_request_chat_template:
                raise OpenAIError(400, "chat_template in a request is not accepted by this server (the operator can "
                                  "allow it with --trust-request-chat-template).", param="chat_template")
            # The request's own Jinja template (vLLM extra). Only a template string: never a path to read a file
            # of the server's from (render_chat would take a string without Jinja syntax for a path).
            if not any(c in req.chat_template for c in "{}\n"):
                raise OpenAIError(400, "chat_template must be a Jinja template string (file paths are not accepted "
                                  "in requests).", param="chat_template")
            template = req.chat_template
        if self.tokenizer is not None and not (template or getattr(self.tokenizer, "chat_template", None)):
            raise OpenAIError(400, "this model has no chat template; start the server with --chat-template FILE "
                              "(or use /v1/completions).", param="messages")
        messages = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            d.setdefault("content", None)
            messages.append(d)
        messages, images = await self._off_loop(extract_images, messages, self.media_policy)
        if images and not self.takes_images:   # LLM.chat's rule (chat_prompt), before the template's placeholder check
            raise OpenAIError(400, f"the messages hold {len(images)} image(s), but this model takes text only.",
                              param="messages")

        def render() -> str:
            return render_chat(self.tokenizer, messages, chat_template=template,
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, tools=req.tools or None,
                               chat_template_kwargs=req.chat_template_kwargs)

        try:
            if req.chat_template is None:
                text = await self._off_loop(render)
            else:
                limit = self.request_chat_template_time_limit
                text = await run_with_time_limit(render, limit)
            if images:
                check_placeholders(text, len(images))
            return text, images
        except TimeLimitExceeded:
            raise OpenAIError(400, f"chat_template took longer than {limit:g} s to render.",
                              param="chat_template") from None
        except ChatTemplateError as e:
            # render_chat names "messages"; with the request's own template, the template is what to blame.
            if req.chat_template is not None:
                raise OpenAIError(400, str(e).replace("the chat template", "chat_template", 1),
                                  param="chat_template") from None
            raise

    async def _stream_chat(self, header: dict, req: ChatCompletionRequest, stream: RequestStream,
                           k: int | None, prompt_ids: list[int] | None = None) -> AsyncIterator[bytes]:
        """The chat stream's chunks. ``prompt_ids`` (return_token_ids, vLLM's): the first chunk carries them as
        "prompt_token_ids", and every content chunk's choice its new output ids as "token_ids"."""
        usage_opts = req.stream_options
        continuous_usage = bool(usage_opts and usage_opts.continuous_usage_stats)
        timer = RequestTimer(self.on_request_finished)
        prefix = _chunk_prefix(header)
        sent_text: dict[int, int] = {}
        sent_ids: dict[int, int] = {}
        out = None
        try:
            async for _, out in self._merge([stream], timer):
                events = []
                for c in out.outputs:
                    i = c.index
                    if i not in sent_text:
                        first = {"prompt_token_ids": list(prompt_ids)} if prompt_ids is not None and not sent_text \
                            else {}
                        sent_text[i], sent_ids[i] = 0, 0
                        events.append(sse({**header, **first,
                                           "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]}))
                    n_ids = sent_ids[i]
                    n_tok = len(c.token_ids)
                    finish_reason = c.finish_reason
                    if n_ids < 0 or (n_tok == n_ids and finish_reason is None):
                        continue
                    text = c.text
                    lp = "null" if k is None else json.dumps(
                        {"content": self._chat_logprobs((c.logprobs or [])[n_ids:], k)}, ensure_ascii=False)
                    delta = _json_str(text[sent_text[i]:])
                    sent_text[i] = len(text)
                    sent_ids[i] = -1 if finish_reason is not None else n_tok
                    usage = f', "usage": {json.dumps(self._usage([out]))}' if continuous_usage else ""
                    new_ids = "" if prompt_ids is None else f', "token_ids": {json.dumps(list(c.token_ids[n_ids:]))}'
                    events.append(f'{prefix}{{"index": {i}, "delta": {{"content": {delta}}}, "logprobs": {lp}, '
                                  f'"finish_reason": {_json(finish_reason)}, "stop_reason": {_json(c.stop_reason)}'
                                  f'{new_ids}}}]{usage}}}\n\n'.encode())
                if events:
                    yield b"".join(events)
            if usage_opts and usage_opts.include_usage and out is not None:
                yield sse({**header, "choices": [], "usage": self._usage([out])})
            timer.finish([out] if out is not None else [])
        except (HayabusaValidationError, RuntimeError) as e:
            yield _error_event(e)
        finally:
            stream.close()
        yield sse("[DONE]")

    # ------------------------------------------------------------------ shared steps
    def _check_common(self, req: SamplingFields) -> str:
        if req.model is not None and req.model not in self.model_names and req.model not in self.model_aliases:
            raise OpenAIError(404, f"The model `{req.model}` does not exist; this server serves "   # OpenAI's 404
                              f"{', '.join(self.model_names)}.", param="model", type="invalid_request_error",
                              code="model_not_found")
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options can only be given with stream=true.", param="stream_options")
        if req.model_extra:
            unknown = []
            for name, value in req.model_extra.items():
                if name not in UNSUPPORTED_FIELDS:
                    unknown.append(name)
                elif value is not None and value not in UNSUPPORTED_FIELDS[name]:
                    raise OpenAIError(400, f"{name} is not supported yet; leave it unset (or null).", param=name)
            if unknown:   # ascii(): names from the client cannot forge a log line
                logger.warning("ignoring unknown request field(s): %.1000s",   # at most 1000 characters of them
                               ", ".join(ascii(n[:100]) for n in sorted(unknown)[:20]))
        if req.model is None or req.model in self.model_aliases:
            return self.model_names[0]
        return req.model

    @staticmethod
    def _check_num_choices(num: int) -> None:
        if num > MAX_CHOICES:
            raise OpenAIError(400, f"a request may ask for at most {MAX_CHOICES} completions (n x prompts), "
                              f"got {num}.", param="n")

    def _tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError(400, "text prompts need a tokenizer (the server was started with "
                              "skip_tokenizer_init); send token ids.", param=param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _truncate_and_check(self, ids: list[int], req: SamplingFields, param: str) -> list[int]:
        k = req.truncate_prompt_tokens
        if k is not None and isinstance(k, int) and k >= 1:
            ids = ids[-k:]
        if self.is_encoder_decoder:   # the engine's rule for encoder inputs (encoder_decoder_inputs.py)
            if len(ids) > self.max_encoder_len:
                raise self.prompt_limit.too_many_tokens(len(ids), param)
            return ids
        try:
            # the engine's one rule; OpenAI's message and code
            check_prompt_length(len(ids), self.max_model_len)
        except HayabusaValidationError:
            raise self.prompt_limit.too_many_tokens(len(ids), param) from None
        return ids

    def _sampling_params(self, req: SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                         logprobs: int | None, max_tokens_param: str = "max_tokens") -> SamplingParams:
        """vLLM's mapping. max_tokens None: generate up to max_model_len; more than the prompt leaves is a 400,
        with vLLM's message."""
        left = self.max_model_len - num_prompt_tokens
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise HayabusaValidationError(f"{max_tokens_param} must be at least 1, got {max_tokens}.",
                                          parameter=max_tokens_param, value=max_tokens)
        if max_tokens is not None and max_tokens > left:
            raise OpenAIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                              f"messages, {max_tokens} in the completion). Please reduce the length of the "
                              "messages or completion.", param=max_tokens_param, code="context_length_exceeded")
        bias = None
        if req.logit_bias:
            # string keys (JSON) -> token ids; biases clamped to [-100, 100] (OpenAI's range, as vLLM clamps)
            bias = {}
            for k, v in req.logit_bias.items():
                try:
                    bias[int(k)] = min(100.0, max(-100.0, float(v)))
                except ValueError:
                    raise OpenAIError(400, f"logit_bias keys must be token ids (integers as strings), got "
                                      f"{k[:40]!r}.", param="logit_bias") from None
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            max_tokens=left if max_tokens is None else max_tokens, min_tokens=req.min_tokens,
            logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens, logit_bias=bias,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            structured_outputs=structured_outputs_of(req))

    async def _add_all(self, rid: str, prompts: list[tuple[str | None, list[int]]],
                       params: list[SamplingParams], multi_modal_data: dict[str, Any] | None = None
                       ) -> list[RequestStream]:
        """Add one engine request per prompt; if one is refused, the others are aborted and the error raised.
        ``multi_modal_data`` (a chat's images) goes with every prompt."""
        streams: list[RequestStream] = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
                prompt = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
                if multi_modal_data:
                    prompt["multi_modal_data"] = multi_modal_data
                sub_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                try:
                    streams.append(await self.engine.add_request(sub_id, prompt, sp))
                except HayabusaValidationError as e:
                    if len(prompts) == 1:
                        raise
                    raise e.prefixed(f"prompt[{i}]") from None   # which prompt of the request's list
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def _merge(self, streams: list[RequestStream], timer: RequestTimer
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams as they come, until every one has finished."""
        if len(streams) == 1:
            while True:
                out = await streams[0].get()
                timer.update(0, out)
                yield 0, out
                if out.finished:
                    return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                while True:
                    out = await s.get()
                    q.put_nowait((i, out, None))
                    if out.finished:
                        return
            except Exception as e:  # noqa: BLE001 -- re-raised by the consumer below
                q.put_nowait((i, None, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, out, err = await q.get()
                if err is not None:
                    raise err
                timer.update(i, out)
                yield i, out
                remaining -= out.finished
        finally:
            for t in tasks:
                t.cancel()

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Wait for every stream's final output (non-streaming responses)."""
        timer = RequestTimer(self.on_request_finished)
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in self._merge(streams, timer):
                last[i] = out
        finally:
            for s in streams:
                s.close()
        outs = [last[i] for i in range(len(streams))]
        timer.finish(outs)
        return outs

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    @staticmethod
    def _usage(outs: list[RequestOutput]) -> dict[str, int]:
        """OpenAI's usage; an encoder-decoder request's prompt tokens are its encoder input's."""
        prompt = sum(len(o.prompt_token_ids if getattr(o, "encoder_prompt_token_ids", None) is None
                         else o.encoder_prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _beam_search_completion(self, req: CompletionRequest, model: str) -> dict[str, Any]:
        """``use_beam_search``: the ``n`` best beams of each prompt as its choices (vLLM: beam width = n)."""
        from hayabusa.beam_search import beam_search_async
        from hayabusa.sampling_params import BeamSearchParams

        for name, bad in (("stream", req.stream), ("logprobs", req.logprobs is not None), ("echo", req.echo),
                          ("prompt_logprobs", req.prompt_logprobs is not None)):
            if bad:
                raise OpenAIError(400, f"{name} with use_beam_search is not supported yet.", param=name)
        prompts = await self._completion_prompts(req)
        self._check_num_choices(req.n * len(prompts))
        left = min(self.max_model_len - len(ids) for _, ids in prompts)
        max_tokens = left if req.max_tokens is None else req.max_tokens
        self._sampling_params(req, max(len(ids) for _, ids in prompts), max_tokens, None)   # the usual checks
        params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                  temperature=req.temperature or 0.0, length_penalty=req.length_penalty)
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        outs = await beam_search_async(self.engine, [ids for _, ids in prompts], params, rid)
        choices, completion_tokens = [], 0
        for i, ((_, ids), out) in enumerate(zip(prompts, outs)):
            for j, seq in enumerate(out.sequences[:req.n]):
                gen = seq.tokens[len(ids):]
                completion_tokens += len(gen)
                text = self.tokenizer.decode(gen, skip_special_tokens=req.skip_special_tokens) \
                    if self.tokenizer is not None else ""
                choices.append({"index": i * req.n + j, "text": text, "logprobs": None,
                                "finish_reason": seq.finish_reason, "stop_reason": None})
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "system_fingerprint": None,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _completion_prompt_logprobs(self, req: CompletionRequest) -> int | None:
        """The prompt logprobs a completion request needs: ``prompt_logprobs`` (vLLM), or ``logprobs`` with
        ``echo`` (the echoed prompt's tokens carry logprobs, OpenAI's legacy shape)."""
        k = req.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise OpenAIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}.",
                              param="prompt_logprobs")
        if req.max_tokens == 0 and not req.echo:
            raise OpenAIError(400, "max_tokens must be at least 1, got 0 (0 is allowed only with echo).",
                              param="max_tokens")
        if req.echo and req.logprobs is not None:
            k = max(k or 0, req.logprobs)
        return k

    def _first_token_text(self, out: RequestOutput) -> str:
        first = out.prompt_token_ids[0]
        return self.tokenizer.decode([first]) if self.tokenizer is not None else f"token_id:{first}"

    def _prompt_chars(self, out: RequestOutput) -> int:
        """Characters of the prompt's tokens as the echoed logprobs list them (text_offset of the first output)."""
        return len(self._first_token_text(out)) + sum(
            len(next(iter(e.values())).decoded_token or "") for e in out.prompt_logprobs[1:])

    def _echo_logprobs(self, out: RequestOutput, entries: list[dict[int, Logprob]]) -> dict[str, Any]:
        """Legacy completions logprobs of the echoed prompt then the output: the first prompt token has
        ``null`` logprob and top_logprobs (nothing predicts it). text_offset counts each token's text from the
        first prompt token on (vLLM's rule)."""
        first_text = self._first_token_text(out)
        body = self._completion_logprobs(list(out.prompt_logprobs[1:]) + list(entries), len(first_text))
        for key, value in (("tokens", first_text), ("token_logprobs", None), ("top_logprobs", None),
                           ("text_offset", 0)):
            body[key].insert(0, value)
        return body

    @staticmethod
    def _completion_logprobs(entries: list[dict[int, Logprob]], text_offset: int) -> dict[str, Any]:
        """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (one per token)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for entry in entries:
            (tid, lp), *_ = entry.items()              # the sampled token comes first
            tok = _token_str(tid, lp)
            tokens.append(tok)
            token_lps.append(_clamp(lp.logprob))
            tops.append({_token_str(t, p): _clamp(p.logprob) for t, p in _ranked(entry)})
            offsets.append(text_offset)
            text_offset += len(lp.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _chat_logprobs(entries: list[dict[int, Logprob]], k: int) -> list[dict[str, Any]]:
        def one(tid: int, p: Logprob) -> dict[str, Any]:
            tok = _token_str(tid, p)
            return {"token": tok, "logprob": _clamp(p.logprob), "bytes": list(tok.encode("utf-8", "replace"))}

        content = []
        for entry in entries:
            (tid, sampled), *_ = entry.items()
            content.append({**one(tid, sampled), "top_logprobs": [one(t, p) for t, p in _ranked(entry)[:k]]})
        return content


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of the vocabulary can stand for (at least 16; 16 without a tokenizer). A
    vocabulary entry is at least as long as its text: byte-level BPE spells each byte as one character, and
    SentencePiece's byte tokens ("<0x0A>") are longer than the byte."""
    try:
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    except Exception:  # noqa: BLE001 -- a tokenizer without a vocabulary list: the default bound
        vocab = {}
    return max(16, max((len(t) for t in vocab), default=0))


def _conversation_chars(req: ChatCompletionRequest) -> int:
    """The characters of every message's text (a lower bound on the rendered prompt's length)."""
    n = 0
    for m in req.messages:
        if isinstance(m.content, str):
            n += len(m.content)
        elif m.content:
            n += sum(len(p.text or "") for p in m.content)
    return n
