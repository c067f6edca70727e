"""Linear layers whose weights are loaded shard by shard (merged QKV and gate/up projections), through a
quantization method (``hayabusa/quantization/base.py``): unquantized unless ``build_model`` says otherwise."""

from __future__ import annotations

import torch
from torch import nn

from hayabusa.quantization.base import LinearMethod, UnquantizedLinearMethod, current_quantization_config


class Linear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] (HF layout).

    ``output_sizes`` splits the output rows into named shards loaded from separate checkpoint tensors
    (``shard_names``): a merged q/k/v or gate/up projection runs as one matmul.

    Built outside ``set_quantization_config`` (tests, or a model without quantization) the layer creates its
    unquantized ``weight`` [N, K] at once, as a plain linear layer. Inside it, the weights wait for
    ``create_weights(method)``, which ``build_model`` calls once it knows the layer's name.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device, shard_names: list[str] | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.shard_names = shard_names or []
        self.params_dtype = dtype
        self.params_device = device
        self.quant_method: LinearMethod | None = None
        if current_quantization_config() is None:
            self.create_weights(UnquantizedLinearMethod())
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        if self.bias is not None:
            self.bias.output_dim = 0  # type: ignore[attr-defined]
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def create_weights(self, method: LinearMethod) -> None:
        """Register ``method``'s parameters on this layer and run through it from now on."""
        method.create_weights(self, self.in_features, self.output_sizes, self.params_dtype, self.params_device)
        self.quant_method = method

    def shard_range(self, shard: str | None) -> tuple[int, int]:
        """Output features [start, end) of ``shard`` (None = all)."""
        if shard is None:
            return 0, self.out_features
        i = self.shard_names.index(shard)
        start = sum(self.output_sizes[:i])
        return start, start + self.output_sizes[i]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy one checkpoint tensor into its slice of ``param`` (see the parameter attributes in
        ``hayabusa/quantization/base.py``). Subclasses override ``_load``."""
        self._load(param, loaded, shard)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        if getattr(param, "shard_indexed", False):          # [num_shards], one scalar per shard
            if loaded.numel() != 1:
                raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs one scalar per shard "
                                 f"(shard {shard!r})")
            param.data[self.shard_names.index(shard) if shard is not None else 0] = loaded.reshape(())
            return
        dim = getattr(param, "output_dim", 0)
        if dim is None:                                     # the same tensor for every shard
            target = param.data
        else:
            start, end = self.shard_range(shard)
            f = getattr(param, "packed_factor", 1)
            if start % f or end % f:
                raise ValueError(f"shard {shard!r} (outputs {start}..{end}) does not fall on the packing of "
                                 f"{f} outputs per element")
            target = param.data.narrow(dim, start // f, (end - start) // f)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs parameter shard "
                             f"{tuple(target.shape)} (shard {shard!r})")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.quant_method is not None, "Linear built under a quantization config was never given weights"
        return self.quant_method.apply(self, x)
