"""Request and error models of the OpenAI API (pydantic), with vLLM's extra sampling fields.

Field names, types and defaults follow OpenAI's API reference and vLLM's ``protocol.py``. Unknown fields are kept
(``model_extra``) and ignored with a warning, as vLLM does, so clients that send newer fields keep working. vLLM
fields that hayabusa knows but does not implement (``UNSUPPORTED_FIELDS``) are refused with a 400 naming the field
when set to anything but their default, rather than silently ignored.
Responses are plain dicts built in serving.py (streaming builds thousands of chunks a second; a dict and
``json.dumps`` cost a fraction of a pydantic model) in exactly OpenAI's shapes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# vLLM's default max_logprobs: the most top logprobs a request may ask for.
MAX_LOGPROBS = 20

# vLLM request fields (completions and chat) that hayabusa does not implement, with the values that mean "off":
# absent, null or one of these is accepted; anything else is a 400 naming the field (serving.py). Kept out of the
# models, so they arrive in ``model_extra``.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (),          # on chat; /v1/completions models it
    "use_beam_search": (False,),   # on chat; /v1/completions models it
    "length_penalty": (1.0,),
    "logits_processors": (),
    # OpenAI's legacy function calling (superseded by tools / tool_choice)
    "functions": ([],),
    "function_call": ("none",),
}


class OpenAIBaseModel(BaseModel):
    # NaN / Infinity are refused for every float field (JSON has neither; Python's json accepts both). Strict:
    # no coercion ("5" is not an int, true / 2.0 are not an n, "no" is not a bool), as the Python API; an integer
    # is still a float (``"temperature": 1``).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    suffix: str | None = None
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    # vLLM >= 0.10.2: each choice gets its prompt's ids ("prompt_token_ids") and its output ids ("token_ids"; streamed:
    # each chunk's new ids, the prompt's in the choice's first chunk)
    return_token_ids: bool | None = False
    length_penalty: float = 1.0


class ImageURL(OpenAIBaseModel):
    url: str
    detail: str | None = None      # OpenAI's "auto" / "low" / "high": accepted, the processor decides the size


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None   # {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # vLLM extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM >= 0.10.2: the response's "prompt_token_ids" (streamed: in the first chunk) and each choice's output ids
    # ("token_ids"; streamed: each chunk's new ids)
    return_token_ids: bool | None = False


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                503: "service_unavailable"}


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else
                                                         "internal_server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: Any = None) -> dict[str, Any]:
    """Every error body the server sends is built here: text the client sent (a field name, a value) that is not
    valid UTF-8 -- a lone surrogate -- is escaped (``\\ud800``), so no error response can fail to encode."""
    return {"error": {"message": _encodable(message), "type": type, "param": _encodable(param), "code": code}}


def _encodable(text: Any) -> Any:
    if type(text) is not str or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hayabusa"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
