"""Linear layers whose weights are loaded shard by shard (merged QKV and gate/up projections)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] (HF layout).

    ``output_sizes`` splits the output rows into named shards loaded from separate checkpoint tensors
    (``shard_names``): a merged q/k/v or gate/up projection runs as one matmul.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device, shard_names: list[str] | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.shard_names = shard_names or []
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        for p in self.parameters():
            p.weight_loader = self._load  # type: ignore[attr-defined]

    def shard_range(self, shard: str | None) -> tuple[int, int]:
        if shard is None:
            return 0, self.out_features
        i = self.shard_names.index(shard)
        start = sum(self.output_sizes[:i])
        return start, start + self.output_sizes[i]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        start, end = self.shard_range(shard)
        target = param.data[start:end]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs parameter shard "
                             f"{tuple(target.shape)} (shard {shard!r})")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
