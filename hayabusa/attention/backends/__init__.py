"""Attention backends: the same two operations (write K/V into the paged cache; causal attention over it),
Triton kernels on CUDA and their plain-torch references on CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable
    paged_attention: Callable


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA, torch references elsewhere."""
    from hayabusa.kernels import paged_attention as pa
    from hayabusa.kernels import store_kv as skv

    if device.type == "cuda":
        return AttentionBackend("triton", skv.store_kv, pa.paged_attention)
    return AttentionBackend("torch", skv.store_kv_ref, pa.paged_attention_ref)
