"""KVSwapper: a step's block copies between the device KV caches (a target's and a draft model's on the same block
ids) and the CPU tier, exact contents."""

from __future__ import annotations

import pytest
import torch

from hayabusa.worker.kv_swap import KVSwapper, block_runs


def test_block_runs_merge_consecutive_pairs_only():
    assert block_runs([(0, 4), (1, 5), (2, 6), (7, 1), (8, 3), (9, 4)]) == [(0, 4, 3), (7, 1, 1), (8, 3, 2)]
    assert block_runs([]) == []


def _cache(L: int, N: int, H: int, D: int, device: str, start: int = 0):
    """A device KV cache [L, 2, N, 4, H, D] of distinct values, and its per-layer (k, v) views."""
    base = torch.arange(start, start + L * 2 * N * 4 * H * D, dtype=torch.float32, device=device)
    base = base.view(L, 2, N, 4, H, D)
    gpu = base.clone()
    return base, gpu, [(gpu[i, 0], gpu[i, 1]) for i in range(L)]


def _run_swaps(device: str) -> None:
    # the target's cache (2 layers, 2 KV heads) and a draft model's (1 layer, 1 KV head, D 4) on the same block ids
    N = 6
    base, gpu, target = _cache(2, N, 2, 8, device)
    dbase, dgpu, draft = _cache(1, N, 1, 4, device, start=10**6)
    swapper = KVSwapper([target, draft], num_blocks=5)
    assert [tuple(c.shape) for c in swapper.cpu_caches] == [(2, 2, 5, 4, 2, 8), (1, 2, 5, 4, 1, 4)]
    # step 1: device blocks 1, 2 and 5 out to CPU blocks 3, 4 and 0
    swapper.execute([(1, 3), (2, 4), (5, 0)], [])
    # step 2: block 1 is refilled from CPU 0 (what was block 5) after block 1 went out to CPU 2 in the same step
    swapper.execute([(1, 2)], [(0, 1), (3, 0), (4, 3)])
    if device == "cuda":
        torch.cuda.synchronize()
    for cpu, b, g in zip(swapper.cpu_caches, (base, dbase), (gpu, dgpu)):
        for layer in range(b.shape[0]):
            for kv in range(2):
                assert torch.equal(cpu[layer, kv, 3], b[layer, kv, 1].cpu())
                assert torch.equal(cpu[layer, kv, 4], b[layer, kv, 2].cpu())
                assert torch.equal(cpu[layer, kv, 2], b[layer, kv, 1].cpu())
                assert torch.equal(g[layer, kv, 1], b[layer, kv, 5])      # swap-outs ran first
                assert torch.equal(g[layer, kv, 0], b[layer, kv, 1])
                assert torch.equal(g[layer, kv, 3], b[layer, kv, 2])
                assert torch.equal(g[layer, kv, 4], b[layer, kv, 4])      # untouched
    assert swapper.num_copies == 6   # step 1: (1,3)+(2,4) merged, (5,0); step 2: (1,2); (0,1), (3,0), (4,3)


def test_swaps_on_cpu():
    _run_swaps("cpu")


@pytest.mark.cuda
def test_swaps_on_cuda_side_stream():
    _run_swaps("cuda")
    assert torch.empty(1).pin_memory().is_pinned()
