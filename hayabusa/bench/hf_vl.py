"""The HF Transformers baseline for image workloads (W8): ``Qwen2_5_VLForConditionalGeneration.generate`` (or
Qwen2-VL's), SDPA, batch 1, greedy, EOS suppressed (``min_new_tokens = max_new_tokens``).

Inputs are made with transformers' own pieces: the checkpoint's image processor (``AutoImageProcessor``: the PIL
variant when torchvision is absent) gives ``pixel_values`` and ``image_grid_thw``; each ``<|image_pad|>`` of the
chat template's text is repeated ``grid_t * grid_h * grid_w / merge_size**2`` times, as ``Qwen2_5_VLProcessor``
does (the processor class itself also loads a video processor, which needs torchvision). The time of a request
includes its preprocessing, as hayabusa's does.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hayabusa.bench.common import peak_memory_bytes, reset_peak_memory, synchronize
from hayabusa.bench.runner import RunResult, warmup_requests
from hayabusa.bench.workloads import BenchRequest, Workload, image_chat_messages
from hayabusa.config import DTYPES
from hayabusa.entrypoints.media import IMAGE_PLACEHOLDER


def load_hf_vl(model_dir: str, dtype: str | None, device: torch.device) -> tuple[Any, Any, Any]:
    """(model, image processor, tokenizer) of a Qwen2-VL / Qwen2.5-VL checkpoint, model in eval mode on `device`."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    if dtype in (None, "auto"):
        torch_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        torch_dtype = DTYPES[dtype]
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="sdpa")
    return model.to(device).eval(), AutoImageProcessor.from_pretrained(model_dir), \
        AutoTokenizer.from_pretrained(model_dir)


def hf_vl_inputs(image_processor: Any, tokenizer: Any, text: str, images: list[Any]) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / pixel_values / image_grid_thw of one prompt (its text holds one
    IMAGE_PLACEHOLDER per image), expanded as the Qwen2-VL processors expand them."""
    kw: dict[str, Any] = {}
    if images:
        out = image_processor(images=images, return_tensors="pt")
        kw = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        merge = image_processor.merge_size ** 2
        parts = text.split(IMAGE_PLACEHOLDER)
        assert len(parts) == len(images) + 1, "one placeholder per image"
        counts = [int(g.prod()) // merge for g in out["image_grid_thw"]]
        text = parts[0] + "".join(IMAGE_PLACEHOLDER * n + p for n, p in zip(counts, parts[1:]))
    enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], **kw}


def hf_vl_generate(model: Any, inputs: dict[str, torch.Tensor], max_tokens: int, ignore_eos: bool) -> list[int]:
    """Greedy ids of one prompt (batch 1)."""
    dev = next(model.parameters()).device
    kw: dict[str, Any] = dict(max_new_tokens=max_tokens, do_sample=False)
    if ignore_eos:
        kw["min_new_tokens"] = max_tokens
    with torch.inference_mode():
        out = model.generate(**{k: v.to(dev) for k, v in inputs.items()}, **kw)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _one(model: Any, ip: Any, tok: Any, r: BenchRequest) -> tuple[int, list[int]]:
    from PIL import Image

    text = tok.apply_chat_template(image_chat_messages(r), tokenize=False, add_generation_prompt=True)
    inputs = hf_vl_inputs(ip, tok, text, [Image.fromarray(a) for a in r.images or []])
    return int(inputs["input_ids"].shape[1]), hf_vl_generate(model, inputs, r.max_tokens, ignore_eos=True)


def run_hf_images(model_dir: str, workload: Workload, dtype: str | None, device: torch.device, seed: int = 0,
                  warmup: bool = True, use_tqdm: bool = True) -> RunResult:
    """Time the first ``workload.hf_batch1_requests`` requests (all when None) one at a time."""
    cuda = device.type == "cuda"
    reset_peak_memory(cuda)
    t0 = time.perf_counter()
    model, ip, tok = load_hf_vl(model_dir, dtype, device)
    startup_s = time.perf_counter() - t0
    torch.manual_seed(seed)
    reqs = workload.requests[: workload.hf_batch1_requests or len(workload.requests)]
    try:
        if warmup:
            _one(model, ip, tok, warmup_requests(workload)[0])
        it = reqs
        if use_tqdm:
            from tqdm.auto import tqdm

            it = tqdm(reqs, desc=f"HF {workload.name} batch 1", dynamic_ncols=True)
        synchronize(cuda)
        t1 = time.perf_counter()
        prompt_tokens = output_tokens = 0
        for r in it:
            n_prompt, ids = _one(model, ip, tok, r)
            prompt_tokens += n_prompt
            output_tokens += len(ids)
        synchronize(cuda)
        elapsed = time.perf_counter() - t1
        notes = [] if len(reqs) == len(workload.requests) else [
            f"HF baseline timed the first {len(reqs)} of {len(workload.requests)} requests (batch 1)"]
        return RunResult(elapsed_s=elapsed, num_requests=len(reqs), num_sequences=len(reqs),
                         prompt_tokens=prompt_tokens, output_tokens=output_tokens, startup_s=startup_s,
                         peak_memory_bytes=peak_memory_bytes(cuda), notes=notes,
                         extra={"hf_batch_size": 1, "attn_implementation": "sdpa", "dtype": str(model.dtype)})
    finally:
        del model
        reset_peak_memory(cuda)
