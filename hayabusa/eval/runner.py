"""Run the eval items on one setting: hayabusa (``LLM.generate``, one engine per setting) or the HF Transformers
reference (``generate``, greedy).

Timing follows the extraction users' method: the whole set is submitted at once and latency per item is the
wall time of that batch divided by the number of items (after a 2-token warm-up, so Triton autotuning and CUDA
graph warm-up are not charged to the first setting). Peak memory is ``torch.cuda.max_memory_allocated`` from
engine construction to the end (it includes the KV cache the engine reserves); None on CPU.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from hayabusa.bench.common import is_cuda, load_hf_model, peak_memory_bytes, reset_peak_memory, synchronize
from hayabusa.eval.data import EvalItem


@dataclass
class RunOutput:
    """What one setting produced. texts[i] is None for an item that did not run (see item_errors)."""

    label: str
    engine: str                                   # "hayabusa" or "hf"
    setting: dict[str, Any]
    texts: list[list[str] | None] = field(default_factory=list)
    token_ids: list[list[list[int]] | None] = field(default_factory=list)   # [item][sample] output ids (hayabusa)
    item_errors: dict[int, str] = field(default_factory=dict)
    elapsed_s: float | None = None
    startup_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    peak_memory_bytes: int | None = None
    kv_cache_tokens: int | None = None
    error: str | None = None                      # the setting failed as a whole (engine rejected it, OOM, ...)


def _sampling_params(sampling: dict[str, Any], index: int, sampling_seed: int) -> Any:
    from hayabusa import SamplingParams

    kw = dict(sampling)
    if kw.get("temperature", 1.0) > 0 and kw.get("seed") is None:
        kw["seed"] = sampling_seed + index          # sampled tasks: reproducible per item, batch-invariant
    elif kw.get("seed") is not None:
        kw["seed"] = kw["seed"] + index
    return SamplingParams(**kw)


def engine_prompt(item: EvalItem) -> dict[str, Any]:
    """The item's prompt for ``LLM.generate``: its token ids, and its images as ``multi_modal_data``."""
    if item.images:
        return {"prompt_token_ids": item.prompt_token_ids, "multi_modal_data": {"image": item.images}}
    return {"prompt_token_ids": item.prompt_token_ids}


def run_hayabusa(model: str, items: list[EvalItem], engine_args: dict[str, Any], sampling: dict[str, Any],
                 label: str, setting: dict[str, Any], sampling_seed: int = 0, warmup: bool = True,
                 use_tqdm: bool = False, schemas: list[dict] | None = None) -> RunOutput:
    """Build ``LLM(model, **engine_args)``, generate every item, and release the engine. Never raises for a bad
    setting: the error is returned in ``RunOutput.error``. ``schemas``: each item's output constrained to its
    JSON schema (structured outputs)."""
    from hayabusa import LLM, SamplingParams

    run = RunOutput(label, "hayabusa", setting)
    cuda = is_cuda(engine_args.get("device"))
    reset_peak_memory(cuda)
    llm = None
    try:
        t0 = time.perf_counter()
        llm = LLM(model, **engine_args)
        run.startup_s = time.perf_counter() - t0
        mc = llm.llm_engine.config.model_config
        enc_dec = bool(mc.is_encoder_decoder)   # T5: the prompt is the encoder input, bounded by the encoder limit
        ok, run.item_errors = _items_that_fit(items, mc.max_encoder_len if enc_dec else mc.max_model_len, enc_dec)
        prompts = [engine_prompt(items[i]) for i in ok]
        params = [_sampling_params(sampling, i, sampling_seed) for i in ok]
        if schemas is not None:
            from hayabusa.sampling_params import StructuredOutputsParams

            params = [p.clone(structured_outputs=StructuredOutputsParams(json=schemas[i]))
                      for p, i in zip(params, ok)]
        if warmup and ok:
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
            if hasattr(llm, "reset_prefix_cache"):
                llm.reset_prefix_cache()                # the warm-up prompt must not be a prefix-cache hit
        synchronize(cuda)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm) if ok else []
        synchronize(cuda)
        run.elapsed_s = time.perf_counter() - t1
        run.texts = [None] * len(items)
        run.token_ids = [None] * len(items)
        for i, out in zip(ok, outs):
            run.texts[i] = [c.text for c in out.outputs]
            run.token_ids[i] = [list(c.token_ids) for c in out.outputs]
        run.prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        run.output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        run.peak_memory_bytes = peak_memory_bytes(cuda)
        run.kv_cache_tokens = int(llm.llm_engine.kv_cache_capacity_tokens)
    except Exception as e:  # noqa: BLE001 -- one bad setting must not lose the others
        _record_failure(run, e, len(items), show_traceback=not isinstance(e, ValueError))
    finally:
        del llm
        reset_peak_memory(cuda)
    return run


def _too_long(num_tokens: int, limit: int, encoder_decoder: bool) -> str:
    if encoder_decoder:
        return f"prompt has {num_tokens} tokens, more than the model's encoder limit of {limit} tokens"
    return f"prompt has {num_tokens} tokens; max_model_len={limit} leaves no room for an answer"


def _items_that_fit(items: list[EvalItem], limit: int, encoder_decoder: bool) -> tuple[list[int], dict[int, str]]:
    """(indices of the items a run takes, {index: why not} for the others). A decoder-only prompt must leave
    ``limit`` (max_model_len) room for one output token; a T5 prompt is the encoder input, at most ``limit`` (the
    model's encoder limit) tokens whatever max_model_len, which bounds the decoder alone."""
    ok = [i for i, it in enumerate(items) if len(it.prompt_token_ids) < limit + encoder_decoder]
    taken = set(ok)
    return ok, {i: _too_long(len(it.prompt_token_ids), limit, encoder_decoder)
                for i, it in enumerate(items) if i not in taken}


def _record_failure(run: "RunOutput", e: BaseException, num_items: int, show_traceback: bool) -> None:
    """A setting that failed: its row shows the error and no answers (a bad value, ValueError, needs no traceback)."""
    if show_traceback:
        traceback.print_exc()
    run.error = f"{type(e).__name__}: {e}"
    run.texts = [None] * num_items


def _hf_eos_and_pad(model_dir: str, tokenizer: Any) -> tuple[list[int], int]:
    from hayabusa.config import eos_token_ids, load_hf_config

    eos = list(eos_token_ids(model_dir, load_hf_config(model_dir, False)))     # the ids the engine stops at
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return eos, pad


def _decode_continuation(tokenizer: Any, prompt: list[int], ids: list[int]) -> str:
    """The text the ids add after the prompt (as an incremental detokenizer sees it: SentencePiece's leading
    space of the first word is kept), falling back to decoding the ids alone."""
    full = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(ids, skip_special_tokens=True)


def run_hf(model: str, items: list[EvalItem], tokenizer: Any, max_tokens: int, dtype: str | None = None,
           device: str | None = None, batch_size: int = 1, max_model_len: int | None = None) -> RunOutput:
    """Greedy HF ``generate`` on the same prompt token ids (EOS from generation_config.json, the model's own
    generation defaults such as repetition_penalty cleared), ``batch_size`` items at a time (left-padded)."""
    import torch

    from hayabusa.model.loader import resolve_model_dir

    run = RunOutput("hf (reference)", "hf", {"engine": "hf", "batch_size": batch_size})
    dev = torch.device(device if device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    reset_peak_memory(cuda)
    hf = None
    try:
        model_dir = resolve_model_dir(model)
        if any(it.images for it in items):
            _run_hf_images(run, model_dir, items, tokenizer, max_tokens, dtype, dev)
            return run
        t0 = time.perf_counter()
        hf = load_hf_model(model_dir, dtype, dev)
        run.startup_s = time.perf_counter() - t0
        eos, pad = _hf_eos_and_pad(model_dir, tokenizer)
        run.texts = [None] * len(items)
        enc_dec = bool(getattr(hf.config, "is_encoder_decoder", False))   # T5: the prompt is the encoder input
        # T5: the encoder limit bounds the prompt whatever max_model_len (which bounds the decoder alone)
        limit = _max_position(model_dir) if enc_dec else (max_model_len or _max_position(model_dir))
        ok, run.item_errors = _items_that_fit(items, limit, enc_dec)
        # T5: the engine's decoder (its start token + the answer) holds at most max_model_len tokens
        new_tokens = min(max_tokens, (max_model_len or limit) - 1) if enc_dec else max_tokens
        synchronize(cuda)
        t1 = time.perf_counter()
        for start in range(0, len(ok), batch_size):
            idx = ok[start:start + batch_size]
            # decoder-only: the engine stops a request at max_model_len (finish "length"), so each item gets at
            # most the room its prompt leaves (the batch generates to its roomiest item, then each is cut)
            rooms = [new_tokens if enc_dec else min(new_tokens, limit - len(items[i].prompt_token_ids)) for i in idx]
            outs = _hf_generate(hf, [items[i].prompt_token_ids for i in idx], max(rooms), eos, pad, dev)
            for i, ids, room in zip(idx, outs, rooms):
                ids = ids[:room]
                run.texts[i] = [tokenizer.decode(ids, skip_special_tokens=True) if enc_dec else
                                _decode_continuation(tokenizer, items[i].prompt_token_ids, ids)]
                run.output_tokens += len(ids)
                run.prompt_tokens += len(items[i].prompt_token_ids)
        synchronize(cuda)
        run.elapsed_s = time.perf_counter() - t1
        run.peak_memory_bytes = peak_memory_bytes(cuda)
    except Exception as e:  # noqa: BLE001 -- the table still shows the hayabusa settings
        _record_failure(run, e, len(items), show_traceback=True)
    finally:
        del hf
        reset_peak_memory(cuda)
    return run


def _run_hf_images(run: RunOutput, model_dir: str, items: list[EvalItem], tokenizer: Any, max_tokens: int,
                   dtype: str | None, dev: Any) -> None:
    """The HF reference of a set with images: the VL model's ``generate`` one item at a time, inputs from the
    checkpoint's image processor (``bench/hf_vl.py``), greedy, cut at the first EOS."""
    from hayabusa.bench.hf_vl import hf_vl_generate, hf_vl_inputs, load_hf_vl

    cuda = dev.type == "cuda"
    t0 = time.perf_counter()
    model, image_processor, _ = load_hf_vl(model_dir, dtype, dev)
    run.startup_s = time.perf_counter() - t0
    eos, _ = _hf_eos_and_pad(model_dir, tokenizer)
    run.texts = [None] * len(items)
    synchronize(cuda)
    t1 = time.perf_counter()
    for i, it in enumerate(items):
        text = it.prompt_text if it.prompt_text is not None else tokenizer.decode(it.prompt_token_ids)
        inputs = hf_vl_inputs(image_processor, tokenizer, text, it.images)
        ids = hf_vl_generate(model, inputs, max_tokens, ignore_eos=False)
        ids = ids[:next((j for j, t in enumerate(ids) if t in eos), len(ids))]
        run.texts[i] = [tokenizer.decode(ids, skip_special_tokens=True)]
        run.output_tokens += len(ids)
        run.prompt_tokens += int(inputs["input_ids"].shape[1])
    synchronize(cuda)
    run.elapsed_s = time.perf_counter() - t1
    run.peak_memory_bytes = peak_memory_bytes(cuda)
    del model


def _max_position(model_dir: str) -> int:
    from hayabusa.config import derive_encoder_decoder_max_len, derive_max_model_len, load_hf_config

    cfg = load_hf_config(model_dir, False)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(cfg, "is_encoder_decoder", False):
        return derive_encoder_decoder_max_len(cfg)
    return derive_max_model_len(cfg)


def _hf_generate(model: Any, prompts: list[list[int]], max_tokens: int, eos: list[int], pad: int,
                 dev: Any) -> list[list[int]]:
    """Greedy ids per prompt, cut after the first EOS (the EOS itself dropped, as hayabusa's text does)."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    start = {}
    if model.config.is_encoder_decoder:   # keep the decoder's first token (T5: generation_config or the pad id)
        start["decoder_start_token_id"] = getattr(model.generation_config, "decoder_start_token_id", None) \
            if getattr(model.generation_config, "decoder_start_token_id", None) is not None else pad
    model.generation_config = GenerationConfig(eos_token_id=eos or None, pad_token_id=pad, **start)
    with torch.inference_mode():
        out = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos or None)
    result = []
    # encoder-decoder (T5): the output is the decoder's, after its start token
    for row in out[:, 1 if model.config.is_encoder_decoder else width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in eos), len(row))
        result.append(row[:cut])
    return result
