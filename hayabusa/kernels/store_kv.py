"""store_kv: write this step's K/V rows into the paged KV cache (kernel + launcher + reference)."""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import tl, triton


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,  # slot: [T] int64, -1 = padding
    stride_kt, stride_kh, stride_vt, stride_vh,       # k, v: [T, H_kv, D], last stride 1
    stride_cs, stride_ch,                             # caches viewed as [num_slots, H_kv, D]
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token (CUDA-graph tail or a skipped row): nothing to store
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # int64: a large cache holds more than 2**31 elements
    dst = slot.to(tl.int64) * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, H_kv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, H_kv, D] of one dtype, got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"k rows {tuple(k.shape[1:])} do not match cache rows {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}] int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k and v need a unit stride on the last dim, got {k.stride()} and {v.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v into the paged caches at slot_mapping (in place).

    Args:
        k, v: [T, H_kv, D] fp32/fp16/bf16. Any stride on dims 0 and 1 (e.g. views into a fused qkv output),
            stride 1 on the last dim.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], contiguous; values are cast to the cache dtype.
        slot_mapping: [T] int64, slot = block_id * block_size + offset; -1 marks a padding row (skipped).
    Raises:
        ValueError: on a shape, dtype, stride or device mismatch.
    The grid is (T,), so a CUDA graph captured at a padded T stays valid (padding rows carry slot -1).
    """
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    T, H_kv, D = k.shape
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=H_kv, HEAD_DIM=D,
        H_PAD=triton.next_power_of_2(H_kv), D_PAD=triton.next_power_of_2(D),
        num_warps=4 if H_kv * D >= 1024 else 2,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Plain-torch store_kv (same arguments and semantics); also the CPU engine's path."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, H_kv, D], a view
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = k[keep].to(k_cache.dtype)
    v_flat[slots] = v[keep].to(v_cache.dtype)
