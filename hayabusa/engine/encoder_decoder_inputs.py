"""Prompts of encoder-decoder models (T5): what is the encoder input, what the decoder starts from.

- A str, token ids or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` is the encoder input (tokenized as the
  tokenizer does by default: T5's appends ``</s>``); the decoder starts from ``decoder_start_token_id`` alone, as
  transformers' ``generate`` does.
- vLLM's explicit form ``{"encoder_prompt": P, "decoder_prompt": D}``: P is any of the above; D (optional, None =
  none) is a str (tokenized without special tokens) or token ids, and gets ``decoder_start_token_id`` in front
  unless it already starts with it (vLLM's rule).

Limits: the encoder input must be non-empty and at most ``ModelConfig.max_encoder_len`` tokens, the model's limit
(config.json's ``n_positions``, else 512, the length T5 was trained at), whatever ``max_model_len``: that one limits
the decoder alone (its prompt + output tokens), so a 256-token input -> 64-token extraction job can run with
max_model_len=65. The decoder prompt must leave room for one output token (``check_prompt_length``; refused naming
``decoder_prompt``, as are its out-of-vocabulary ids). A longer input is refused by name before anything is queued.
"""

from __future__ import annotations

from typing import Any

from hayabusa.engine.input_processor import InputProcessor, check_prompt_length, first_out_of_vocab
from hayabusa.errors import HayabusaValidationError
from hayabusa.sampling_params import SamplingParams


def process_encoder_decoder(ip: InputProcessor, prompt: Any,
                            params: SamplingParams) -> tuple[str | None, list[int], list[int]]:
    """Returns (encoder prompt text or None, decoder prompt ids, encoder input ids).

    Raises:
        HayabusaValidationError: naming ``prompt`` / ``encoder_prompt`` / ``decoder_prompt``.
    """
    mc = ip.model_config
    start = mc.decoder_start_token_id
    decoder_part = None
    name = "prompt"
    if isinstance(prompt, dict) and ("encoder_prompt" in prompt or "decoder_prompt" in prompt):
        extra = set(prompt) - {"encoder_prompt", "decoder_prompt"}
        if extra or "encoder_prompt" not in prompt:
            raise HayabusaValidationError(
                "an explicit encoder-decoder prompt is {'encoder_prompt': ..., 'decoder_prompt': ... (optional)}; "
                f"got keys {sorted(prompt)}.", parameter="prompt", value=sorted(prompt))
        decoder_part = prompt.get("decoder_prompt")
        prompt = prompt["encoder_prompt"]
        name = "encoder_prompt"
    for part in (prompt, decoder_part):   # text only: images are refused as for a text-only decoder
        if isinstance(part, dict):
            ip.images(part.get("multi_modal_data"))
    text, enc_ids = ip.tokenize(prompt)
    if params.truncate_prompt_tokens is not None:
        enc_ids = enc_ids[-params.truncate_prompt_tokens:]
    _check_encoder_ids(ip, enc_ids, name)
    dec_ids = [start]
    if decoder_part is not None:
        if isinstance(decoder_part, str):
            if ip.tokenizer is None:
                raise HayabusaValidationError("a text decoder_prompt needs a tokenizer.", parameter="decoder_prompt",
                                              value=decoder_part[:50])
            ids = list(ip.tokenizer(decoder_part, add_special_tokens=False).input_ids)
        elif isinstance(decoder_part, dict):
            ids = ip.tokenize(decoder_part)[1]
        else:
            ids = ip.as_ids(decoder_part)
        dec_ids = ids if ids and ids[0] == start else [start] + ids
    try:
        ip.check(dec_ids, params)      # vocab, length (room for one output token), logprobs, stop ids
    except HayabusaValidationError as e:
        if decoder_part is None or e.parameter not in ("prompt", "prompt_token_ids"):
            raise
        # the decoder's ids come from decoder_prompt: name it (the check knows only "prompt")
        raise type(e)(f"decoder_prompt: {e}", parameter="decoder_prompt", value=e.value) from None
    return text, dec_ids, enc_ids


def output_prompt(prompt: Any, encoder_text: str | None) -> str | None:
    """What ``RequestOutput.prompt`` shows for an encoder-decoder request (``encoder_text``: the first value
    ``process_encoder_decoder`` returned). vLLM's explicit form: the decoder prompt's text, as vLLM's RequestOutput
    has it (prompt / prompt_token_ids are the decoder's), or None when it was given as ids or left out. A plain
    prompt (the encoder's input alone): its text, as ``encoder_prompt`` has it too."""
    if isinstance(prompt, dict) and ("encoder_prompt" in prompt or "decoder_prompt" in prompt):
        decoder = prompt.get("decoder_prompt")
        if isinstance(decoder, dict):
            decoder = decoder.get("prompt")
        return decoder if isinstance(decoder, str) else None
    return encoder_text


def _check_encoder_ids(ip: InputProcessor, ids: list[int], name: str) -> None:
    mc = ip.model_config
    if not ids:
        raise HayabusaValidationError(f"the {name} (the encoder input) is empty (0 tokens).", parameter=name,
                                      value="")
    bad = first_out_of_vocab(ids, mc.vocab_size)
    if bad is not None:
        raise HayabusaValidationError(
            f"token id {ids[bad]} at position {bad} of the {name} is out of vocabulary (vocab_size="
            f"{mc.vocab_size}).", parameter=name, value=ids[bad])
    if len(ids) > mc.max_encoder_len:
        raise HayabusaValidationError(
            f"the {name} (the encoder input) has {len(ids)} tokens, more than the model's encoder limit of "
            f"{mc.max_encoder_len} tokens (max_encoder_len, from config.json's n_positions; max_model_len="
            f"{mc.max_model_len} limits the decoder only).", parameter=name, value=len(ids))


__all__ = ["process_encoder_decoder", "output_prompt", "check_prompt_length"]
