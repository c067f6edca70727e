"""Checks of a request body before any handler sees it, and a time limit for untrusted template code.

Every failure here is the client's: ``OpenAIError`` with status 408 (the body too slow), 413 (too large), 415 (not
JSON) or 400 (the JSON
itself: malformed, nested too deep, an integer that does not fit 64 bits, NaN / Infinity, a string that is not
valid UTF-8 -- a lone surrogate such as ``"\\ud800"`` -- naming the top-level field it is in).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from hayabusa.entrypoints.chat_utils import RESERVED_CHAT_TEMPLATE_KWARGS
from hayabusa.entrypoints.openai.protocol import OpenAIError

# JSON nested deeper than this is refused (no request field needs more; deep nesting costs recursion later on).
MAX_JSON_DEPTH = 64
INT64_MAX = (1 << 63) - 1

# Structural bounds, each checked with one len() on the parsed JSON before any per-element work (validation,
# tokenization), so that a body under the size limit cannot buy seconds of CPU with millions of tiny elements.
# Arrays + objects in a body: parsing allocates one Python object each, in one C call that holds the GIL (about
# 0.4 s per million, more when it sets off a garbage collection); 2^18 leaves room for MAX_MESSAGES messages with
# content parts. Counted on the raw bytes (brackets inside strings left out).
MAX_JSON_CONTAINERS = 262_144
# Array elements + object members (commas, outside strings): even small integers cost ~60 ms per million to parse,
# all in that one call. 4M is more token ids than 32 MiB of real ones (5-6 digits and a separator each) can hold.
MAX_JSON_ITEMS = 4_000_000
MAX_PROMPTS = 1024           # prompts in one completions request (n x prompts is capped at this too)
MAX_MESSAGES = 65_536        # messages in one chat request
# Stop strings and stop token ids: every generated token is checked against each of them (vLLM has no cap; one
# request with 100,000 stop strings slowed every other stream 8x).
MAX_STOP_STRINGS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 20   # more than any vocabulary
MAX_REQUEST_ID_CHARS = 512   # longer request_ids are refused (and ids are shortened in log lines)
# Bodies larger than this are parsed and validated on a worker thread, off the event loop.
OFF_LOOP_BODY_BYTES = 64 * 1024
# chat_template_kwargs a chat request may not set: those render_chat refuses, and the request's own fields (set
# them as fields). Others ("enable_thinking", "documents", ...) reach the template.
REQUEST_RESERVED_CHAT_TEMPLATE_KWARGS = RESERVED_CHAT_TEMPLATE_KWARGS | {"tools", "add_generation_prompt",
                                                                         "continue_final_message"}


def is_json_content_type(value: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``; a ``charset`` parameter, if any, must be utf-8
    (JSON is UTF-8, RFC 8259; the body is read as UTF-8 whatever the header says)."""
    if not value:
        return False
    media, *params = value.split(";")
    media = media.strip().lower()
    for p in params:
        name, _, v = p.partition("=")
        if name.strip().lower() == "charset" and v.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_body(request: Any, max_bytes: int, timeout: float | None = None) -> bytes:
    """The request's body, read under the size limit (while reading, so a chunked body without Content-Length is
    cut off as soon as it passes the limit) and within ``timeout`` seconds (408 then: the server closes the
    connection); 415 unless it is JSON."""
    values = request.headers.getlist("content-type")
    if len(values) > 1:
        raise OpenAIError(415, f"A request must carry one Content-Type header, got {len(values)}: {values!r}"[:300],
                          code="unsupported_media_type")
    ctype = values[0] if values else None
    if not is_json_content_type(ctype):
        raise OpenAIError(415, f"Content-Type must be application/json (charset, if given, utf-8), got {ctype!r}.",
                          code="unsupported_media_type")
    length = request.headers.get("content-length")
    too_large = f"The request body is larger than the server's limit of {max_bytes} bytes."
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise OpenAIError(413, too_large, code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise OpenAIError(413, too_large, code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"The request body was not received within {timeout:g} s.",
                          code="request_timeout") from None
    return b"".join(chunks)


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def count_json_structure(body: bytes) -> tuple[int, int]:
    """(arrays + objects, commas) of a JSON text outside its strings, without parsing it: upper bounds on the
    containers and items that parsing would build (exact for valid JSON)."""
    containers, commas = body.count(b"[") + body.count(b"{"), body.count(b",")
    if containers > MAX_JSON_CONTAINERS or commas > MAX_JSON_ITEMS:   # brackets inside strings count too:
        stripped = _STRING.sub(b"", body)                              # count again without the strings
        containers, commas = stripped.count(b"[") + stripped.count(b"{"), stripped.count(b",")
    return containers, commas


def parse_json_object(body: bytes, check_shape: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The body's JSON object: at most MAX_JSON_CONTAINERS arrays and objects, then ``check_shape(data)`` (cheap
    structural bounds), then ``check_json_values``. 400 for each failure."""
    if len(body) > MAX_JSON_CONTAINERS:
        containers, commas = count_json_structure(body)
        if containers > MAX_JSON_CONTAINERS or commas >= MAX_JSON_ITEMS:
            raise OpenAIError(400, f"The request body holds more than {MAX_JSON_CONTAINERS} JSON arrays and "
                              f"objects or more than {MAX_JSON_ITEMS} items in them; no request needs that many.",
                              code="invalid_json")
    try:
        data = json.loads(body)      # NaN / Infinity parse as floats: check_json_values names their field
    except (ValueError, RecursionError) as e:   # JSONDecodeError, bad UTF-8, 4300+ digit integers
        reason = "it is nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise OpenAIError(400, f"The request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    if check_shape is not None:
        check_shape(data)
    check_json_values(data)
    return data


def _bound(data: dict[str, Any], field: str, limit: int, what: str) -> None:
    value = data.get(field)
    if type(value) is list and len(value) > limit:
        raise OpenAIError(400, f"{field}: at most {limit} {what} are accepted, got {len(value)}.", param=field)


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt the server takes and OpenAI's 400 (``context_length_exceeded``) for a longer one.

    Decoder-only models: a prompt must leave room for one output token of ``max_model_len``. Encoder-decoder
    models (T5): the prompt is the encoder's input, limited by ``max_encoder_len`` (the model's, whatever
    max_model_len, which bounds the decoder alone); the message says so rather than speaking of a context
    length and room for the completion.
    """

    max_model_len: int
    max_encoder_len: int | None = None   # set for encoder-decoder models

    @property
    def tokens(self) -> int:
        """The most prompt tokens a token-id prompt may have before it is refused unparsed."""
        return self.max_encoder_len if self.max_encoder_len is not None else self.max_model_len

    def _head(self) -> str:
        if self.max_encoder_len is None:
            return f"This model's maximum context length is {self.max_model_len} tokens"
        return (f"This model's encoder input limit is {self.max_encoder_len} tokens (the model's encoder limit of "
                f"{self.max_encoder_len} tokens; max_model_len={self.max_model_len} limits the decoder)")

    def too_many_tokens(self, num_tokens: int, param: str = "prompt") -> OpenAIError:
        """The 400 for a prompt of ``num_tokens`` tokens, naming ``param``."""
        tail = "." if self.max_encoder_len is not None else ", which leaves no room for the completion."
        return OpenAIError(400, f"{self._head()}. However, your prompt has {num_tokens} tokens{tail}", param=param,
                           code="context_length_exceeded")

    def too_many_chars(self, num_chars: int, max_chars: int, param: str = "prompt") -> OpenAIError:
        """The 400 for a text of ``num_chars`` characters, more than ``max_chars`` (the limit in tokens x the
        longest vocabulary token) could ever tokenize to within the limit."""
        return OpenAIError(400, f"{self._head()}; a prompt of {num_chars} characters is longer than any prompt of "
                           f"that many tokens can be ({max_chars} characters).", param=param,
                           code="context_length_exceeded")


def check_request_shape(data: dict[str, Any], limit: PromptLimit | int) -> None:
    """The structural bounds (a len() each), before any per-element work: the number of prompts, messages, stop
    strings, stop token ids, bad words and allowed token ids, a token-id prompt's length (without
    ``truncate_prompt_tokens``; ``limit``: a PromptLimit, or max_model_len for a decoder-only model), the length
    of ``request_id``; reserved names in ``chat_template_kwargs``. 400 naming the field."""
    if not isinstance(limit, PromptLimit):
        limit = PromptLimit(limit)
    prompt = data.get("prompt")
    if type(prompt) is list and prompt:
        prompts = [prompt] if type(prompt[0]) is int else prompt
        if len(prompts) > MAX_PROMPTS:
            raise OpenAIError(400, f"a request may ask for at most {MAX_PROMPTS} completions (n x prompts), got "
                              f"{len(prompts)} prompts.", param="prompt")
        if data.get("truncate_prompt_tokens") is None:
            for p in prompts:
                if type(p) is list and len(p) > limit.tokens:
                    raise limit.too_many_tokens(len(p))
    _bound(data, "messages", MAX_MESSAGES, "messages")
    _bound(data, "stop", MAX_STOP_STRINGS, "stop strings")
    _bound(data, "stop_token_ids", MAX_STOP_TOKEN_IDS, "stop token ids")
    _bound(data, "bad_words", MAX_BAD_WORDS, "bad words")
    _bound(data, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, "allowed token ids")
    kwargs = data.get("chat_template_kwargs")
    if type(kwargs) is dict and not REQUEST_RESERVED_CHAT_TEMPLATE_KWARGS.isdisjoint(kwargs):
        names = sorted(REQUEST_RESERVED_CHAT_TEMPLATE_KWARGS.intersection(kwargs))
        raise OpenAIError(400, f"chat_template_kwargs may not set {', '.join(names)} (the request's own fields "
                          "and the conversation are passed to the template by the server).",
                          param="chat_template_kwargs")
    rid = data.get("request_id")
    if type(rid) is str and len(rid) > MAX_REQUEST_ID_CHARS:
        raise OpenAIError(400, f"request_id: at most {MAX_REQUEST_ID_CHARS} characters are accepted, got "
                          f"{len(rid)}.", param="request_id")


def split_token_prompt(data: dict[str, Any]) -> tuple[dict[str, Any], list | None]:
    """A prompt of token ids (a list of ints, or of lists of ints) checked here, element by element in Python (a
    worker thread running this lets the event loop in), and replaced by a one-token stand-in of the same shape in
    the returned copy of ``data``: pydantic's check of a long list is one call that holds the GIL throughout.
    Returns ``(data, None)`` when the prompt is anything else (pydantic checks it)."""
    prompt = data.get("prompt")
    if type(prompt) is not list or not prompt:
        return data, None
    if all(type(x) is int for x in prompt):
        return {**data, "prompt": [0]}, prompt
    if all(type(p) is list and p and all(type(x) is int for x in p) for p in prompt):
        return {**data, "prompt": [[0]]}, prompt
    return data, None


def check_json_values(data: dict[str, Any]) -> None:
    """400 naming the top-level field for: a string (or key) that is not valid UTF-8, a float that is not finite,
    an integer outside int64, nesting deeper than MAX_JSON_DEPTH. Iterative: no recursion on hostile input."""
    for key, value in data.items():
        where = _find_bad_value(key, 0) or _find_bad_value(value, 1)
        if where is not None:
            path, reason = where
            raise OpenAIError(400, f"{key}{path}: {reason}.", param=_printable(key))


def _find_bad_value(root: Any, root_depth: int) -> tuple[str, str] | None:
    stack: list[tuple[Any, str, int]] = [(root, "", root_depth)]
    while stack:
        value, path, depth = stack.pop()
        t = type(value)
        if t is str:
            if not value.isascii() and not _is_utf8(value):
                return path, "strings must be valid UTF-8 (a lone surrogate is not)"
        elif t is int:
            if not -INT64_MAX - 1 <= value <= INT64_MAX:
                return path, "integers must fit in 64 bits"
        elif t is float:
            if not math.isfinite(value):
                return path, "numbers must be finite"
        elif t is list or t is dict:
            if depth >= MAX_JSON_DEPTH:
                return path, f"JSON nested deeper than {MAX_JSON_DEPTH} levels is not accepted"
            if t is list:
                if all(type(x) is int and -INT64_MAX - 1 <= x <= INT64_MAX for x in value):
                    continue                                # token ids: the common large list
                stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(value))
            else:
                for k, v in value.items():
                    if not k.isascii() and not _is_utf8(k):
                        return f"{path}.{_printable(k)}", "keys must be valid UTF-8 (a lone surrogate is not)"
                    stack.append((v, f"{path}.{k}", depth + 1))
    return None


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------------------------------------------- time limit
class TimeLimitExceeded(BaseException):
    """Raised in a worker thread (asynchronously) and to the caller when the work ran out of time. A
    BaseException, so that template code (or a library) catching ``Exception`` cannot swallow it."""


def _checkpoint() -> None:
    """A Python call: a pending asynchronous exception is raised at its first instruction, inside our try."""


async def run_with_time_limit(fn: Callable[[], Any], seconds: float) -> Any:
    """Run ``fn()`` on a thread of its own; after ``seconds`` (or if the caller is cancelled) raise
    TimeLimitExceeded inside that thread, which stops pure-Python work such as a Jinja template's loops at its
    next instruction (a single long C call, like one huge string operation, is only stopped when it returns).

    Raises:
        TimeLimitExceeded: ``fn`` did not finish in time. Otherwise ``fn``'s own result or exception.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    lock = threading.Lock()
    done = False

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def worker() -> None:
        nonlocal done
        result, error = None, None
        try:
            try:
                result = fn()
            except TimeLimitExceeded:
                raise
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                error = e
            with lock:
                done = True
            _checkpoint()
        except TimeLimitExceeded:
            result, error = None, TimeLimitExceeded()
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:            # the loop has closed; nobody waits
            pass

    thread = threading.Thread(target=worker, name="hayabusa-template", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), seconds)
    except asyncio.TimeoutError:
        raise TimeLimitExceeded(f"did not finish within {seconds:g} s") from None
    finally:
        with lock:
            if not done:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(TimeLimitExceeded))
