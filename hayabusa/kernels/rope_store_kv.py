"""rope_and_store_kv: RoPE and the KV-cache write in one launch (kernel + launcher + reference).

The same result, to the bit, as ``rotary_embedding(positions, q, k, cos, sin)`` followed by
``store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)``: the rotation and the cache conversion are the
very helpers those two kernels use (``rotated_halves`` / ``rope_in_place``, ``cache_values``), and the rotated k is
rounded to k's dtype before it is converted for the cache, exactly where ``_rope_kernel`` stores it and
``_store_kv_kernel`` loads it back. One launch instead of two per layer matters when decode is launch-bound (batch 1
on a small model). What differs: the k tensor itself is left unrotated (nothing reads it after the cache write:
paged_attention reads keys from the cache only), which saves its write and read.

Full-width rotary only (rot_dim == D, HF's rotate-half layout), as ``rotary_embedding``; partial rotary stays on the
sequential path (model/layers/attention.py decides).
"""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import next_power_of_2, tl, triton
from hayabusa.kernels.pdl import pdl_kwargs, pdl_wait
from hayabusa.kernels.fp8 import FP8_FORMATS, check_scale, unit_scale
from hayabusa.kernels.rotary import check_rotary_inputs, rope_in_place, rotary_embedding_ref, rotated_halves
from hayabusa.kernels.store_kv import cache_values, check_store_kv_inputs, store_kv_ref


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr,                                # q [T, H, D], k/v [T, H_kv, D], last stride 1
    k_cache_ptr, v_cache_ptr,                           # viewed as [num_slots, H_kv, D], contiguous
    pos_ptr, slot_ptr,                                  # [T] int64 each; slot -1 = padding
    cos_ptr, sin_ptr,                                   # [max_position, D] (rotate-half: halves repeat)
    k_scale_ptr, v_scale_ptr,                           # [1] fp32 each; read only when FP8_MAX > 0
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_c,
    NQ: tl.constexpr, NK: tl.constexpr, HALF: tl.constexpr,
    HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, SOFT_ROUND: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)   # kernels/pdl.py: with PDL, wait for the previous kernel here (nothing is read before)
    # One program per token. Every tile is [heads, HALF_PAD] over the first halves of the head rows; the second
    # halves are the same pointers + HALF (rotate-half pairs element i with element i + D/2).
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0).to(tl.float32)
    # q: rotated in place on every row, padding included (as _rope_kernel does; attention reads q next)
    offs_hq = tl.arange(0, HQ_PAD)
    mq = (offs_hq[:, None] < NQ) & dmask[None, :]
    rope_in_place(q_ptr + t * stride_qt + offs_hq[:, None] * stride_qh + offs_d[None, :], mq, cos, sin, HALF)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # a padding row (CUDA-graph tail or a skipped token) stores nothing, as in _store_kv_kernel
        offs_hk = tl.arange(0, HK_PAD)
        m = (offs_hk[:, None] < NK) & dmask[None, :]
        rows = offs_hk[:, None] * stride_kh + offs_d[None, :]
        k1, k2 = rotated_halves(k_ptr + t * stride_kt + rows, m, cos, sin, HALF)
        # Round to k's dtype: the values _rope_kernel writes into k and _store_kv_kernel reads back.
        k1 = k1.to(k_ptr.dtype.element_ty)
        k2 = k2.to(k_ptr.dtype.element_ty)
        pv = v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :]
        v1 = tl.load(pv, mask=m)
        v2 = tl.load(pv + HALF, mask=m)
        dst = slot * stride_cs + offs_hk[:, None] * stride_ch + offs_d[None, :]  # int64: caches pass 2**31 elements
        ty = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, cache_values(k1, k_scale_ptr, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND).to(ty),
                 mask=m)
        tl.store(k_cache_ptr + dst + HALF,
                 cache_values(k2, k_scale_ptr, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND).to(ty), mask=m)
        tl.store(v_cache_ptr + dst, cache_values(v1, v_scale_ptr, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND).to(ty),
                 mask=m)
        tl.store(v_cache_ptr + dst + HALF,
                 cache_values(v2, v_scale_ptr, FP8_MAX, FP8_MANT, FP8_EMIN, SOFT_ROUND).to(ty), mask=m)


def rope_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Rotate q in place and write rotated k and v into the paged caches at slot_mapping, in one launch.

    Bit for bit ``rotary_embedding(positions, q, k, cos, sin)`` then ``store_kv(k, v, k_cache, v_cache,
    slot_mapping, k_scale, v_scale)``, except that k itself is not modified.

    Args:
        positions: [T] int64, each token's position (row of cos / sin).
        q: [T, H, D] fp32/fp16/bf16, rotated in place; any stride on dims 0 and 1 (e.g. a view into a fused qkv
            output), stride 1 on the last dim. Every row is rotated, padding rows included.
        k, v: [T, H_kv, D], q's dtype, strides as q's; read only (k is rotated on the way into the cache).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], contiguous, any block_size; q's dtype (any float
            dtype: values are cast) or fp8 (torch.float8_e4m3fn / float8_e5m2: stored fp8(clamp(x / scale,
            -max, max)) as store_kv does).
        slot_mapping: [T] int64, slot = block_id * block_size + offset; -1 marks a padding row (nothing stored).
        cos, sin: [max_position, D] (RotaryEmbedding's buffers: rotate-half layout, the two halves repeat), any
            float dtype (read as fp32). Full-width rotary only.
        k_scale, v_scale: [1] fp32 device tensors (None = 1.0), read on the device; ignored unless the cache is fp8.
    Raises:
        ValueError: on a shape, dtype, stride or device mismatch, or a cos / sin narrower than D (partial rotary).
    The grid is (T,) and everything per token is read on the device: CUDA-graph safe, no host sync.
    """
    check_store_kv_inputs(k, v, k_cache, v_cache, slot_mapping)
    check_rotary_inputs(positions, q, k, cos, sin)
    check_scale("k_scale", k_scale, k_cache.device)
    check_scale("v_scale", v_scale, k_cache.device)
    if q.device != k_cache.device:
        raise ValueError(f"q is on {q.device}, the caches on {k_cache.device}")
    T, NQ, D = q.shape
    if T == 0:
        return
    NK, HALF = k.shape[1], D // 2
    fp8_max, mant, emin = FP8_FORMATS.get(k_cache.dtype, (0.0, 0, 0))
    unit = unit_scale(k_cache.device) if fp8_max > 0 else slot_mapping  # never read when not fp8
    _rope_store_kv_kernel[(T,)](
        q, k, v, k_cache, v_cache, positions, slot_mapping, cos, sin,
        unit if k_scale is None else k_scale, unit if v_scale is None else v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), cos.stride(0),
        NQ=NQ, NK=NK, HALF=HALF, HQ_PAD=next_power_of_2(NQ), HK_PAD=next_power_of_2(NK),
        HALF_PAD=next_power_of_2(HALF),
        FP8_MAX=fp8_max, FP8_MANT=mant, FP8_EMIN=emin, SOFT_ROUND=k_cache.device.type == "cpu",
        num_warps=4, **pdl_kwargs(q.device),
    )


def rope_and_store_kv_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> None:
    """Plain-torch rope_and_store_kv (same arguments and semantics): the two references in sequence."""
    k = k.clone()  # the kernel leaves k as it was
    rotary_embedding_ref(positions, q, k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
