"""Rotary embedding applied in place to q and k (HF rotate-half layout): kernel + launcher + reference."""

from __future__ import annotations

import torch

from hayabusa.kernels._triton import next_power_of_2, tl, triton


@triton.jit
def rotated_halves(p, m, cos, sin, HALF: tl.constexpr):
    """RoPE of the rows at p: p [H_PAD, HALF_PAD] points at each head's first half, p + HALF at its second half;
    cos, sin [HALF_PAD] fp32 (the first half of the position's row). Returns (x1 cos - x2 sin, x2 cos + x1 sin) in
    fp32, unrounded. Every RoPE kernel goes through here, so they agree to the bit (kernels/rope_store_kv.py)."""
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def rope_in_place(p, m, cos, sin, HALF: tl.constexpr):
    """rotated_halves(p, ...) stored back at p, rounded once to p's dtype."""
    o1, o2 = rotated_halves(p, m, cos, sin, HALF)
    tl.store(p, o1.to(p.dtype.element_ty), mask=m)
    tl.store(p + HALF, o2.to(p.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_c, NQ: tl.constexpr, NK: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_d = tl.arange(0, HALF_PAD)
    offs_h = tl.arange(0, H_PAD)
    dmask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_c + offs_d, mask=dmask, other=0.0).to(tl.float32)
    # q heads
    m = (offs_h[:, None] < NQ) & dmask[None, :]
    rope_in_place(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], m, cos, sin, HALF)
    # k heads
    m = (offs_h[:, None] < NK) & dmask[None, :]
    rope_in_place(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], m, cos, sin, HALF)


def check_rotary_inputs(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> None:
    """rotary_embedding's (and rope_and_store_kv's) argument checks: q [T, H, D] and k [T, H_kv, D] with unit last
    strides and one dtype, positions [T] int64, full-width cos / sin [max_position, D], one device. Raises
    ValueError naming the mismatch."""
    if k.dim() != 3 or k.stride(-1) != 1:
        raise ValueError(f"k must be [T, H_kv, D] with a unit last stride, got {tuple(k.shape)} {k.stride()}")
    T, D = k.shape[0], k.shape[2]
    if q.dim() != 3 or q.shape[0] != T or q.shape[2] != D or q.stride(-1) != 1:
        raise ValueError(f"q must be [T={T}, H, D={D}] with a unit last stride, got {tuple(q.shape)} {q.stride()}")
    if positions.shape != (T,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be [T={T}] int64, got {tuple(positions.shape)} {positions.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D or D % 2 or cos.stride(-1) != 1 \
            or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin must both be [max_position, D={D}] (full-width rotary, even D) with a unit "
                         f"last stride, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    devices = {t.device for t in (positions, q, k, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, H_kv, D] in place (views with unit last stride are fine).

    positions [T] int64; cos, sin [max_position, D] (rotate-half layout: the two halves repeat). Only full
    rotary (rot_dim == D) is handled here; partial rotary uses the reference. Raises ValueError otherwise.
    kernels/rope_store_kv.py fuses this kernel with store_kv (same bits, one launch).
    """
    check_rotary_inputs(positions, q, k, cos, sin)
    T, NQ, D = q.shape
    if T == 0:
        return
    NK, HALF = k.shape[1], D // 2
    _rope_kernel[(T,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       cos.stride(0), NQ=NQ, NK=NK, HALF=HALF, H_PAD=next_power_of_2(max(NQ, NK)),
                       HALF_PAD=next_power_of_2(HALF))


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> None:
    """In-place reference with the kernel's math (fp32 rotation, one rounding)."""
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)
    half = c.shape[-1] // 2
    for x in (q, k):
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        x.copy_(torch.cat([x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]], -1))
