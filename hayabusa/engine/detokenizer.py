"""Incremental detokenization: generated token ids -> text, a step at a time, and stop strings.

Semantics follow vLLM v1 (``vllm/v1/engine/detokenizer.py``):

- ``output_text`` is the text the generated tokens add after the prompt, i.e.
  ``decode(prompt + generated)[len(decode(prompt)):]`` (no ``clean_up_tokenization_spaces``). For byte-level
  BPE (GPT-2, Qwen) that equals ``decode(generated)``; for SentencePiece the first generated token keeps its
  leading space ("▁the" after a prompt is " the"), which ``decode(generated)`` alone would strip.
- A trailing character whose UTF-8 bytes are split across tokens is held back until its last byte arrives,
  so U+FFFD never appears for a split character; one still incomplete when the request ends is dropped.
- When the request ends by EOS / ``stop_token_ids`` (``stop_terminated``), that last token stays in
  ``token_ids`` but its text is not appended unless ``include_stop_str_in_output``.
- Stop strings are searched only in the newly added text plus the ``len(stop) - 1`` characters before it;
  the match that ends earliest wins (ties: order in ``params.stop``); text produced by the first
  ``min_tokens`` tokens is not searched.

The method is TGI's / vLLM's prefix_offset / read_offset: decode a short window of ids twice, with and without
the new ones, and take the difference. This module keeps only that window::

    _window:  | context (decoded already)  | pending (new, not yet emitted) |
              0                      _read_offset                   len(_window)
    _prefix_text = decode(_window[:_read_offset])

    text = decode(_window)
    if text is longer than _prefix_text and does not end with U+FFFD:
        emit text[len(_prefix_text):]; the pending ids become the next context
    else: hold (a character is split across byte tokens, or the new ids added no text yet)
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from hayabusa.errors import HayabusaValidationError
from hayabusa.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids decoded as left context of the first generated token (SentencePiece leading space); as vLLM.
PROMPT_CONTEXT_TOKENS = 5
# How far back into the prompt to look for a context that starts on a character boundary.
MAX_PROMPT_CONTEXT_TOKENS = 24
# A split character needs at most 3 more bytes, so ids held back longer than this are invalid bytes
# (or ids without text); they are emitted anyway so that each step stays O(new tokens).
MAX_PENDING_TOKENS = 16
# When emitting held-back ids anyway, first try to leave this many trailing ids pending (a split character).
_MAX_SPLIT_CHAR_TOKENS = 3


@functools.cache
def _accepts_spaces_between_special_tokens(tokenizer_cls: type) -> bool:
    # Slow (Python) tokenizers of transformers 4.x declare it and put spaces around added tokens; fast ones
    # ignore it, and some (MistralCommonBackend) reject unknown keyword arguments.
    decode = getattr(tokenizer_cls, "_decode", None)
    return decode is not None and "spaces_between_special_tokens" in inspect.signature(decode).parameters


@functools.cache
def _plain_fast_decode(tokenizer_cls: type) -> bool:
    """The class decodes with transformers' own fast-tokenizer ``decode``/``_decode``, which (without
    clean_up_tokenization_spaces) is exactly ``tokenizer._tokenizer.decode(ids, skip_special_tokens=...)``."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (getattr(tokenizer_cls, "decode", None) is PreTrainedTokenizerBase.decode
            and getattr(tokenizer_cls, "_decode", None) is PreTrainedTokenizerFast._decode)


def _backend_decode(tokenizer: PreTrainedTokenizerBase) -> Any:
    """``tokenizers.Tokenizer.decode`` of a fast tokenizer that decodes in the plain way, else None.

    Detokenizing costs two or three decodes of a few ids per token per request; transformers' ``decode`` wrapper
    (argument conversion, keyword handling) is most of that time, so the backend is called directly when that
    gives the same text.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if not _plain_fast_decode(type(tokenizer)) or not callable(getattr(backend, "decode", None)):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return backend.decode if isinstance(backend, Tokenizer) else None


def _decode_kwargs(tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> dict[str, bool]:
    # No clean_up_tokenization_spaces: it is not prefix-stable (" ." -> "."), and vLLM never applies it.
    kwargs = dict(skip_special_tokens=params.skip_special_tokens, clean_up_tokenization_spaces=False)
    if _accepts_spaces_between_special_tokens(type(tokenizer)):
        kwargs["spaces_between_special_tokens"] = params.spaces_between_special_tokens
    return kwargs


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text incrementally and checks its stop strings.

    With ``params.detokenize`` False or no tokenizer it only collects ids (``output_text`` stays "").

    Args:
        tokenizer: a Hugging Face tokenizer (transformers >= 4.56), or None to skip detokenization.
        prompt_token_ids: the prompt's ids; its last few give the first generated token its context.
        params: the request's sampling parameters (stop, min_tokens, include_stop_str_in_output,
            skip_special_tokens, spaces_between_special_tokens, detokenize).

    Raises:
        HayabusaValidationError: stop strings were given but there is no text to search (detokenize=False
            or no tokenizer); vLLM rejects ``stop`` with ``detokenize=False`` the same way.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.token_ids: list[int] = []  # generated ids, including a final stop token
        self.output_text = ""
        stop = list(params.stop or [])
        if stop and (tokenizer is None or not params.detokenize):
            why = "detokenize=False" if not params.detokenize else "the model has no tokenizer"
            raise HayabusaValidationError(
                f"stop strings need detokenized text, but {why}; got stop={stop!r}.", parameter="stop", value=stop
            )
        self._tokenizer = tokenizer if params.detokenize else None
        self._stop = stop
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        # Chars held back from streamed text so that a partial stop string is never shown.
        self._stop_buffer_length = max(map(len, stop)) - 1 if stop and not self._include_stop else 0
        self._last_output_text_offset = 0
        if self._tokenizer is None:
            return
        self._decode_kwargs = _decode_kwargs(self._tokenizer, params)
        self._backend_decode = _backend_decode(self._tokenizer)
        self._skip_special = params.skip_special_tokens
        # Skipped special ids never enter the window: decode drops them before decoding anyway, and a long
        # run of them would otherwise stay pending.
        self._skip_ids = frozenset(self._tokenizer.all_special_ids) if params.skip_special_tokens else frozenset()
        self._window, self._prefix_text = self._prompt_context(prompt_token_ids)
        self._bulk = False
        self._read_offset = len(self._window)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append newly generated ids, extend ``output_text`` and check the stop strings.

        Args:
            new_token_ids: ids generated this step (usually one).
            stop_terminated: the last id ended the request (EOS or one of ``stop_token_ids``); its text is then
                not added unless ``include_stop_str_in_output``.

        Returns:
            The matched stop string (``output_text`` is then cut before it, or just after it with
            ``include_stop_str_in_output``), or None.
        """
        if not new_token_ids:
            return None
        if self._tokenizer is None:
            self.token_ids.extend(new_token_ids)
            return None
        ids, skipped_stop_id = new_token_ids, None
        if stop_terminated and not self._include_stop:
            ids, skipped_stop_id = new_token_ids[:-1], new_token_ids[-1]

        stop_check_offset = len(self.output_text)
        if self._min_tokens and len(self.token_ids) < self._min_tokens:
            # Text of the first min_tokens tokens is never searched for stop strings (vLLM #22014).
            num_head = self._min_tokens - len(self.token_ids)
            self._append(ids[:num_head])
            stop_check_offset = len(self.output_text)
            ids = ids[num_head:]
        self._append(ids)
        if skipped_stop_id is not None:
            self.token_ids.append(skipped_stop_id)

        if not self._stop or len(self.token_ids) <= self._min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - stop_check_offset)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now.

        While not finished, the last ``max(len(stop)) - 1`` chars are held back when stop strings are set and
        not included in the output, so a partial stop string is never shown.

        Args:
            finished: the request has ended; nothing is held back.
            delta: return only the text not returned by earlier delta calls (else all text so far).
        """
        buffer_length = 0 if finished else self._stop_buffer_length
        length = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[: max(length, 0)]
        start = self._last_output_text_offset
        if start >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[start:length]

    # -- detokenization ---------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def _prompt_context(self, prompt_token_ids: list[int]) -> tuple[list[int], str]:
        """The last few prompt ids, starting on a character boundary, and their text.

        A window that starts inside a character would begin with U+FFFD; with SentencePiece byte fallback
        the whole run of byte tokens would then decode to U+FFFD (the tokenizers library decodes a run of
        byte tokens all or nothing), including the generated bytes that continue it.
        """
        n = len(prompt_token_ids)
        for k in range(min(PROMPT_CONTEXT_TOKENS, n), min(MAX_PROMPT_CONTEXT_TOKENS, n) + 1):
            context = list(prompt_token_ids[n - k :])
            text = self._decode(context)
            if not text.startswith(REPLACEMENT_CHAR):
                return context, text
        context = list(prompt_token_ids[n - min(PROMPT_CONTEXT_TOKENS, n) :])
        return context, self._decode(context)

    def _append(self, ids: list[int]) -> None:
        if not ids:
            return
        self.token_ids.extend(ids)
        kept = [i for i in ids if i not in self._skip_ids]
        if kept:
            self._window.extend(kept)
            self._bulk = len(kept) > 1
            self.output_text += self._decode_pending()

    def _decode_pending(self) -> str:
        """The text the pending ids add to the context, or "" while it must be held back."""
        window, read_offset = self._window, self._read_offset
        text = self._decode(window)
        if self._is_complete(text):
            return self._emit(text, len(window))
        held_too_long = len(window) - read_offset > MAX_PENDING_TOKENS
        if held_too_long or self._bulk:
            # Emit all but a possible split character at the end if that much is clean. Needed when ids come
            # in bulk (the whole output at once, LLM.generate), and when ids were held back too long (invalid
            # bytes, not a split character).
            for end in range(len(window) - 1, max(read_offset, len(window) - _MAX_SPLIT_CHAR_TOKENS - 1), -1):
                head = self._decode(window[:end])
                if self._is_complete(head):
                    return self._emit(head, end)
        if not held_too_long:
            return ""
        return self._emit(text, len(window))  # U+FFFD included, as decode() would show it

    def _is_complete(self, text: str) -> bool:
        return len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR)

    def _emit(self, text: str, end: int) -> str:
        """Make ``_window[_read_offset:end]`` (decoded with the context: ``text``) the new context and
        return the text it adds."""
        window, read_offset = self._window, self._read_offset
        self._window, self._read_offset = window[read_offset:], end - read_offset
        if text.startswith(self._prefix_text):
            new_text = text[len(self._prefix_text) :]
            self._prefix_text = self._decode(self._window[: self._read_offset])
        else:
            # decode() is not prefix-stable here: with SentencePiece byte fallback, an invalid byte turns the
            # whole byte run into U+FFFD, including context characters already emitted. Decode the new ids
            # alone (they start with a byte token, so no leading "▁" space is lost).
            new_text = self._prefix_text = self._decode(self._window[: self._read_offset])
        return new_text

    # -- stop strings -----------------------------------------------------------------------------

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Find the stop string that ends earliest in the new text (searching ``len(stop) - 1`` chars back
        too) and cut ``output_text`` at it. Returns it, or None."""
        if new_char_count <= 0:
            return None
        text = self.output_text
        best_stop, best_start, best_end = None, 0, len(text) + 1
        for stop_str in self._stop:
            start = text.find(stop_str, max(len(text) - new_char_count - len(stop_str) + 1, 0))
            if start != -1 and start + len(stop_str) < best_end:
                best_stop, best_start, best_end = stop_str, start, start + len(stop_str)
        if best_stop is not None:
            self.output_text = text[:best_end] if self._include_stop else text[:best_start]
        return best_stop
