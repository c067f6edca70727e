"""What ``hayabusa bench`` and ``hayabusa eval`` share: the device they time on (CUDA or not, synchronize, peak
memory) and the HF Transformers baseline / reference model loader."""

from __future__ import annotations

import gc
from typing import Any

import torch

from hayabusa.config import DTYPES


def is_cuda(device: str | None) -> bool:
    """Whether an engine with ``device`` ("auto" / None: CUDA when available) runs on CUDA."""
    if device in (None, "auto"):
        return torch.cuda.is_available()
    return str(device).startswith("cuda")


def reset_peak_memory(cuda: bool) -> None:
    """Free cached blocks and restart ``torch.cuda.max_memory_allocated`` (no-op off CUDA)."""
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes(cuda: bool) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last reset; None off CUDA."""
    return int(torch.cuda.max_memory_allocated()) if cuda else None


def synchronize(cuda: bool) -> None:
    """Wait for queued CUDA work before reading a clock (no-op off CUDA)."""
    if cuda:
        torch.cuda.synchronize()


def load_hf_model(model_dir: str, dtype: str | None, device: torch.device) -> Any:
    """``AutoModelForCausalLM`` (SDPA attention) on ``device`` in eval mode. dtype None / "auto": bfloat16 on CUDA,
    float32 on CPU. Raises ValueError for a dtype name hayabusa does not know."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if dtype in (None, "auto"):
        torch_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif dtype in DTYPES:
        torch_dtype = DTYPES[dtype]
    else:
        raise ValueError(f"--dtype {dtype!r}: use auto, float32, float16 or bfloat16.")
    enc_dec = getattr(AutoConfig.from_pretrained(model_dir), "is_encoder_decoder", False)   # T5: seq2seq generate
    cls = AutoModelForSeq2SeqLM if enc_dec else AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="sdpa")
    return model.to(device).eval()
