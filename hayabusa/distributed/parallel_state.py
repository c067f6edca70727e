"""Process groups and the collectives the model layers call.

One tensor-parallel group per engine today (the world: pipeline_parallel_size is 1). Outside a worker (one
process, no torch.distributed) every collective is the identity, so layers call them unconditionally.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP = None


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     timeout_s: float = 600.0) -> None:
    """Join the engine's process group (called once per worker process) and set up the tensor-parallel group.

    Args:
        rank: this worker's rank (0 is the one that returns tokens).
        world_size: tensor_parallel_size x pipeline_parallel_size.
        init_method: ``tcp://host:port`` of the rendezvous.
        backend: "nccl" (CUDA) or "gloo" (CPU).
        timeout_s: how long a collective may wait for a peer before it fails.
    """
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _TP_RANK, _TP_SIZE, _TP_GROUP = rank, world_size, dist.group.WORLD


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks, in place; returns it."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """[..., N] on each rank -> [..., N x tp_size], rank r's block at columns [r N, (r + 1) N) on every rank
    (the same bits everywhere, so every rank samples the same tokens)."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    out = torch.empty((_TP_SIZE,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=_TP_GROUP) if x.is_cuda else \
        dist.all_gather(list(out.unbind(0)), x, group=_TP_GROUP)
    return out.movedim(0, -2).reshape(*x.shape[:-1], _TP_SIZE * x.shape[-1])
