"""The structured-output token bitmask applied to logits on their device (torch only; no xgrammar here)."""

from __future__ import annotations

import numpy as np
import torch

_BITS = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray | torch.Tensor,
                        rows: np.ndarray | torch.Tensor) -> None:
    """Set to -inf, in place, the logits of the tokens each bitmask row forbids.

    Args:
        logits: [R, V] (any float dtype, any device).
        bitmask: [len(rows), W] int32 with W * 32 >= V; bit j of word w allows token 32 w + j. A numpy array, or a
            host tensor (pinned: its copy to the device does not wait for the device's queued work).
        rows: [len(rows)] int64: the logits row of each bitmask row (numpy, or a host tensor like ``bitmask``).
    """
    device = logits.device
    V = logits.shape[1]
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    if isinstance(bitmask, np.ndarray):
        bitmask = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))
    if isinstance(rows, np.ndarray):
        rows = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    # bytes of the little-endian int32 words: byte b of word w holds tokens 32 w + 8 b + (0..7)
    bm = bitmask.view(torch.uint8).to(device, non_blocking=True)                  # [Rc, 4 W] uint8
    allowed = ((bm.unsqueeze(-1) >> bits) & 1).view(bm.shape[0], -1)[:, :V].bool()
    idx = rows.to(device, non_blocking=True)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
