"""KVSwapper: a step's block copies between the device KV cache and the CPU tier, exact contents."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hayabusa.worker.kv_swap import KVSwapper, block_runs


def test_block_runs_merge_consecutive_pairs_only():
    assert block_runs([(0, 4), (1, 5), (2, 6), (7, 1), (8, 3), (9, 4)]) == [(0, 4, 3), (7, 1, 1), (8, 3, 2)]
    assert block_runs([]) == []


def _cfg(device: str, num_layers=2, block_size=4, H=2, D=8):
    mc = SimpleNamespace(num_layers=num_layers, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    cc = SimpleNamespace(block_size=block_size, kv_dtype=None)
    return SimpleNamespace(model_config=mc, cache_config=cc, device_config=SimpleNamespace(device=torch.device(device)))


def _run_swaps(device: str) -> None:
    cfg = _cfg(device)
    L, N = 2, 6
    base = torch.arange(L * 2 * N * 4 * 2 * 8, dtype=torch.float32, device=device).view(L, 2, N, 4, 2, 8)
    gpu = base.clone()
    kv_caches = [(gpu[i, 0], gpu[i, 1]) for i in range(L)]
    swapper = KVSwapper(cfg, kv_caches, num_blocks=5)
    # step 1: device blocks 1, 2 and 5 out to CPU blocks 3, 4 and 0
    swapper.execute([(1, 3), (2, 4), (5, 0)], [])
    # step 2: block 1 is refilled from CPU 0 (what was block 5) after block 1 went out to CPU 2 in the same step
    swapper.execute([(1, 2)], [(0, 1), (3, 0), (4, 3)])
    if device == "cuda":
        torch.cuda.synchronize()
    cpu = swapper.cpu_cache
    for layer in range(L):
        for kv in range(2):
            assert torch.equal(cpu[layer, kv, 3], base[layer, kv, 1].cpu())
            assert torch.equal(cpu[layer, kv, 4], base[layer, kv, 2].cpu())
            assert torch.equal(cpu[layer, kv, 2], base[layer, kv, 1].cpu())
            assert torch.equal(gpu[layer, kv, 1], base[layer, kv, 5])      # swap-outs ran first
            assert torch.equal(gpu[layer, kv, 0], base[layer, kv, 1])
            assert torch.equal(gpu[layer, kv, 3], base[layer, kv, 2])
            assert torch.equal(gpu[layer, kv, 4], base[layer, kv, 4])      # untouched
    assert swapper.num_copies == 6   # step 1: (1,3)+(2,4) merged, (5,0); step 2: (1,2); (0,1), (3,0), (4,3)


def test_swaps_on_cpu():
    _run_swaps("cpu")


@pytest.mark.cuda
def test_swaps_on_cuda_side_stream():
    _run_swaps("cuda")
    assert torch.empty(1).pin_memory().is_pinned()
