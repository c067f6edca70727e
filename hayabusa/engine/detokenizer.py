"""Incremental detokenization: generated token ids -> text, a step at a time, and stop strings.

Semantics follow vLLM v1 (``vllm/v1/engine/detokenizer.py``):

- ``output_text`` is the text the generated tokens add after the prompt, i.e.
  ``decode(prompt + generated)[len(decode(prompt)):]`` (no ``clean_up_tokenization_spaces``). For byte-level
  BPE (GPT-2, Qwen) that equals ``decode(generated)``; for SentencePiece the first generated token keeps its
  leading space ("▁the" after a prompt is " the"), which ``decode(generated)`` alone would strip.
- The final text is exactly what ``decode`` shows for the generated ids (bar the kept leading space above), and
  the streamed deltas join to it; a delta is never taken back. So text is emitted only once no later token can
  change it:
  - byte-level BPE (GPT-2, Qwen): a trailing character whose UTF-8 bytes are split across tokens is held back
    until its last byte arrives (U+FFFD never appears for a split character); bytes that can no longer be part of
    a character are emitted as the U+FFFD ``decode`` shows for them once a later token proves it.
  - SentencePiece with byte fallback (Llama 2, stories260K, llm-jp): transformers decodes a run of ``<0xNN>``
    tokens all or nothing: the run's text if its bytes are valid UTF-8, else one U+FFFD per byte (ASCII bytes in
    the run included). A run's text is therefore held back until the run ends (a token that is not a byte) or its
    bytes can no longer be valid UTF-8 (then each of its bytes is a final U+FFFD, emitted as it arrives).
  - When the request ends, whatever is held back is emitted as ``decode`` shows it (U+FFFD for an incomplete
    character or byte run at the end).
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

    byte fallback: emit decode(_window[:e])[len(_prefix_text):], e = where an open, still valid byte run starts
                   (len(_window) if none); the run's UTF-8 bytes are checked as they come, without decoding
    otherwise:     text = decode(_window)
                   if text is longer than _prefix_text and does not end with U+FFFD: emit the difference
                   else hold (a character is split across byte tokens, or the new ids added no text yet)
    the emitted ids become the next context.
"""

from __future__ import annotations

import codecs
import functools
import inspect
import re
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
# Without byte fallback: a split character needs at most 3 more bytes, so ids held back longer than this are
# mostly invalid bytes (or ids without text); all but the last few are then emitted once their text is final, so
# that each step stays O(new tokens). (A byte-fallback run is tracked byte by byte instead, without decoding.)
MAX_PENDING_TOKENS = 16
# How many trailing ids may still be one split character when emitting the head of the held-back ids.
_MAX_SPLIT_CHAR_TOKENS = 3


def byte_fallback_ids(tokenizer: Any) -> dict[int, int] | None:
    """``{token id: byte}`` for the ``<0xNN>`` tokens of a tokenizer whose decode treats a run of them all or
    nothing (SentencePiece byte fallback, as transformers / tokenizers decode it), else None.

    Found by behaviour, not by class: the 256 byte tokens exist, a valid run decodes to its character, and a run
    with an invalid byte decodes to one U+FFFD per byte, its ASCII byte included.
    """
    try:
        return _byte_fallback_ids(tokenizer)
    except TypeError:   # an unhashable tokenizer object: no cache
        return _byte_fallback_ids.__wrapped__(tokenizer)


@functools.lru_cache(maxsize=32)
def _byte_fallback_ids(tokenizer: Any) -> dict[int, int] | None:
    try:
        ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    except Exception:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(ids, list) or len(set(ids)) != 256 or any(not isinstance(i, int) or i == unk for i in ids):
        return None
    try:
        cat = tokenizer.decode([ids[0xE7], ids[0x8C], ids[0xAB]], skip_special_tokens=True)
        bad = tokenizer.decode([ids[0xE7], ids[0x41]], skip_special_tokens=True)
    except Exception:
        return None
    if cat != "\u732b" or bad != REPLACEMENT_CHAR * 2:
        return None
    return {tid: b for b, tid in enumerate(ids)}


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` drops: ``all_special_ids`` and every added token marked
    special (llm-jp-v3.1's ``<EOD>`` is one without a named role, so ``all_special_ids`` misses it)."""
    try:
        return _special_ids(tokenizer)
    except TypeError:   # unhashable: no cache
        return _special_ids.__wrapped__(tokenizer)


@functools.lru_cache(maxsize=32)
def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    try:
        added = tokenizer.added_tokens_decoder
        ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    except Exception:   # a tokenizer-like object without added tokens
        pass
    return frozenset(ids)


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
        self._stop_any = _stop_matcher(tuple(stop)) if len(stop) > _STOP_MATCHER_MIN else None
        self._stop_max_len = max(map(len, stop)) if stop else 0
        self._min_tokens = params.min_tokens
        self._include_stop = params.include_stop_str_in_output
        # Chars held back from streamed text so that a partial stop string is never shown.
        self._stop_buffer_length = self._stop_max_len - 1 if stop and not self._include_stop else 0
        self._last_output_text_offset = 0
        if self._tokenizer is None:
            return
        self._decode_kwargs = _decode_kwargs(self._tokenizer, params)
        self._backend_decode = _backend_decode(self._tokenizer)
        self._skip_special = params.skip_special_tokens
        # Skipped special ids never enter the window: decode drops them before decoding anyway, and a long
        # run of them would otherwise stay pending.
        self._skip_ids = special_ids(self._tokenizer) if params.skip_special_tokens else frozenset()
        # SentencePiece byte fallback: {id: byte} of the <0xNN> tokens, and the byte run at the end of the window:
        # a strict UTF-8 decoder fed its bytes while it is still valid (nothing of it emitted; it starts at
        # _run_start), or _run_invalid once it can no longer be valid (all of it emitted, one U+FFFD per byte).
        self._byte_ids = byte_fallback_ids(self._tokenizer)
        self._run: codecs.IncrementalDecoder | None = None
        self._run_start = 0
        self._run_invalid = False
        self._window, self._prefix_text = self._prompt_context(prompt_token_ids)
        self._bulk = False
        self._read_offset = len(self._window)
        self._stopped = False   # a stop string matched: nothing more is appended

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False) -> str | None:
        """Append newly generated ids, extend ``output_text`` and check the stop strings.

        Args:
            new_token_ids: ids generated this step (usually one).
            stop_terminated: the last id ended the request (EOS or one of ``stop_token_ids``); its text is then
                not added unless ``include_stop_str_in_output``.
            finished: these are the request's last ids: text held back (an incomplete character or byte run) is
                added as ``decode`` shows it, and searched for stop strings.

        Returns:
            The matched stop string (``output_text`` is then cut before it, or just after it with
            ``include_stop_str_in_output``), or None. With several ids, ``token_ids`` then ends at the id that
            completed the stop string (the ids after it are dropped).
        """
        if not new_token_ids and not finished:
            return None
        if self._tokenizer is None or self._stopped:
            self.token_ids.extend(new_token_ids)
            return None
        if self._stop and len(new_token_ids) > 1:
            # Several ids in one step (a speculative verify step's accepted run): search after each id, as steps
            # of one id would, and stop at the id that completes a stop string; the ids after it are not appended
            # (with speculation off they are never generated), so ``token_ids`` ends there.
            last = len(new_token_ids) - 1
            for i, tid in enumerate(new_token_ids):
                matched = self._update([tid], stop_terminated and i == last, finished and i == last)
                if matched is not None:
                    return matched
            return None
        return self._update(new_token_ids, stop_terminated, finished)

    def _update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool) -> str | None:
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
        if finished:
            self._flush()

        if not self._stop or len(self.token_ids) <= self._min_tokens:
            return None
        matched = self._check_stop_strings(len(self.output_text) - stop_check_offset)
        self._stopped = matched is not None
        return matched

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now.

        While not finished, the last ``max(len(stop)) - 1`` chars are held back when stop strings are set and
        not included in the output, so a partial stop string is never shown.

        Args:
            finished: the request has ended; nothing is held back (text still held back for an incomplete
                character is added as ``decode`` shows it, as ``update(..., finished=True)`` does).
            delta: return only the text not returned by earlier delta calls (else all text so far).
        """
        if finished:
            self._flush()
        buffer_length = 0 if finished else self._stop_buffer_length
        length = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[: max(length, 0)]
        start = self._last_output_text_offset
        if start >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[start:length]

    def _final_window(self, ids: list[int], stop_terminated: bool) -> list[int] | None:
        """For ``finish_all``: the window ``update(ids, stop_terminated, finished=True)`` would decode in one go
        (context + the ids that have text), or None when update must run itself (no tokenizer, stop strings,
        min_tokens, byte fallback, text still held back, or no id with text)."""
        if (self._tokenizer is None or self._stopped or self._stop or self._min_tokens or self._byte_ids is not None
                or self._read_offset != len(self._window)):
            return None
        text_ids = ids[:-1] if stop_terminated and not self._include_stop else ids
        skip = self._skip_ids
        kept = [i for i in text_ids if i not in skip] if skip else list(text_ids)
        return self._window + kept if kept else None

    # -- detokenization ---------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def _prompt_context(self, prompt_token_ids: list[int]) -> tuple[list[int], str]:
        """The last few prompt ids, starting on a character boundary, and their text.

        A window that starts inside a character would begin with U+FFFD. With byte fallback the context also
        ends before a trailing run of byte tokens: decode would join the prompt's run and a generated one into one
        run, but the output's text is decode(output ids).
        """
        n = len(prompt_token_ids)
        if self._byte_ids is not None:
            byte_ids, skip_ids = self._byte_ids, self._skip_ids
            while n and (prompt_token_ids[n - 1] in byte_ids or prompt_token_ids[n - 1] in skip_ids):
                n -= 1
        for k in range(min(PROMPT_CONTEXT_TOKENS, n), min(MAX_PROMPT_CONTEXT_TOKENS, n) + 1):
            context = list(prompt_token_ids[n - k : n])
            text = self._decode(context)
            if not text.startswith(REPLACEMENT_CHAR):
                return context, text
        context = list(prompt_token_ids[n - min(PROMPT_CONTEXT_TOKENS, n) : n])
        return context, self._decode(context)

    def _append(self, ids: list[int]) -> None:
        if not ids:
            return
        self.token_ids.extend(ids)
        kept = [i for i in ids if i not in self._skip_ids]
        if not kept:
            return
        if self._byte_ids is not None:
            self.output_text += self._append_byte_fallback(kept)
            return
        self._window.extend(kept)
        self._bulk = len(kept) > 1
        self.output_text += self._decode_pending()

    def _append_byte_fallback(self, ids: list[int]) -> str:
        """Byte fallback: emit everything but an open byte run that is still valid UTF-8 (see module doc)."""
        byte_ids, out, i = self._byte_ids, "", 0
        if self._run_invalid:
            # Bytes that continue a run already invalid add one U+FFFD each, whatever the byte. Decoding them
            # with the context would not show that when the run's start has left the window.
            while i < len(ids) and ids[i] in byte_ids:
                i += 1
            if i:
                out = REPLACEMENT_CHAR * i
                self._window, self._read_offset = [ids[i - 1]], 1
                self._prefix_text = self._decode(self._window)
        for tid in ids[i:]:
            byte = byte_ids.get(tid)
            if byte is None:
                self._run, self._run_invalid = None, False
            elif not self._run_invalid:
                if self._run is None:
                    self._run, self._run_start = codecs.getincrementaldecoder("utf-8")("strict"), len(self._window)
                try:
                    self._run.decode(bytes((byte,)))
                except UnicodeDecodeError:
                    self._run, self._run_invalid = None, True
            self._window.append(tid)
        end = self._run_start if self._run is not None else len(self._window)
        if end > self._read_offset:
            out += self._emit(self._decode(self._window[:end]), end)
        return out

    def _decode_pending(self) -> str:
        """The text the pending ids add to the context, or "" while it must be held back (no byte fallback)."""
        window, read_offset = self._window, self._read_offset
        text = self._decode(window)
        if self._is_complete(text):
            return self._emit(text, len(window))
        held_too_long = len(window) - read_offset > MAX_PENDING_TOKENS
        if held_too_long and text == self._prefix_text:
            return self._emit(text, len(window))   # the pending ids add no text: let them become context
        if held_too_long or self._bulk:
            # Emit all but a possible split character at the end if that much is final. Needed when ids come
            # in bulk (the whole output at once, LLM.generate), and when ids were held back too long (invalid
            # bytes, not a split character).
            for end in range(len(window) - 1, max(read_offset, len(window) - _MAX_SPLIT_CHAR_TOKENS - 1), -1):
                head = self._decode(window[:end])
                if self._is_final_head(head, text):
                    return self._emit(head, end)
        return ""

    def _flush(self) -> None:
        """The request ended: add the held-back ids' text as decode shows it (U+FFFD for an incomplete
        character)."""
        if self._tokenizer is None or self._stopped or self._read_offset >= len(self._window):
            return
        self._run = None
        end = len(self._window)
        self.output_text += self._emit(self._decode(self._window), end)

    def _is_complete(self, text: str) -> bool:
        return len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR)

    def _is_final_head(self, head: str, text: str) -> bool:
        """``head`` (decode of the window up to a token boundary) cannot change, given that the window decodes
        to ``text``: it adds text, ``text`` extends it, and a trailing U+FFFD in it (bytes cut short) is followed
        by more text (so those bytes are invalid, not a character still arriving). Byte-level decoding replaces
        invalid bytes as ``bytes.decode(errors="replace")`` does, which has this prefix property."""
        if len(head) <= len(self._prefix_text) or not text.startswith(head):
            return False
        return not head.endswith(REPLACEMENT_CHAR) or len(text) > len(head)

    def _emit(self, text: str, end: int) -> str:
        """Make ``_window[_read_offset:end]`` (decoded with the context: ``text``) the new context and
        return the text it adds."""
        window, read_offset = self._window, self._read_offset
        self._window, self._read_offset = window[read_offset:], end - read_offset
        self._run_start -= read_offset
        if text.startswith(self._prefix_text):
            new_text = text[len(self._prefix_text) :]
            self._prefix_text = self._decode(self._window[: self._read_offset])
        else:
            # decode() is not prefix-stable here: the prompt context ends inside a character that the first
            # generated bytes continue. Decode the new ids alone, as decode(output ids) shows them.
            new_text = self._prefix_text = self._decode(self._window[: self._read_offset])
        return new_text

    # -- stop strings -----------------------------------------------------------------------------

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Find the stop string that ends earliest in the new text (searching ``len(stop) - 1`` chars back
        too) and cut ``output_text`` at it. Returns it, or None."""
        if new_char_count <= 0:
            return None
        text = self.output_text
        window_start = max(len(text) - new_char_count - self._stop_max_len + 1, 0)
        if self._stop_any is not None and self._stop_any.search(text, window_start) is None:
            return None   # no stop string anywhere in the window the loop below searches: it would find none
        best_stop, best_start, best_end = None, 0, len(text) + 1
        for stop_str in self._stop:
            start = text.find(stop_str, max(len(text) - new_char_count - len(stop_str) + 1, 0))
            if start != -1 and start + len(stop_str) < best_end:
                best_stop, best_start, best_end = stop_str, start, start + len(stop_str)
        if best_stop is not None:
            self.output_text = text[:best_end] if self._include_stop else text[:best_start]
        return best_stop


# Above this many stop strings a request's step first runs one compiled alternation over the searched window
# (benchmarks/stop_strings.py: n = 128 with 1,000 stop strings made each step 128,000 str.find calls); only when it
# matches does the per-string loop run, so the stop chosen is the same.
_STOP_MATCHER_MIN = 4


@functools.lru_cache(maxsize=64)
def _stop_matcher(stop: tuple[str, ...]) -> re.Pattern:
    """One regex that matches wherever any of ``stop`` does (shared by a request's n samples and by requests with
    the same stop list)."""
    return re.compile("|".join(map(re.escape, stop)))


def finish_all(items: list[tuple[IncrementalDetokenizer, list[int], bool]]) -> None:
    """``detok.update(ids, stop_terminated, finished=True)`` for every ``(detok, ids, stop_terminated)`` of a step's
    final-only samples that end now (LLM.generate: each got its whole output at once), with the same text and
    token ids, but one batched decode per tokenizer for them all where that gives the answer on its own.

    A detokenizer qualifies when it has nothing pending, no stop strings, no min_tokens and no byte fallback; its
    text is then decode(context + kept ids) past the context's text, exactly what ``update`` emits when that
    decode is complete (no trailing U+FFFD) and extends the context's text. Any other case (or that check failing)
    runs ``update`` itself. The whole output in one ``update`` costs two decodes and the bulk path's Python per
    request: for 2,000 requests of 64 tokens (W9's shape, with a tokenizer) 190 us each on the CPU, 90 this way.
    """
    fast: list[tuple[IncrementalDetokenizer, list[int], bool, list[int]]] = []
    for detok, ids, stop_terminated in items:
        window = detok._final_window(ids, stop_terminated)
        if window is None:
            detok.update(ids, stop_terminated, finished=True)
        else:
            fast.append((detok, ids, stop_terminated, window))
    texts = _decode_all([(detok, window) for detok, _, _, window in fast])
    for (detok, ids, stop_terminated, window), text in zip(fast, texts):
        if not (detok._is_complete(text) and text.startswith(detok._prefix_text)):
            detok.update(ids, stop_terminated, finished=True)   # held-back or unstable text: the general rules
            continue
        # what update() leaves: every id kept, the new text emitted, the window read to its end (nothing to flush)
        detok.token_ids.extend(ids)
        detok.output_text += text[len(detok._prefix_text):]
        read_offset = detok._read_offset
        detok._window, detok._read_offset = window[read_offset:], len(window) - read_offset


def _decode_all(pairs: list[tuple[IncrementalDetokenizer, list[int]]]) -> list[str]:
    """decode(window) for each (detokenizer, window): one ``decode_batch`` per (backend tokenizer, skip flag),
    ``_decode`` one by one for a tokenizer without a plain backend decode."""
    texts: list[str | None] = [None] * len(pairs)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (detok, window) in enumerate(pairs):
        backend = getattr(detok._backend_decode, "__self__", None)
        if backend is None or not callable(getattr(backend, "decode_batch", None)):
            texts[i] = detok._decode(window)
        else:
            groups.setdefault((id(backend), detok._skip_special), []).append(i)
    for (_, skip), idx in groups.items():
        backend = pairs[idx[0]][0]._backend_decode.__self__
        for i, text in zip(idx, backend.decode_batch([pairs[i][1] for i in idx], skip_special_tokens=skip)):
            texts[i] = text
    return texts  # type: ignore[return-value]
