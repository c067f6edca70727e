"""vLLM's prompt types: ``from hayabusa.inputs import TextPrompt, TokensPrompt``.

They are TypedDicts, so at run time they are plain dicts: ``TokensPrompt(prompt_token_ids=[1, 2, 3])`` is
``{"prompt_token_ids": [1, 2, 3]}``, and ``LLM.generate`` / ``AsyncLLMEngine.generate`` take them like any prompt
dict. hayabusa reads the keys ``prompt``, ``prompt_token_ids`` and ``multi_modal_data`` (``{"image": ...}``, for
vision models); a dict with another of vLLM's keys (``mm_processor_kwargs``, ...) is rejected with a
HayabusaValidationError naming the key. Encoder-decoder models (T5) also take ``ExplicitEncoderDecoderPrompt``
(``encoder_prompt`` / ``decoder_prompt``).
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from hayabusa.engine.input_processor import PromptType


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (``multi_modal_data``: images for a vision model)."""

    prompt: str
    multi_modal_data: NotRequired[dict]


class TokensPrompt(TypedDict):
    """A prompt given as token ids (``prompt``, optional, is only echoed back as ``RequestOutput.prompt``)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict]


class ExplicitEncoderDecoderPrompt(TypedDict):
    """Encoder-decoder models (T5): the encoder input and the decoder's start (None: decoder_start_token_id alone;
    else text or ids, after decoder_start_token_id). See ``hayabusa/engine/encoder_decoder_inputs.py``."""

    encoder_prompt: str | list[int] | TextPrompt | TokensPrompt
    decoder_prompt: NotRequired[str | list[int] | TextPrompt | TokensPrompt | None]


__all__ = ["TextPrompt", "TokensPrompt", "ExplicitEncoderDecoderPrompt", "PromptType"]
