"""The KV cache's CPU tier on the runner's side: its host tensor, and the per-step block copies between the tiers.

The KV cache manager owns the block ids of both tiers and sends each step's copies as plain (src, dst) pairs
(``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``); ``KVSwapper.execute`` runs them before the
step's forward: swap-outs first, then swap-ins (a GPU block freed by a swap-out may be refilled by a swap-in of
the same step). On CUDA the copies run on a side stream from pinned memory: the side stream waits for the work
queued before (earlier steps wrote the blocks it reads), and the step's forward waits for the copies (it may write
blocks a swap-out reads, and reads blocks a swap-in writes); the host does not wait. A run of consecutive ids is
one copy per cache whatever the layer count: the device cache is one buffer [L, 2, N, block_size, H_kv, D]
(worker/kv_cache.py) and the CPU tier is block-major, [N_cpu, L, 2, block_size, H_kv, D], so a run's CPU side is
one contiguous range holding every layer's K and V. ``num_copies`` counts those copies.

Write-through copies (``blocks_to_write_through``: shared prefix blocks copied ahead of their eviction) run on the
same side stream after the step's swaps, and the forward does not wait for them: it may read those blocks (full
prefix blocks that requests share) but never writes them. A later step that gives one of them new content names the step that wrote it through
(``write_through_fence``); its forward waits for the event recorded after that step's write-through copies
(``WriteThroughEvents``; the side stream runs in order, so that event covers every earlier step's copies too).

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
from hayabusa.sample.metadata import to_device
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


class WriteThroughEvents:
    """The events recorded after each step's write-through copies that may still run (plain Python: an event is
    anything with ``query()``, True once done; a ``torch.cuda.Event`` on CUDA, a fake in CPU tests).

    Steps are recorded in increasing id order; events of one stream complete in that order too."""

    def __init__(self) -> None:
        self._events: list[tuple[int, object]] = []   # (step id, event), oldest first

    def __len__(self) -> int:
        return len(self._events)

    def record(self, step_id: int, event) -> None:
        """Step ``step_id``'s write-through copies end at ``event``; events already done are dropped."""
        while self._events and self._events[0][1].query():
            self._events.pop(0)
        self._events.append((step_id, event))

    def fence(self, step_id: int):
        """The event to wait for before a forward that gives new content to blocks written through by steps up
        to ``step_id`` (the latest such step's event, which covers the earlier ones), or None when none of them
        may still run. Forgets the events covered: the caller's stream waits for them from now on."""
        i = 0
        while i < len(self._events) and self._events[i][0] <= step_id:
            i += 1
        if not i:
            return None
        event = self._events[i - 1][1]
        del self._events[:i]
        return event


class KVSwapper:
    """The CPU tier's tensors and the copies between them and the device KV caches.

    Args:
        buffers: every device KV cache that the scheduler's block ids index, each one whole buffer
            [L, 2, num_blocks, block_size, H_kv, D] (worker/kv_cache.py ``allocate_kv_buffer``; L: this pipeline
            stage's layers, H_kv: this rank's KV heads): the target model's and, with a draft model (or an EAGLE
            head), the draft's. Each gets a CPU tensor of the same dtype, block-major.
        num_blocks: CPU blocks (the same CPU block ids in every cache).
        gather: how a step with several runs moves them (None, the default: True on CUDA, False on CPU). False:
            one strided copy per run (on CUDA torch makes the strided device side contiguous in one kernel per
            run, then one memcpy). True: one ``index_select`` gathers all the step's swap-out blocks into a
            contiguous block-major device temporary, then one copy per run to the CPU; swap-ins are one copy per
            run into a temporary, then one ``index_copy_`` scatters it. Measured with benchmarks/kv_swap_bench.py
            (BENCHMARKS.md, ninth session): on an H200, 64 runs of one block (the common case: evicted prefix
            blocks rarely have consecutive ids) take 591 us a step gathered against 1,214 us strided (0.5b shape;
            the per-layer copies before took 31,219 us); on the CPU the gather path was 2-5x slower. Either way a
            run is one copy to or from the CPU per cache, whatever the layer count.

    Attributes:
        cpu_caches: per cache [num_blocks, L, 2, block_size, H_kv, D] (block-major: a run of CPU blocks is one
            contiguous range); pinned on CUDA (asynchronous copies); a plain tensor on CPU, whose pages the OS
            commits on first write.
        num_copies: copies between the tiers issued so far (one per run per cache).
        num_runs: runs of consecutive block ids copied so far (``block_runs`` of each step's two lists).
    """

    def __init__(self, buffers: list[torch.Tensor], num_blocks: int, gather: bool | None = None) -> None:
        assert buffers and all(b.dim() == 6 and b.shape[1] == 2 for b in buffers), "[L, 2, N, block_size, H, D]"
        self.buffers = buffers
        self.device = buffers[0].device
        self.num_blocks = num_blocks
        self.cuda = self.device.type == "cuda"
        self.gather = self.cuda if gather is None else gather
        self.cpu_caches = [torch.empty((num_blocks, b.shape[0], 2, *b.shape[3:]), dtype=b.dtype,
                                       pin_memory=self.cuda) for b in buffers]
        # the copies move bytes: integer views of the same element size (index_select / index_copy_ of fp8 are
        # not implemented on every build; a byte copy is exact whatever the dtype)
        self._blocks = [_raw(b).permute(2, 0, 1, 3, 4, 5) for b in buffers]   # [N, L, 2, block_size, H, D] views
        self._cpu = [_raw(c) for c in self.cpu_caches]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.write_through_events = WriteThroughEvents()
        self.num_copies = 0
        self.num_runs = 0
        nbytes = sum(c.numel() * c.element_size() for c in self.cpu_caches)
        logger.info("KV cache CPU tier: %d blocks, %.2f GiB%s", num_blocks, nbytes / 2**30,
                    " pinned" if self.cuda else "")

    def execute(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                write_through: list[tuple[int, int]] = (), step_id: int = 0, fence: int = 0) -> None:
        """Run a step's copies in every cache: swap_out (device block, CPU block) pairs, then swap_in (CPU block,
        device block) pairs, then write_through (device block, CPU block) pairs. On CUDA the current stream (the
        step's forward) waits for the swaps but not for the write-through copies, and first for the
        write-through copies of steps up to ``fence`` (0: none); the host waits for nothing. ``step_id``: this
        step's id (a later step's fence names it)."""
        if not self.cuda:   # synchronous: nothing stays in flight
            self._copy(swap_out, swap_in)
            if write_through:
                self._copy(write_through, [])
            return
        compute = torch.cuda.current_stream(self.device)
        if fence:
            event = self.write_through_events.fence(fence)
            if event is not None:               # this step writes blocks those copies read
                compute.wait_event(event)
        if not swap_out and not swap_in and not write_through:
            return
        self.stream.wait_stream(compute)        # the blocks read here were written by steps queued before
        with torch.cuda.stream(self.stream):
            if swap_out or swap_in:
                self._copy(swap_out, swap_in)
                swapped = torch.cuda.Event()
                swapped.record()
            if write_through:
                self._copy(write_through, [])
                done = torch.cuda.Event()
                done.record()
                self.write_through_events.record(step_id, done)
        if swap_out or swap_in:
            compute.wait_event(swapped)         # the forward writes / reads these blocks after the copies

    def _copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        out_runs, in_runs = block_runs(swap_out), block_runs(swap_in)
        out_idx = self._index([s for s, _ in swap_out]) if self.gather and len(out_runs) > 1 else None
        in_idx = self._index([d for _, d in swap_in]) if self.gather and len(in_runs) > 1 else None
        for blocks, cpu in zip(self._blocks, self._cpu):
            if out_runs:
                self._swap_out(blocks, cpu, out_runs, out_idx)
            if in_runs:   # after this cache's swap-outs: a swap-in may refill a block that one of them read
                self._swap_in(blocks, cpu, in_runs, in_idx)
        self.num_runs += len(out_runs) + len(in_runs)

    def _swap_out(self, blocks: torch.Tensor, cpu: torch.Tensor, runs: list[tuple[int, int, int]],
                  idx: torch.Tensor | None) -> None:
        """Device blocks -> CPU blocks. ``blocks`` [N, L, 2, ...] is a strided view of the device buffer; the CPU
        side of a run is contiguous. On CUDA a copy whose device side is strided is made contiguous in a device
        temporary by one kernel, then one ``cudaMemcpyAsync``; with non_blocking=True it stays asynchronous
        (pytorch aten/src/ATen/native/cuda/Copy.cu, ``copy_kernel_cuda``: ``copy_requires_temporaries`` is true
        for a non-contiguous CPU<->GPU copy, and with non_blocking the conversion device is CUDA, so the
        temporary is ``src.contiguous()`` on the current stream and the memcpy is ``cudaMemcpyAsync`` plus a
        host-allocator event on the pinned side; no stream or device synchronization)."""
        nb = self.cuda
        if idx is None:
            for src, dst, n in runs:
                cpu[dst:dst + n].copy_(blocks[src:src + n], non_blocking=nb)
        else:
            staged = blocks.index_select(0, idx)   # [m, L, 2, ...] contiguous, the runs one after another
            off = 0
            for _, dst, n in runs:
                cpu[dst:dst + n].copy_(staged[off:off + n], non_blocking=nb)
                off += n
        self.num_copies += len(runs)

    def _swap_in(self, blocks: torch.Tensor, cpu: torch.Tensor, runs: list[tuple[int, int, int]],
                 idx: torch.Tensor | None) -> None:
        """CPU blocks -> device blocks (the reverse of ``_swap_out``: on CUDA a strided device destination gets an
        asynchronous memcpy into a contiguous temporary, then one device copy kernel)."""
        nb = self.cuda
        if idx is None:
            for src, dst, n in runs:
                blocks[dst:dst + n].copy_(cpu[src:src + n], non_blocking=nb)
        else:
            staged = torch.empty((int(idx.numel()), *blocks.shape[1:]), dtype=blocks.dtype, device=self.device)
            off = 0
            for src, _, n in runs:
                staged[off:off + n].copy_(cpu[src:src + n], non_blocking=nb)
                off += n
            blocks.index_copy_(0, idx, staged)
        self.num_copies += len(runs)

    def _index(self, ids: list[int]) -> torch.Tensor:
        """[m] int64 block ids on the device, copied without blocking (``sample/metadata.to_device``: a pageable
        source would make the host wait for the side stream, which waits for the forward)."""
        return to_device(ids, torch.int64, self.device)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the unsigned / signed integer dtype of its element size (the bytes unchanged)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
