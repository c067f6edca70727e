"""The structured-output token bitmask applied to logits on their device (torch only; no xgrammar here)."""

from __future__ import annotations

import numpy as np
import torch

_BITS = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> None:
    """Set to -inf, in place, the logits of the tokens each bitmask row forbids.

    Args:
        logits: [R, V] (any float dtype, any device).
        bitmask: [len(rows), W] int32 with W * 32 >= V; bit j of word w allows token 32 w + j.
        rows: [len(rows)] int64: the logits row of each bitmask row.
    """
    device = logits.device
    V = logits.shape[1]
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    # bytes of the little-endian int32 words: byte b of word w holds tokens 32 w + 8 b + (0..7)
    packed = np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8)
    bm = torch.from_numpy(packed).to(device, non_blocking=True)                  # [Rc, 4 W] uint8
    allowed = ((bm.unsqueeze(-1) >> bits) & 1).view(bm.shape[0], -1)[:, :V].bool()
    idx = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(device, non_blocking=True)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
