"""Process groups and the collectives the model layers and the runner call.

Rank layout as vLLM's: tensor-parallel ranks inner, pipeline stages outer (global rank = pp_rank x tp + tp_rank).
Each stage's tp ranks form one tensor-parallel group (the all-reduces stay inside it); stage s's tp rank r sends
its hidden states and residual to the same tp rank of stage s + 1 (torch.distributed send / recv). Outside a
worker (one process, no torch.distributed) every collective is the identity, so layers call them unconditionally.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP = None
_PP_RANK = 0
_PP_SIZE = 1


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     timeout_s: float = 600.0, tensor_parallel_size: int | None = None) -> None:
    """Join the engine's process group (called once per worker process) and set up the tensor-parallel groups.

    Args:
        rank: this worker's global rank (the last stage's tp rank 0 returns tokens).
        world_size: tensor_parallel_size x pipeline_parallel_size.
        init_method: ``tcp://host:port`` of the rendezvous.
        backend: "nccl" (CUDA) or "gloo" (CPU).
        timeout_s: how long a collective may wait for a peer before it fails.
        tensor_parallel_size: ranks per stage (None: the whole world, one stage).
    """
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    tp = world_size if tensor_parallel_size is None else tensor_parallel_size
    assert world_size % tp == 0, (world_size, tp)
    pp = world_size // tp
    group = dist.group.WORLD
    if pp > 1:
        for stage in range(pp):   # every rank creates every group, in the same order (torch.distributed's rule)
            g = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if rank // tp == stage:
                group = g
    _TP_RANK, _TP_SIZE, _TP_GROUP = rank % tp, tp, group
    _PP_RANK, _PP_SIZE = rank // tp, pp


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP, _PP_RANK, _PP_SIZE = 0, 1, None, 0, 1


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def pp_rank() -> int:
    """This rank's pipeline stage (0 holds the embedding, pp_size() - 1 the final norm, lm_head and sampler)."""
    return _PP_RANK


def pp_size() -> int:
    return _PP_SIZE


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


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send ``tensors`` (contiguous, shapes the receiver knows) to the same tp rank of the next stage, in order."""
    dst = (_PP_RANK + 1) * _TP_SIZE + _TP_RANK
    for t in tensors:
        dist.send(t.contiguous(), dst)


def pp_recv(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fill ``tensors`` (allocated with the sender's shapes and dtypes) from the same tp rank of the previous
    stage, in order; returns them."""
    src = (_PP_RANK - 1) * _TP_SIZE + _TP_RANK
    for t in tensors:
        dist.recv(t, src)
    return tensors


def broadcast_from_last_stage(x: torch.Tensor, async_op: bool = False):
    """Every rank gets the last stage's tp rank 0's ``x`` (in place; same shape and dtype everywhere): the
    step's sampled token ids, which the earlier stages need as later steps' inputs. Returns ``x``, or with
    ``async_op`` the Work to ``wait()`` on before reading it (an earlier stage goes on to its next step meanwhile)."""
    if _PP_SIZE == 1:
        return None if async_op else x
    work = dist.broadcast(x, (_PP_SIZE - 1) * _TP_SIZE, async_op=async_op)
    return work if async_op else x
