"""The KV cache's CPU tier on the runner's side: its host tensor, and the per-step block copies between the tiers.

The KV cache manager owns the block ids of both tiers and sends each step's copies as plain (src, dst) pairs
(``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``); ``KVSwapper.execute`` runs them before the
step's forward: swap-outs first, then swap-ins (a GPU block freed by a swap-out may be refilled by a swap-in of
the same step). On CUDA the copies run on a side stream from pinned memory: the side stream waits for the work
queued before (earlier steps wrote the blocks it reads), and the step's forward waits for the copies (it may write
blocks a swap-out reads, and reads blocks a swap-in writes). Runs of consecutive ids become one copy each.

A block id names a block of every KV cache the runner holds: the target model's and, with a draft model
(speculative decoding), the draft's, which is indexed by the same block ids; the swapper copies a block of each,
so a restored block holds both models' KV. A tensor-parallel rank holds the KV heads of its own shard and keeps
its own CPU tier of them; the copy lists are in the SchedulerOutput that every rank receives, and every rank runs
them on its shard.
"""

from __future__ import annotations

import logging

import torch

from hayabusa.config import EngineConfig
from hayabusa.worker.kv_cache import bytes_per_block

logger = logging.getLogger(__name__)


def num_cpu_blocks(cfg: EngineConfig) -> int:
    """Blocks of the CPU tier: ``swap_space`` bytes / bytes per block (0 = no tier). A block's bytes are the
    target's and the draft model's K + V (``bytes_per_block``), of this rank's KV heads (``cfg`` is the rank's
    config under tensor parallelism: ``swap_space`` is per rank, as in vLLM)."""
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


KVCache = list[tuple[torch.Tensor, torch.Tensor]]   # per layer (k_cache, v_cache), [num_blocks, block_size, H_kv, D]


class KVSwapper:
    """The CPU tier's tensors and the copies between them and the device KV caches.

    Args:
        kv_caches: every device KV cache that the scheduler's block ids index: the target model's and, with a
            draft model, the draft's; each per layer (k_cache, v_cache), [num_blocks, block_size, H_kv, D]
            (H_kv: this rank's KV heads). Each gets a CPU tensor of the same block layout and dtype.
        num_blocks: CPU blocks (the same CPU block ids in every cache).
    """

    def __init__(self, kv_caches: list[KVCache], num_blocks: int) -> None:
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0][0].device
        self.num_blocks = num_blocks
        self.cuda = self.device.type == "cuda"
        # per cache: [L, 2, num_blocks, block_size, H_kv, D]; pinned on CUDA (asynchronous copies); a plain tensor
        # on CPU, whose pages the OS commits on first write
        self.cpu_caches = [torch.empty((len(cache), 2, num_blocks, *cache[0][0].shape[1:]), dtype=cache[0][0].dtype,
                                       pin_memory=self.cuda) for cache in kv_caches]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.num_copies = 0
        nbytes = sum(c.numel() * c.element_size() for c in self.cpu_caches)
        logger.info("KV cache CPU tier: %d blocks, %.2f GiB%s", num_blocks, nbytes / 2**30,
                    " pinned" if self.cuda else "")

    def execute(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Run a step's copies: swap_out (device block, CPU block) pairs, then swap_in (CPU block, device block)
        pairs, in every cache. On CUDA the current stream (the step's forward) waits for them; the host does not."""
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
            for cpu, cache in zip(self.cpu_caches, self.kv_caches):
                for layer, (k, v) in enumerate(cache):
                    cpu[layer, 0, dst:dst + n].copy_(k[src:src + n], non_blocking=nb)
                    cpu[layer, 1, dst:dst + n].copy_(v[src:src + n], non_blocking=nb)
            self.num_copies += 1
        for src, dst, n in block_runs(swap_in):
            for cpu, cache in zip(self.cpu_caches, self.kv_caches):
                for layer, (k, v) in enumerate(cache):
                    k[dst:dst + n].copy_(cpu[layer, 0, src:src + n], non_blocking=nb)
                    v[dst:dst + n].copy_(cpu[layer, 1, src:src + n], non_blocking=nb)
            self.num_copies += 1
