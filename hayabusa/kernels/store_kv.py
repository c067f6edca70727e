"""store_kv: write this step's K/V rows into the paged KV cache (kernel + launcher + reference).

With an fp8 cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) the rows are quantized on the way in:
stored = fp8(clamp(x / scale, -max, max)) with the layer's k_scale / v_scale (see kernels/fp8.py).
"""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import next_power_of_2, tl, triton
from hayabusa.kernels.fp8 import FP8_FORMATS, check_scale, is_fp8, quantize_fp8_ref, round_to_fp8_grid, unit_scale


@triton.jit
def cache_values(x, scale_ptr, FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr,
                 SOFT_ROUND: tl.constexpr):
    """Rows x (k or v, in their own dtype) as the cache stores them, before the final cast to the cache dtype:
    unchanged, or for an fp8 cache clamp(x / scale, -max, max) in fp32 (scale_ptr: [1] fp32). Shared by every
    kernel that writes the cache, so they store the same bits (kernels/rope_store_kv.py)."""
    if FP8_MAX > 0:  # quantize: fp8(clamp(x / scale)), saturating at the format's largest finite value
        # div_rn: IEEE division as torch does it (plain `/` is the approximate div.full.f32 on NVIDIA), so the
        # stored bits equal store_kv_ref's
        x = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -FP8_MAX), FP8_MAX)
        if SOFT_ROUND:  # the CPU interpreter's fp8 cast does not round correctly (see kernels/fp8.py)
            x = round_to_fp8_grid(x, FP8_MANT, FP8_EMIN)
    return x


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,  # slot: [T] int64, -1 = padding
    stride_kt, stride_kh, stride_vt, stride_vh,       # k, v: [T, H_kv, D], last stride 1
    stride_cs, stride_ch,                             # caches viewed as [num_slots, H_kv, D]
    k_scale_ptr, v_scale_ptr,                         # [1] fp32 each; read only when FP8_MAX > 0
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr,
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
    k = cache_values(k, k_scale_ptr, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
    v = cache_values(v, v_scale_ptr, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_store_kv_inputs(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """store_kv's argument checks (also rope_and_store_kv's). Raises ValueError naming the mismatch."""
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
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write k, v into the paged caches at slot_mapping (in place).

    Args:
        k, v: [T, H_kv, D] fp32/fp16/bf16. Any stride on dims 0 and 1 (e.g. views into a fused qkv output),
            stride 1 on the last dim.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], contiguous; values are cast to the cache dtype.
            An fp8 cache (torch.float8_e4m3fn / float8_e5m2) stores fp8(clamp(x / scale, -max, max)), round to
            nearest even, max = 448 (e4m3) or 57344 (e5m2).
        slot_mapping: [T] int64, slot = block_id * block_size + offset; -1 marks a padding row (skipped).
        k_scale, v_scale: [1] fp32 device tensors (the layer's scales; None = 1.0). Read on the device, so a
            captured CUDA graph sees later changes. Ignored unless the cache is fp8.
    Raises:
        ValueError: on a shape, dtype, stride or device mismatch.
    The grid is (T,), so a CUDA graph captured at a padded T stays valid (padding rows carry slot -1).
    """
    check_store_kv_inputs(k, v, k_cache, v_cache, slot_mapping)
    check_scale("k_scale", k_scale, k_cache.device)
    check_scale("v_scale", v_scale, k_cache.device)
    T, H_kv, D = k.shape
    if T == 0:
        return
    fp8_max, mant, emin = FP8_FORMATS.get(k_cache.dtype, (0.0, 0, 0))
    unit = unit_scale(k_cache.device) if fp8_max > 0 else slot_mapping  # never read when not fp8
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        unit if k_scale is None else k_scale, unit if v_scale is None else v_scale,
        NUM_KV_HEADS=H_kv, HEAD_DIM=D,
        H_PAD=next_power_of_2(H_kv), D_PAD=next_power_of_2(D),
        FP8_MAX=fp8_max, FP8_MANT=mant, FP8_EMIN=emin, SOFT_ROUND=k_cache.device.type == "cpu",
        num_warps=4 if H_kv * D >= 1024 else 2,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Plain-torch store_kv (same arguments and semantics); also the CPU engine's path."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, H_kv, D], a view
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if is_fp8(k_cache.dtype):  # index_put through uint8 views: not every torch build indexes fp8 tensors
        kq = quantize_fp8_ref(k[keep], 1.0 if k_scale is None else k_scale, k_cache.dtype)
        vq = quantize_fp8_ref(v[keep], 1.0 if v_scale is None else v_scale, v_cache.dtype)
        k_flat.view(torch.uint8)[slots] = kq.view(torch.uint8)
        v_flat.view(torch.uint8)[slots] = vq.view(torch.uint8)
        return
    k_flat[slots] = k[keep].to(k_cache.dtype)
    v_flat[slots] = v[keep].to(v_cache.dtype)
