"""Attention backends: the same two operations (write K/V into the paged cache; causal attention over it),
Triton kernels on CUDA and their plain-torch references on CPU; the Triton backend also fuses RoPE into the
cache write (``rope_and_store_kv``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable                      # kernels/store_kv.py: store_kv or store_kv_ref
    paged_attention: Callable               # kernels/paged_attention.py: paged_attention or paged_attention_ref
    # kernels/rope_store_kv.py: RoPE on q and k + store_kv in one launch, bit-identical to the Triton rotary kernel
    # followed by store_kv. None: no fused op (CPU: RoPE and the cache write stay two plain-torch steps).
    rope_and_store_kv: Callable | None = None


def get_attention_backend(device: torch.device, batch_invariant: bool = False) -> AttentionBackend:
    """Triton kernels on CUDA, torch references elsewhere.

    batch_invariant: attention whose per-row bits do not depend on the batch or on prompt chunking: on CUDA the
    same Triton kernel with its one fixed tile configuration and no split-KV, on CPU ``paged_attention_bi_ref``
    (kernels/batch_invariant.py). The KV-cache write and RoPE are per token already."""
    import functools

    from hayabusa.kernels import paged_attention as pa
    from hayabusa.kernels import rope_store_kv as rskv
    from hayabusa.kernels import store_kv as skv

    if batch_invariant:
        from hayabusa.kernels.batch_invariant import paged_attention_bi_ref

        if device.type == "cuda":
            return AttentionBackend("triton-batch-invariant", skv.store_kv,
                                    functools.partial(pa.paged_attention, batch_invariant=True),
                                    rskv.rope_and_store_kv)
        return AttentionBackend("torch-batch-invariant", skv.store_kv_ref, paged_attention_bi_ref)
    if device.type == "cuda":
        return AttentionBackend("triton", skv.store_kv, pa.paged_attention, rskv.rope_and_store_kv)
    return AttentionBackend("torch", skv.store_kv_ref, pa.paged_attention_ref)
