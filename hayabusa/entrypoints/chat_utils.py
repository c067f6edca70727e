"""Chat messages -> prompt, as vLLM renders them (``vllm/entrypoints/chat_utils.py``).

The conversation is rendered to text with the tokenizer's chat template (transformers' ``apply_chat_template``,
``tokenize=False``), then tokenized with ``add_special_tokens=False``: the template already writes every special
token it wants (``{{ bos_token }}`` included), so the tokenizer must not add a second BOS. Shared by ``LLM.chat``,
``hayabusa generate`` ``{"messages": ...}`` lines and the OpenAI server.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from hayabusa.errors import ChatTemplateError, HayabusaTypeError, HayabusaValidationError
from hayabusa.sampling_params import check_utf8

Conversation = list[dict[str, Any]]
CONTENT_FORMATS = ("auto", "string", "openai")


def load_chat_template(chat_template: str | os.PathLike | None) -> str | None:
    """A template string, or the contents of a file when ``chat_template`` is a path to one (vLLM's
    ``--chat-template`` accepts both)."""
    if chat_template is None:
        return None
    if not isinstance(chat_template, (str, os.PathLike)):
        raise HayabusaTypeError(f"chat_template must be a Jinja template string or a path to one, got "
                                f"{type(chat_template).__name__}.", parameter="chat_template",
                                value=repr(chat_template)[:80])
    text = os.fspath(chat_template)
    if not isinstance(text, str):
        raise HayabusaTypeError("chat_template must be a str path, not bytes.", parameter="chat_template",
                                value=repr(text)[:80])
    check_utf8("chat_template", text)
    if isinstance(chat_template, os.PathLike) or not any(c in text for c in "{}\n"):  # a path, not Jinja
        if not os.path.isfile(text):
            raise HayabusaValidationError(f"chat_template {text!r} looks like a file path, but there is no such "
                                          "file.", parameter="chat_template", value=text)
        with open(text, encoding="utf-8") as f:
            return f.read()
    return text


def normalize_conversation(messages: Any, content_format: str = "auto") -> Conversation:
    """Check the messages and flatten OpenAI-style content parts: ``[{"type": "text", "text": ...}, ...]`` becomes
    the texts joined by newlines ("string" content format, vLLM's choice for text-only templates; "auto" means
    "string" here). With "openai" the parts are passed to the template unchanged.

    Raises:
        HayabusaValidationError: not a list of {"role": ..., ...} dicts, or a non-text content part.
    """
    if content_format not in CONTENT_FORMATS:
        raise HayabusaValidationError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got "
                                      f"{content_format!r}.", parameter="chat_template_content_format",
                                      value=content_format)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise HayabusaValidationError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.",
                                      parameter="messages", value=type(messages).__name__)
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise HayabusaValidationError(f"messages[{i}] must be a dict with a string 'role'.",
                                          parameter="messages", value=str(msg)[:80])
        content = msg.get("content")
        _check_strings(msg, f"messages[{i}]")
        if isinstance(content, (list, tuple)) and content_format != "openai" and _has_image_part(content):
            _check_text_and_image_parts(content, i)       # the template renders the parts (media.py made them)
        elif isinstance(content, (list, tuple)) and content_format != "openai":
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type", "text") == "text":
                    if not isinstance(part.get("text"), str):
                        raise HayabusaValidationError(f"messages[{i}]: a content part of type 'text' needs a "
                                                      "'text' string.", parameter="messages", value=str(part)[:80])
                    texts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise HayabusaValidationError(f"messages[{i}]: content part of type {kind!r} is not supported "
                                                  "(text only).", parameter="messages", value=kind)
            msg = {**msg, "content": "\n".join(texts)}
        out.append(dict(msg))
    return out


def _has_image_part(content: Sequence[Any]) -> bool:
    return any(isinstance(p, dict) and p.get("type") == "image" for p in content)


def _check_text_and_image_parts(content: Sequence[Any], i: int) -> None:
    for part in content:
        if not (isinstance(part, dict) and (part.get("type") == "image" or (part.get("type", "text") == "text"
                                                                              and "text" in part))):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise HayabusaValidationError(f"messages[{i}]: content part of type {kind!r} is not supported (text "
                                          "and images only).", parameter="messages", value=kind)


def _check_strings(value: Any, where: str, depth: int = 0) -> None:
    """Every string in a message (role, content, content parts, tool calls) is valid UTF-8."""
    if isinstance(value, str):
        try:
            check_utf8("messages", value)
        except HayabusaValidationError as e:
            raise e.prefixed(where) from None
    elif depth < 8 and isinstance(value, dict):
        for k, v in value.items():
            _check_strings(v, f"{where}[{k!r}]", depth + 1)
    elif depth < 8 and isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            _check_strings(v, f"{where}[{j}]", depth + 1)


# chat_template_kwargs that would clash with what render_chat passes itself ("messages" and "conversations" are
# names transformers gives the conversation; a TypeError "multiple values for keyword argument" otherwise).
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset({"conversation", "conversations", "messages", "chat_template", "tokenize",
                                           "return_dict"})


def render_chat(tokenizer: Any, messages: Any, chat_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None,
                content_format: str = "auto") -> str:
    """One conversation -> prompt text (transformers ``apply_chat_template(..., tokenize=False)``).

    Args:
        chat_template: a Jinja template string or a path to one; default: the tokenizer's.
        chat_template_kwargs: extra template variables (``{"enable_thinking": False}`` for Qwen3); they override
            the named arguments, as in vLLM.

    Raises:
        HayabusaValidationError: no tokenizer, no chat template, bad messages, incompatible flags, or a template
            that fails to render (its message is passed on).
    """
    if tokenizer is None:
        raise HayabusaValidationError("chat needs a tokenizer (skip_tokenizer_init=True was given).",
                                      parameter="messages", value=None)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise HayabusaTypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}.",
                                parameter="chat_template_kwargs", value=repr(chat_template_kwargs)[:80])
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        raise HayabusaTypeError("tools must be a list of dicts (OpenAI tool definitions).", parameter="tools",
                                value=repr(tools)[:80])
    for name, flag in (("add_generation_prompt", add_generation_prompt),
                       ("continue_final_message", continue_final_message)):
        if not isinstance(flag, bool):
            raise HayabusaTypeError(f"{name} must be a bool, got {flag!r}.", parameter=name, value=flag)
    if not isinstance(content_format, str):
        raise HayabusaTypeError(f"chat_template_content_format must be a str, got {content_format!r}.",
                                parameter="chat_template_content_format", value=repr(content_format)[:80])
    template = load_chat_template(chat_template)
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise HayabusaValidationError(
            "the tokenizer has no chat template, so chat messages cannot be turned into a prompt; give one "
            "(LLM.chat(chat_template=...), or --chat-template FILE for hayabusa generate / serve), or use a text "
            "prompt instead.",
            parameter="chat_template", value=None)
    kwargs = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                  tools=tools)
    reserved = sorted(RESERVED_CHAT_TEMPLATE_KWARGS & set(chat_template_kwargs or {}))
    if reserved:
        raise HayabusaValidationError(f"chat_template_kwargs may not set {reserved}.",
                                      parameter="chat_template_kwargs", value=reserved)
    kwargs.update(chat_template_kwargs or {})
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        raise HayabusaValidationError("continue_final_message=True continues the last message instead of starting "
                                      "a new one: pass add_generation_prompt=False with it.",
                                      parameter="continue_final_message", value=True)
    conversation = normalize_conversation(messages, content_format)
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
    except HayabusaValidationError:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in templates, HF's own checks
        raise ChatTemplateError(f"the chat template failed to render the messages: {type(e).__name__}: {e}",
                                parameter="messages", value=None) from None
    if not isinstance(text, str):  # some tokenizers return a list for a batch of one
        text = text[0]
    check_utf8("messages", text)   # e.g. a lone surrogate that came in through chat_template_kwargs
    return text


def chat_prompt(tokenizer: Any, messages: Any, media_policy: Any = None, takes_images: bool = True,
                **kwargs: Any) -> dict[str, Any]:
    """``{"prompt": rendered text, "prompt_token_ids": ids}`` for the engine; ids come from
    ``tokenizer.encode(text, add_special_tokens=False)`` (vLLM: the template holds the special tokens).

    Image content parts (``entrypoints/media.py``; PIL images and numpy arrays accepted: a Python caller) are
    loaded under ``media_policy`` (default: data URLs only) and returned in order as
    ``"multi_modal_data": {"image": [...]}``; the template must write one image placeholder per image.
    ``takes_images=False`` (a text-only model): image parts are a HayabusaValidationError naming ``messages``.
    """
    from hayabusa.entrypoints.media import MediaPolicy, check_placeholders, extract_images

    messages, images = extract_images(messages, media_policy or MediaPolicy(), allow_objects=True)
    if images and not takes_images:
        raise HayabusaValidationError(f"the messages hold {len(images)} image(s), but this model takes text only.",
                                      parameter="messages", value=len(images))
    try:
        text = render_chat(tokenizer, messages, **kwargs)
    except ChatTemplateError as e:
        if not images:
            raise
        raise ChatTemplateError(f"{e} (the messages hold {len(images)} image(s): use the model's multimodal chat "
                                "template, e.g. Qwen2.5-VL's)", parameter=e.parameter, value=e.value) from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
    if images:
        check_placeholders(text, len(images))
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def is_conversation_list(messages: Any) -> bool:
    """True for a list of conversations (``[[{...}, ...], ...]``), False for one conversation."""
    return isinstance(messages, Sequence) and not isinstance(messages, (str, dict)) and bool(messages) \
        and all(isinstance(m, (list, tuple)) for m in messages)
