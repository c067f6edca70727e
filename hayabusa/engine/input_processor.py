"""InputProcessor: prompt (text, token ids or dict) + SamplingParams -> checked token ids.

Checks that need the model happen here, once, with errors that name the parameter.
"""

from __future__ import annotations

import operator
from typing import Any

from hayabusa.config import ModelConfig
from hayabusa.errors import HayabusaTypeError, HayabusaValidationError
from hayabusa.sampling_params import SamplingParams, check_utf8

PromptType = str | dict[str, Any] | list[int]


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """The one admission rule for prompt length, on every path (``LLM``, ``AsyncLLMEngine``, the server): a prompt
    must leave room for at least one generated token, so it may have at most ``max_model_len - 1`` tokens.

    Raises:
        HayabusaValidationError: (``parameter="prompt"``, ``value`` = the prompt's token count) when
            ``num_prompt_tokens >= max_model_len``; the message names both numbers.
    """
    if num_prompt_tokens >= max_model_len:
        raise HayabusaValidationError(
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for the completion: max_model_len="
            f"{max_model_len} allows at most {max_model_len - 1} prompt tokens.",
            parameter="prompt", value=num_prompt_tokens)


def first_out_of_vocab(ids: list[int], vocab_size: int) -> int | None:
    """The index of the first id outside [0, vocab_size), or None (min / max first: no Python loop when all fit)."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    return next(i for i, t in enumerate(ids) if t < 0 or t >= vocab_size)


class InputProcessor:
    """Turns one prompt into (prompt text or None, prompt token ids), and resolves ``max_tokens``.

    Args:
        model_config: the model's limits (max_model_len, vocab_size).
        tokenizer: a transformers tokenizer, or None when skip_tokenizer_init (then prompts must be token ids).
    """

    def __init__(self, model_config: ModelConfig, tokenizer: Any | None, mm_processor: Any | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.mm_processor = mm_processor    # hayabusa.multimodal.processor.MultiModalProcessor (vision models)

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids) of a text-only prompt (``process_multimodal`` takes
        images too).

        Raises:
            HayabusaValidationError: empty prompt, unknown prompt dict keys, token id outside the vocabulary,
                text without a tokenizer, or a prompt that leaves no room for one output token
                (``check_prompt_length``); a prompt with images.
        """
        text, ids, mm_inputs = self.process_multimodal(prompt, params)
        if mm_inputs:
            raise HayabusaValidationError("this entry point takes text-only prompts; images go through "
                                          "LLMEngine.add_request.", parameter="multi_modal_data", value=len(mm_inputs))
        return text, ids

    def process_multimodal(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int], list]:
        """Returns (prompt text or None, prompt token ids with image placeholders expanded, ImageInputs).

        Raises:
            HayabusaValidationError: as ``process``; images for a model without a vision tower, more images than
                ``limit_mm_per_prompt``, a placeholder count that is not the image count; the expanded prompt
                (image tokens included) leaving no room for an output token, before any image work on the
                device.
        """
        text, ids = self._tokenize(prompt)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        images = self.images(mm_data)
        if params.truncate_prompt_tokens is not None:
            if images:
                raise HayabusaValidationError("truncate_prompt_tokens cannot be used with images (it could cut an "
                                              "image's placeholder).", parameter="truncate_prompt_tokens",
                                              value=params.truncate_prompt_tokens)
            ids = ids[-params.truncate_prompt_tokens:]
        mm_inputs: list = []
        if self.mm_processor is not None and (images or self.mm_processor.image_token_id in ids):
            ids, mm_inputs = self.mm_processor.process(ids, images)
        self._check(ids, params)
        return text, ids, mm_inputs

    def images(self, mm_data: Any) -> list:
        """The prompt's images (none for ``{}`` or no "image" key).

        Raises:
            HayabusaValidationError: images for a model that takes text only (naming ``multi_modal_data``), or
                images the model's processor refuses (``parse_images``).
        """
        if self.mm_processor is None:
            if mm_data:
                raise HayabusaValidationError(
                    f"multi_modal_data was given but model {self.model_config.architecture} takes text only.",
                    parameter="multi_modal_data", value=sorted(mm_data) if isinstance(mm_data, dict) else mm_data)
            return []
        return self.mm_processor.parse_images(mm_data)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            extra = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if extra:
                raise HayabusaValidationError(
                    f"prompt dict has unsupported key(s) {sorted(extra)}; use 'prompt' or 'prompt_token_ids'.",
                    parameter="prompt", value=sorted(extra))
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise HayabusaTypeError(f"prompt must be a str, got {type(text).__name__}.", parameter="prompt",
                                            value=type(text).__name__)
                if text is not None:
                    check_utf8("prompt", text)
                return text, self._as_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise HayabusaValidationError("prompt dict needs 'prompt' or 'prompt_token_ids'.",
                                              parameter="prompt", value=prompt)
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return None, self._as_ids(prompt)
        if not isinstance(prompt, str):
            raise HayabusaTypeError(f"prompt must be a str, a list of token ids or a dict, got "
                                          f"{type(prompt).__name__}.", parameter="prompt", value=type(prompt).__name__)
        if self.tokenizer is None:
            raise HayabusaValidationError("text prompts need a tokenizer (skip_tokenizer_init=True was given); "
                                          "pass {'prompt_token_ids': [...]}.", parameter="prompt", value=prompt[:50])
        check_utf8("prompt", prompt)
        return prompt, list(self.tokenizer(prompt).input_ids)

    @staticmethod
    def _as_ids(ids: Any) -> list[int]:
        """A list of ints from a list / tuple / array of integers (numpy and 0-d torch integers included); a float
        (even 1.0 or inf), a bool or a str is refused, not rounded."""
        if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
            raise HayabusaTypeError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}.",
                                    parameter="prompt_token_ids", value=str(ids)[:80])
        if type(ids) is list and set(map(type, ids)) == {int}:
            return ids.copy()    # plain ints (the common case): checked in C, no per-item Python (issue #17)
        out = []
        for i, t in enumerate(ids):
            try:
                if isinstance(t, bool):
                    raise TypeError
                out.append(operator.index(t))
            except TypeError:
                raise HayabusaTypeError(f"prompt_token_ids must be a list of integers; position {i} holds {t!r} "
                                        f"({type(t).__name__}).", parameter="prompt_token_ids",
                                        value=repr(t)[:80]) from None
        return out

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        mc = self.model_config
        if not ids:
            raise HayabusaValidationError("the prompt is empty (0 tokens).", parameter="prompt", value="")
        bad = first_out_of_vocab(ids, mc.vocab_size)
        if bad is not None:
            raise HayabusaValidationError(
                f"token id {ids[bad]} at position {bad} of prompt_token_ids is out of vocabulary "
                f"(vocab_size={mc.vocab_size}: ids are 0 to {mc.vocab_size - 1}).",
                parameter="prompt_token_ids", value=ids[bad])
        check_prompt_length(len(ids), mc.max_model_len)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > min(mc.max_logprobs, mc.vocab_size):
                raise HayabusaValidationError(
                    f"{name}={k} is more than the engine allows (max_logprobs={mc.max_logprobs}, "
                    f"vocab_size={mc.vocab_size}); ask for fewer or raise the engine argument max_logprobs.",
                    parameter=name, value=k)
        bad_stop = [t for t in params.stop_token_ids if t >= mc.vocab_size]
        if bad_stop:
            raise HayabusaValidationError(f"stop token id {bad_stop[0]} is out of vocabulary "
                                          f"(vocab_size={mc.vocab_size}).", parameter="stop_token_ids",
                                          value=bad_stop[0])
        if params.has_logit_edits:
            self.check_logit_edits(params)

    def check_logit_edits(self, params: SamplingParams) -> None:
        """logit_bias / allowed_token_ids ids within the vocabulary; bad_words tokenized into
        ``params.bad_words_token_ids`` (vLLM's rule, ``bad_words_token_ids``).

        Raises:
            HayabusaValidationError: naming ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` (an id at or past
                vocab_size, or bad_words without a tokenizer).
        """
        V = self.model_config.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = first_out_of_vocab(ids, V)
            if bad is not None:
                raise HayabusaValidationError(f"{name} holds token id {ids[bad]}, out of vocabulary "
                                              f"(vocab_size={V}: ids are 0 to {V - 1}).", parameter=name,
                                              value=ids[bad])
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad_words: each word (leading spaces stripped) without special tokens, and
        again after a space when that gives a different first token and as many tokens (the word in the middle of
        a text). Returns the token id sequences, [n][len] ints.

        Raises:
            HayabusaValidationError: naming ``bad_words``: no tokenizer, a word with no tokens, or an id at or past
                vocab_size.
        """
        if self.tokenizer is None:
            raise HayabusaValidationError("bad_words needs the tokenizer (skip_tokenizer_init is set).",
                                          parameter="bad_words", value=words)
        V = self.model_config.vocab_size
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                raise HayabusaValidationError(f"bad word {word!r} has no tokens.", parameter="bad_words",
                                              value=word)
            out.append(list(plain))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(list(spaced))
        ids = [t for seq in out for t in seq]
        bad = first_out_of_vocab(ids, V)
        if bad is not None:
            raise HayabusaValidationError(f"bad_words tokenize to token id {ids[bad]}, out of vocabulary "
                                          f"(vocab_size={V}).", parameter="bad_words", value=ids[bad])
        return out

    # public names for the encoder-decoder prompt path (engine/encoder_decoder_inputs.py): one prompt's (text, ids)
    # unchecked; a list of ints from token ids; the decoder-prompt checks (vocab, length, logprobs, stop ids)
    tokenize = _tokenize
    as_ids = _as_ids
    check = _check

    def max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """max_tokens, or what max_model_len leaves after the prompt when it is None."""
        left = self.model_config.max_model_len - num_prompt_tokens
        return params.max_tokens if params.max_tokens is not None else max(left, 1)
