"""What ``hayabusa bench`` and ``hayabusa eval`` share: the device they time on (CUDA or not, synchronize, peak
memory) and the HF Transformers baseline / reference model loader."""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class GCTimer:
    """Wall time spent in Python's cyclic garbage collector (any thread) while the timer is installed.

    ``with GCTimer() as g: ...`` then ``g.seconds`` (float, s) and ``g.passes`` (int). ``clock``: the clock read
    at each pass's start and end (default ``time.perf_counter``); ``on_pause(seconds)``: called after every pass
    with its duration (e.g. to add it to a phase timer). ``install()`` / ``remove()`` do what the ``with`` does, for
    callers whose timed region is not one block. Uses ``gc.callbacks`` (Python docs, "gc - Garbage Collector
    interface")."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 on_pause: Callable[[float], None] | None = None) -> None:
        self.clock, self.on_pause = clock, on_pause
        self.seconds, self.passes, self._start = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = self.clock()
            return
        dt = self.clock() - self._start
        self.seconds += dt
        self.passes += 1
        if self.on_pause is not None:
            self.on_pause(dt)

    def install(self) -> GCTimer:
        gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def __enter__(self) -> GCTimer:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()


class AtenOpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (``with AtenOpCounter() as c: ...``): ``ops`` their names in
    order, ``n`` how many; ``marked`` how many of them ran while ``marking`` was True (a caller sets it around a
    part of the work, e.g. the device forward inside a step). What a CUDA graph replay saves in launches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.marked = 0
        self.marking = False

    @property
    def n(self) -> int:
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        self.marked += self.marking
        return func(*args, **(kwargs or {}))


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
