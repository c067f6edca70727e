"""Bidirectional attention within segments of packed rows (the vision towers' windows and frames), and the
pinned host -> device copy their per-forward layouts go through.

Two paths over the same segments (cumulative lengths ``cu``, every row in exactly one segment):
    varlen FlashAttention   torch.nn.attention.varlen.varlen_attn: one launch for all segments (CUDA, fp16 / bf16)
    grouped SDPA            one batched SDPA per distinct segment length (CPU, fp32, or a torch without varlen)
``build_segments`` lays one forward's segments out for the path ``use_flash_varlen`` picks; ``Segments.attend``
runs it. Kernels stay leaves: this module knows no model and no request.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def host_to_device(a: np.ndarray | Sequence[np.ndarray], device: torch.device,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array (or arrays, concatenated along dim 0) as a tensor on ``device``, converted to ``dtype`` on the
    host when given (in the same pass that concatenates: each array is read once).

    On CUDA the data goes through pinned memory (PyTorch's caching host allocator, which keeps the block until
    the copy is done) by a non-blocking copy: a copy from pageable memory would make the host wait for the work
    already queued on the device (the step's launch would wait for the vision tower). Elsewhere a plain copy.
    """
    device = torch.device(device)
    parts = [torch.from_numpy(np.ascontiguousarray(x)) for x in ([a] if isinstance(a, np.ndarray) else a)]
    cuda = device.type == "cuda"
    if len(parts) == 1 and not cuda:
        return parts[0].to(device=device, dtype=dtype or parts[0].dtype)
    host = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=dtype or parts[0].dtype,
                       pin_memory=cuda)
    at = 0
    for p in parts:
        host[at:at + len(p)].copy_(p)                 # the dtype conversion (if any) happens here, on the host
        at += len(p)
    return host.to(device, non_blocking=True) if cuda else host.to(device)


def segment_groups(cu: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Segments [cu[i], cu[i+1]) grouped by length: one [B, L] int64 index tensor per distinct length L > 0
    (built once per forward on the host and copied to ``device`` in one go, shared by every layer)."""
    starts = np.asarray(cu[:-1], dtype=np.int64)
    lens = np.diff(np.asarray(cu, dtype=np.int64))
    groups = [starts[lens == L][:, None] + np.arange(L, dtype=np.int64)[None, :] for L in np.unique(lens) if L > 0]
    if not groups:
        return []
    flat = host_to_device(np.concatenate([g.reshape(-1) for g in groups]), device)
    out, at = [], 0
    for g in groups:
        out.append(flat[at:at + g.size].view(g.shape))
        at += g.size
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Bidirectional attention within segments of q, k, v [N, H, D] -> [N, H, D]; ``groups`` from
    ``segment_groups`` (every row in exactly one segment). See ``varlen_attention_packed``."""
    return varlen_attention_packed(torch.stack([q, k, v], dim=1), groups, scale)


def varlen_attention_packed(qkv: torch.Tensor, groups: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """Bidirectional attention within segments of qkv [N, 3, H, D] (q, k, v) -> [N, H, D]; ``groups`` from
    ``segment_groups`` (every row in exactly one segment).

    Segments of equal length run as one batched SDPA call (no padding; windows mostly share a length), so the
    cost is the sum of the segments' squares, never the longest segment's square times their number. One gather
    per group takes q, k and v together (three kernel launches fewer per group than gathering each).
    """
    out = qkv.new_empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])
    for idx in groups:                                                                        # [B, L]
        qs, ks, vs = qkv[idx].permute(2, 0, 3, 1, 4).unbind(0)                               # [B, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)                           # [B, H, L, D]
        out[idx] = o.transpose(1, 2)
    return out


# The vision tower's attention on CUDA in fp16 / bf16: torch's variable-length FlashAttention, one launch per layer
# over all segments. Tests and benchmarks set this to False to compare with the grouped SDPA path.
VISION_VARLEN = True
_paths_logged: set[str] = set()


@functools.lru_cache(maxsize=None)
def flash_varlen() -> Callable | None:
    """torch's ``torch.nn.attention.varlen.varlen_attn`` as ``f(q, k, v, cu, max_len, scale) -> out``, bidirectional
    (q, k, v [T, H, D] fp16 / bf16 CUDA, last dim contiguous; cu [S + 1] int32 cumulative segment lengths on the same
    device; max_len the longest segment, a host int; out [T, H, D]), or None when the running torch has none.

    Its signature changed: torch 2.10 takes ``is_causal`` (default False), 2.11+ ``window_size=(left, right)`` with
    (-1, -1) = no window and causal only at (-1, 0). The signature is read once; each keyword that exists is passed
    with its bidirectional value. A torch without ``scale`` uses 1 / sqrt(D), so only that scale is accepted there.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
        params = inspect.signature(varlen_attn).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    fixed: dict[str, Any] = {}
    if "window_size" in params:
        fixed["window_size"] = (-1, -1)
    if "is_causal" in params:
        fixed["is_causal"] = False
    if not fixed:                   # neither keyword: we cannot say "bidirectional", so we do not use it
        return None
    has_scale = "scale" in params

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
               scale: float) -> torch.Tensor:
        if has_scale:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **fixed)
        assert abs(scale - q.shape[-1] ** -0.5) < 1e-12 * scale, scale
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **fixed)

    return attend


def use_flash_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the vision tower's attention runs as one varlen FlashAttention call per layer (CUDA, fp16 / bf16,
    ``VISION_VARLEN``, and a torch that has it) rather than the grouped SDPA path; logs the path once."""
    varlen = (VISION_VARLEN and torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
              and flash_varlen() is not None)
    path = "varlen FlashAttention (one launch per layer)" if varlen else "grouped SDPA (one per segment length)"
    if path not in _paths_logged:
        _paths_logged.add(path)
        logger.info("vision tower attention on %s %s: %s", torch.device(device).type, dtype, path)
    return varlen


@dataclass
class Segments:
    """The segments one kind of vision layer attends within (windows, or whole frames), built once per forward on
    the host and shared by every layer of that kind. Exactly one of the two layouts is set:

    cu: [S + 1] int32 on the device, cumulative segment lengths from 0 (the varlen path); max_len: the longest
        segment (host int: no device read).
    groups: ``segment_groups``'s [B, L] int64 index tensors, one per distinct length (the grouped SDPA path).
    """

    cu: torch.Tensor | None
    max_len: int
    groups: list[torch.Tensor]

    def attend(self, qkv: torch.Tensor, scale: float) -> torch.Tensor:
        """Bidirectional attention within each segment of qkv [N, 3, H, D] (q, k, v) -> [N, H, D]."""
        if self.cu is None:
            return varlen_attention_packed(qkv, self.groups, scale)
        q, k, v = qkv.unbind(1)                            # [N, H, D] views, row stride 3 * H * D (as flash-attn's
        return flash_varlen()(q, k, v, self.cu, self.max_len, scale)   # qkv-packed varlen entry passes them)


def build_segments(cus: Sequence[Sequence[int]], device: torch.device, varlen: bool) -> list[Segments]:
    """``Segments`` for each cumulative-length list of ``cus`` (lists that are the same object share one). On the
    varlen path all of them go to the device in one pinned non-blocking copy (``host_to_device``)."""
    distinct = list({id(cu): cu for cu in cus}.values())
    if not varlen:
        built = {id(cu): Segments(None, 0, segment_groups(cu, device)) for cu in distinct}
        return [built[id(cu)] for cu in cus]
    flat = host_to_device([np.asarray(cu, dtype=np.int32) for cu in distinct], device)
    built, at = {}, 0
    for cu in distinct:
        built[id(cu)] = Segments(flat[at:at + len(cu)], int(np.diff(cu).max(initial=0)), [])
        at += len(cu)
    return [built[id(cu)] for cu in cus]
