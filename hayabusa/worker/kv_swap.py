"""The KV cache's CPU tier on the runner's side: its host tensor, and the per-step block copies between the tiers.

The KV cache manager owns the block ids of both tiers and sends each step's copies as plain (src, dst) pairs
(``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``); ``KVSwapper.execute`` runs them before the
step's forward: swap-outs first, then swap-ins (a GPU block freed by a swap-out may be refilled by a swap-in of
the same step). On CUDA the copies run on a side stream from pinned memory: the side stream waits for the work
queued before (earlier steps wrote the blocks it reads), and the step's forward waits for the copies (it may write
blocks a swap-out reads, and reads blocks a swap-in writes). Runs of consecutive ids become one copy each.
"""

from __future__ import annotations

import logging

import torch

from hayabusa.config import EngineConfig
from hayabusa.worker.kv_cache import bytes_per_block, kv_cache_dtype

logger = logging.getLogger(__name__)


def num_cpu_blocks(cfg: EngineConfig) -> int:
    """Blocks of the CPU tier: ``swap_space`` bytes / bytes per block (0 = no tier)."""
    return cfg.cache_config.swap_space_bytes // bytes_per_block(cfg)


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, n): the pairs as runs where both ids go up by one (each run is one slice copy)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


class KVSwapper:
    """The CPU tier's tensor and the copies between it and the device KV cache.

    Args:
        cfg: the engine config (cache dtype, block size, heads).
        kv_caches: the device cache, per layer (k_cache, v_cache), each [num_blocks, block_size, H_kv, D].
        num_blocks: CPU blocks.
    """

    def __init__(self, cfg: EngineConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 num_blocks: int) -> None:
        mc = cfg.model_config
        self.kv_caches = kv_caches
        self.device = cfg.device_config.device
        self.num_blocks = num_blocks
        self.cuda = self.device.type == "cuda"
        shape = (mc.num_layers, 2, num_blocks, cfg.cache_config.block_size, mc.num_kv_heads, mc.head_dim)
        # pinned on CUDA (asynchronous copies); a plain tensor on CPU, whose pages the OS commits on first write
        self.cpu_cache = torch.empty(shape, dtype=kv_cache_dtype(cfg), pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.num_copies = 0
        logger.info("KV cache CPU tier: %d blocks, %.2f GiB%s", num_blocks,
                    self.cpu_cache.numel() * self.cpu_cache.element_size() / 2**30, " pinned" if self.cuda else "")

    def execute(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Run a step's copies: swap_out (device block, CPU block) pairs, then swap_in (CPU block, device block)
        pairs. On CUDA the current stream (the step's forward) waits for them; the host does not."""
        if not swap_out and not swap_in:
            return
        if not self.cuda:
            self._copy(swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)        # the blocks read here were written by steps queued before
        with torch.cuda.stream(self.stream):
            self._copy(swap_out, swap_in)
        compute.wait_stream(self.stream)        # the forward writes / reads these blocks after the copies

    def _copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        nb = self.cuda
        for src, dst, n in block_runs(swap_out):
            for layer, (k, v) in enumerate(self.kv_caches):
                self.cpu_cache[layer, 0, dst:dst + n].copy_(k[src:src + n], non_blocking=nb)
                self.cpu_cache[layer, 1, dst:dst + n].copy_(v[src:src + n], non_blocking=nb)
            self.num_copies += 1
        for src, dst, n in block_runs(swap_in):
            for layer, (k, v) in enumerate(self.kv_caches):
                k[dst:dst + n].copy_(self.cpu_cache[layer, 0, src:src + n], non_blocking=nb)
                v[dst:dst + n].copy_(self.cpu_cache[layer, 1, src:src + n], non_blocking=nb)
            self.num_copies += 1
