"""Eval data: one JSONL line per item, rendered to prompt token ids once (the same ids go to every setting and to
the HF reference, so differences come from the engines, not from tokenization).

A line has a prompt -- ``"prompt": str`` or chat ``"messages": [{"role", "content"}, ...]`` -- and the answer:
  extraction: ``"gold": {...}`` (a JSON object; ``"answer"`` is accepted too);
  choice:     ``"answer": "B" | 1 | "choice text"``, optional ``"choices": [...]``;
  majority:   ``"answer": "42"`` (compared after normalize_answer).
``"id"`` is optional (default: the line number). Unknown keys are kept in ``extra`` and ignored.

Messages may hold images (content parts as in ``LLM.chat``: ``{"type": "image", "image": "pages/001.png"}`` or
``{"type": "image_url", "image_url": {"url": ...}}``): a path relative to the JSONL file's folder (files outside
that folder are refused), or a data URL. They are loaded once, with the prompt, and go to every setting as
``multi_modal_data``; the chat template must write one image placeholder per image (a VL model's template).

Chat messages are rendered with the tokenizer's chat template (add_generation_prompt=True) and encoded without
adding special tokens again (as vLLM's ``LLM.chat`` does); a plain prompt is encoded like ``LLM.generate`` encodes
text. A tokenizer without a chat template gets the plain rendering ``"{role}: {content}\\n" ... "assistant:"``
(said once on stderr) so that small base models such as the bundled demo model can run the same files.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from hayabusa.entrypoints.media import MediaPolicy, check_placeholders, extract_images
from hayabusa.errors import HayabusaValidationError
from hayabusa.eval.scoring import choice_letter, normalize_answer

TASKS = ("extraction", "choice", "majority")


@dataclass
class EvalItem:
    id: str
    prompt: str | None                   # plain prompt, or None for chat
    messages: list[dict[str, Any]] | None
    gold: Any                            # extraction: dict; choice: letter; majority: normalised answer
    choices: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)   # filled by render_items
    base_dir: str | None = None          # the JSONL file's folder: image paths are relative to it
    images: list[Any] = field(default_factory=list)             # RGB PIL images, filled by render_items
    prompt_text: str | None = None       # the rendered chat text (image items: the HF reference's processor input)


def _bad(path: str, lineno: int, why: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"{path}:{lineno}: {why}", parameter="data", value=lineno)


def load_items(path: str, task: str) -> list[EvalItem]:
    """Read and check a JSONL file for `task`.

    Raises:
        HayabusaValidationError: a line that is not JSON, has no prompt/messages, or no usable answer (the message
            names the file and line).
    """
    if task not in TASKS:
        raise HayabusaValidationError(f"task must be one of {', '.join(TASKS)}, got {task!r}.", parameter="task",
                                      value=task)
    items: list[EvalItem] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                items.append(_parse_line(path, lineno, line, task))
    if not items:
        raise HayabusaValidationError(f"{path}: no items.", parameter="data", value=path)
    return items


def _parse_line(path: str, lineno: int, line: str, task: str) -> EvalItem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise _bad(path, lineno, f"not JSON ({e.msg}).") from None
    if not isinstance(row, dict):
        raise _bad(path, lineno, "each line must be a JSON object.")
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise _bad(path, lineno, "give exactly one of \"prompt\" (a string) or \"messages\" (chat messages).")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad(path, lineno, "\"prompt\" must be a string.")
    if messages is not None and not (isinstance(messages, list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
        raise _bad(path, lineno, "\"messages\" must be a list of {\"role\", \"content\"} objects.")
    choices = row.get("choices")
    gold = row.get("gold", row.get("answer"))
    if gold is None:
        raise _bad(path, lineno, "no gold answer (\"gold\" or \"answer\").")
    try:
        gold = _check_gold(task, gold, choices)
    except ValueError as e:
        raise _bad(path, lineno, str(e)) from None
    extra = {k: v for k, v in row.items() if k not in ("id", "prompt", "messages", "gold", "answer", "choices")}
    base_dir = os.path.dirname(os.path.abspath(path))
    return EvalItem(str(row.get("id", lineno)), prompt, messages, gold, choices, extra, base_dir=base_dir)


def _check_gold(task: str, gold: Any, choices: Any) -> Any:
    if task == "extraction":
        if not isinstance(gold, dict):
            raise ValueError("extraction needs a JSON object as \"gold\".")
        return gold
    if task == "choice":
        if choices is not None and not (isinstance(choices, list) and all(isinstance(c, str) for c in choices)):
            raise ValueError("\"choices\" must be a list of strings.")
        return choice_letter(gold, choices)
    return normalize_answer(gold)


def render_items(items: list[EvalItem], tokenizer: Any) -> None:
    """Fill ``prompt_token_ids`` of every item (chat template for messages)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    warned = False
    for it in items:
        if it.messages is None:
            it.prompt_token_ids = list(tokenizer(it.prompt).input_ids)
            continue
        messages = _load_images(it)
        if it.images and not has_template:
            raise HayabusaValidationError(f"item {it.id}: it has images, but the tokenizer has no chat template to "
                                          "place them with (use the VL model's tokenizer).", parameter="data",
                                          value=it.id)
        if has_template:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if it.images:
                try:
                    check_placeholders(text, len(it.images))
                except HayabusaValidationError as e:
                    raise e.prefixed(f"item {it.id}") from None
            it.prompt_text = text
        else:
            if not warned:
                print("hayabusa eval: the tokenizer has no chat template; messages are rendered as "
                      "'role: content' lines ending with 'assistant:'.", file=sys.stderr)
                warned = True
            text = "".join(f"{m['role']}: {m['content']}\n" for m in it.messages) + "assistant:"
            it.prompt_token_ids = list(tokenizer(text).input_ids)
            continue
        it.prompt_token_ids = list(tokenizer(text, add_special_tokens=False).input_ids)


def _load_images(it: EvalItem) -> list[dict[str, Any]]:
    """The item's messages with image parts replaced by ``{"type": "image"}``; ``it.images`` filled in order.
    Relative paths resolve against the JSONL file's folder, the one folder files may come from."""
    policy = MediaPolicy(allowed_local_media_path=it.base_dir)
    try:
        messages, it.images = extract_images(it.messages, policy, base_dir=it.base_dir)
    except HayabusaValidationError as e:
        raise e.prefixed(f"item {it.id}") from None
    return messages


def load_tokenizer(model_or_dir: str, tokenizer: str | None = None, trust_remote_code: bool = False) -> Any:
    """The tokenizer the engine would load (``tokenizer`` or the model's folder / Hub id)."""
    from transformers import AutoTokenizer

    from hayabusa.model.loader import resolve_model_dir

    src = tokenizer or resolve_model_dir(model_or_dir)
    return AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
