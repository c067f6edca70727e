"""A torch stand-in for ``hayabusa/kernels/quant_linear.py`` (written by another change), used by these tests
only while that file is absent. It follows the same contract (see hayabusa/quantization/weight_only.py)."""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers 0..15 -> [K // 8, N] int32, k = 8 i + j in bits 4j..4j+3."""
    K, N = q.shape
    q = q.to(torch.int64).view(K // 8, 8, N)
    shifts = (4 * torch.arange(8, dtype=torch.int64, device=q.device)).view(1, 8, 1)
    packed = (q << shifts).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """[K // 8, N] int32 -> [K, N] int32 in 0..15."""
    shifts = (4 * torch.arange(8, dtype=torch.int64, device=p.device)).view(1, 8, 1)
    return ((p.to(torch.int64).unsqueeze(1) >> shifts) & 15).reshape(-1, p.shape[1]).to(torch.int32)


def quantize_int8_per_channel(w: torch.Tensor):
    s = (w.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s.to(w.dtype)


def quantize_int4_grouped(w: torch.Tensor, group_size: int = 128):
    N, K = w.shape
    G = group_size
    wg = w.float().view(N, K // G, G)
    mn, mx = wg.amin(-1), wg.amax(-1)
    s = ((mx - mn) / 15.0).clamp_min(1e-8)
    z = torch.round(-mn / s).clamp(0, 15)
    q = torch.round(wg / s[..., None] + z[..., None]).clamp(0, 15).view(N, K)
    return pack_int4(q.t().contiguous()), s.t().contiguous().to(w.dtype), z.t().contiguous().to(w.dtype)


def int8_weight_only_linear(x, qweight, scales, bias=None):
    w = qweight.to(x.dtype) * scales[:, None]
    return torch.nn.functional.linear(x, w, bias)


def int4_weight_only_linear(x, qweight, scales, zeros, group_size, bias=None):
    q = unpack_int4(qweight).to(x.dtype)                           # [K, N]
    g = torch.arange(q.shape[0], device=q.device) // group_size
    w = (q - zeros[g]) * scales[g]                                  # [K, N]
    y = x @ w
    return y + bias if bias is not None else y
