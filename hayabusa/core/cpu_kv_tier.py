"""The CPU tier of the KV cache (``swap_space``): CPU block ids, owned by the KVCacheManager (plain Python).

A CPU block is either held by a preempted request whose KV was swapped out (swap-based preemption), or free. A
free block may still hold a prefix-cache block that was evicted from the GPU (its hash, parent hash and tokens are
kept, like the GPU pool's): free blocks wait in an LRU queue, and a new use takes a never-used id first, then the
least recently freed block (evicting its cached content).

Copies between the tiers are plain ``(src, dst)`` id pairs collected per step (``SwapLists``); the runner runs
every step's swap-outs, then its swap-ins, before the step's forward, which waits for them. Two rules keep that
order safe:
- a CPU block read by a swap-in in a step is locked (``lock``) until the step's lists are taken, so no swap-out of
  the same step can overwrite it first;
- a GPU block freed by a swap-out may be the destination of a swap-in in the same step: swap-outs run first.

Write-through (the prefix cache's tier): a cached GPU block is copied to the CPU tier once a prefix hit reuses it
(its first hit, ``KVBlock.hits``), while requests still share it, not when it is evicted, so its eviction costs
no copy (SGLang's hierarchical cache "write_through_selective": a node is backed up to host memory once its hit
count reaches a threshold, here 1). A block queued in step s goes in the ``write_through`` list of step s + 1 or
later (at most ``WRITE_THROUGH_BLOCKS_PER_STEP`` a step; the rest wait), never of step s itself: a block hit in
step s may be one that step s's forward is computing, and step s + 1's copies run after step s's forward (the
side stream waits for the work queued before). The step's forward does not wait for those copies: it does not
write those blocks (full and cached: never written again) and only reads them. A block must not get new content
while its copy is in flight: when a later step takes a block written through in step s, that step's ``fence`` is
s, and the runner makes its forward wait for step s's write-through copies (worker/kv_swap.py
``WriteThroughEvents``). Evicted hit blocks that were not written through yet (queued in the same step, or past
the budget) are copied at eviction as before, in the swap-out list the forward waits for.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# Swap-based preemption pays a copy of a request's KV over PCIe twice; recompute pays a prefill of its tokens. A
# prefill of a few hundred tokens is cheap and batched with other work, so "auto" swaps only from this many
# computed tokens on (long contexts), and recomputes shorter ones.
SWAP_MIN_TOKENS = 512

PREEMPTION_MODES = ("swap", "recompute")

# Write-through copies per step: a burst of newly shared prefix blocks (a group of requests admitted on a new
# system prompt shares all of it, 64 blocks for W10's 1,024 tokens) spreads over steps instead of one step copying
# thousands of blocks at once. 128 blocks of the 7b shape (0.9 MiB each) are ~115 MiB, a few ms over PCIe beside a
# forward, off its path.
WRITE_THROUGH_BLOCKS_PER_STEP = 128


def prefer_swap(preemption_mode: str | None, num_recompute_tokens: int) -> bool:
    """Whether a preempted request should be swapped out rather than recomputed, under ``preemption_mode``
    ("swap", "recompute" or None = auto: swap when a recompute would compute ``num_recompute_tokens`` >=
    SWAP_MIN_TOKENS: its computed tokens after the prefix it shares with running requests, which a recompute
    finds in the prefix cache). A swap copies all of its blocks, shared ones too, and brings them back into
    blocks of its own: on W10 (1,024 shared + 128 own tokens) swapping requests whose context is mostly a
    shared prefix took 47 % more steps than recomputing them (benchmarks/w10_host.py)."""
    if preemption_mode is not None:
        return preemption_mode == "swap"
    return num_recompute_tokens >= SWAP_MIN_TOKENS


@dataclass
class SwapLists:
    """One step's copies between the tiers, as (src, dst) block id pairs.

    Attributes:
        swap_out: (GPU block, CPU block): GPU -> CPU, run first.
        swap_in: (CPU block, GPU block): CPU -> GPU, run after the swap-outs; before the step's forward.
        write_through: (GPU block, CPU block): GPU -> CPU copies of shared prefix blocks, which the step's forward
            does not wait for.
        fence: the latest step whose write-through copies must be done before this step's forward (it gives new
            content to a block they read); 0 = none.
    """

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    write_through: list[tuple[int, int]] = field(default_factory=list)
    fence: int = 0


class CpuKVTier:
    """CPU block ids 0..num_blocks-1 with reference counts, an LRU free queue and a prefix-cache index.

    State is kept sparse (dicts), so a tier of millions of blocks costs nothing until used.

    Args:
        num_blocks: blocks of the tier (``swap_space`` bytes / bytes per block).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._next_fresh = 0                          # ids >= this were never used (free, hold nothing)
        self._free: OrderedDict[int, None] = OrderedDict()   # used once, free now; front = least recently freed
        self.ref_cnt: dict[int, int] = {}
        self.meta: dict[int, tuple[int, int | None, tuple]] = {}   # block -> (hash, parent hash, tokens)
        self.cached: dict[int, int] = {}              # block hash -> CPU block
        self._locked: list[int] = []                  # released when the step's lists are taken
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests or locked for a swap-in (0 when the tier is idle)."""
        return self.num_blocks - self.num_free_blocks

    def take(self, n: int) -> list[int] | None:
        """n blocks (ref 1): never-used ids first, then the LRU free ones (their cached content is evicted).
        None when fewer than n are free."""
        if n > self.num_free_blocks:
            return None
        fresh = min(n, self.num_blocks - self._next_fresh)
        ids = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        for _ in range(n - fresh):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            ids.append(block)
        for block in ids:
            self.ref_cnt[block] = 1
        return ids

    def _forget(self, block: int) -> None:
        meta = self.meta.pop(block, None)
        if meta is not None:
            if self.cached.get(meta[0]) == block:
                del self.cached[meta[0]]
            self.num_evictions += 1

    def give_back(self, ids: list[int]) -> None:
        """Drop one reference each; a block at 0 joins the back of the free queue (its cached content stays)."""
        for block in ids:
            cnt = self.ref_cnt[block] - 1
            assert cnt >= 0, f"CPU block {block} freed twice"
            if cnt:
                self.ref_cnt[block] = cnt
            else:
                del self.ref_cnt[block]
                self._free[block] = None

    def lock(self, ids: list[int]) -> None:
        """Hold cached blocks read by this step's swap-ins until ``release_locks``."""
        for block in ids:
            cnt = self.ref_cnt.get(block, 0)
            if cnt == 0:
                del self._free[block]
            self.ref_cnt[block] = cnt + 1
        self._locked.extend(ids)

    def free_after_step(self, ids: list[int]) -> None:
        """Give held blocks back once this step's lists are taken (they are read by this step's swap-ins)."""
        self._locked.extend(ids)

    def release_locks(self) -> None:
        locked, self._locked = self._locked, []
        self.give_back(locked)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: int, parent_hash: int | None, tokens: tuple) -> int | None:
        """The CPU block caching exactly ``tokens`` after ``parent_hash``, or None."""
        block = self.cached.get(block_hash)
        if block is None or self.meta[block][1:] != (parent_hash, tokens):
            return None
        return block

    def store(self, block_hash: int, parent_hash: int | None, tokens: tuple) -> int | None:
        """A free block to receive an evicted GPU block of the prefix cache, indexed and left free (LRU: most
        recent); None when the content is here already (refreshed in the LRU) or no block is free."""
        block = self.cached.get(block_hash)
        if block is not None and self.meta[block][1:] == (parent_hash, tokens):
            if block in self._free:
                self._free.move_to_end(block)
            return None
        ids = self.take(1)
        if ids is None:
            return None
        block = ids[0]
        self.meta[block] = (block_hash, parent_hash, tokens)
        self.cached[block_hash] = block
        self.give_back(ids)
        return block

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (held blocks hold no cached content)."""
        self.meta.clear()
        self.cached.clear()


class CpuTierMixin:
    """The KVCacheManager's CPU-tier half: swap-based preemption, the prefix cache's CPU tier, and the step's copy
    lists. Expects the manager's ``block_pool``, ``req_to_blocks``, ``block_size``, ``_num_cached``,
    ``cache_full_blocks`` and ``allocate_slots``; ``init_cpu_tier`` is called from its __init__."""

    def init_cpu_tier(self, num_cpu_blocks: int) -> None:
        self.cpu: CpuKVTier | None = CpuKVTier(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.req_to_cpu_blocks: dict[str, list[int]] = {}   # swapped-out requests -> their CPU blocks, in order
        self._cpu_hits: dict[str, list[int]] = {}           # request id -> CPU prefix hits of its last lookup
        self._swaps = SwapLists()
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.num_cpu_hit_blocks = 0      # prefix-cache blocks restored from the CPU tier
        self.num_blocks_written_through = 0   # of the swapped-out blocks, copied when first hit (not when evicted)
        self._write_through: dict[int, int] = {}   # hit GPU block -> its hash then, oldest first: ready to copy
        self._write_through_next: dict[int, int] = {}   # the same, queued since the last step's lists
        self._wt_step: dict[int, int] = {}          # GPU block -> the step that wrote it through (until taken)
        if self.cpu is not None and self.enable_prefix_caching:
            self.block_pool.on_evict = self._evict_to_cpu
            self.block_pool.on_first_hit = self._queue_write_through

    # ------------------------------------------------------------------ step lists
    def take_swaps(self, step_id: int = 0) -> SwapLists:
        """The copies collected since the last call, and the write-through copies chosen now (for the
        SchedulerOutput of step ``step_id``); releases the CPU blocks that this step's swap-ins read."""
        if self._write_through:   # before the locks go: a CPU block read by a swap-in is not overwritten
            self._select_write_through(step_id)
        if self._write_through_next:   # queued during this step: copied from the next step on
            self._write_through.update(self._write_through_next)
            self._write_through_next.clear()
        swaps, self._swaps = self._swaps, SwapLists()
        self._cpu_hits.clear()
        if self.cpu is not None:
            self.cpu.release_locks()
        return swaps

    def drop_cpu_tier_state(self) -> list[str]:
        """After a failed step (its copies may not have run): free every swapped-out request's CPU blocks, drop
        the pending copies and the CPU prefix index. Returns the ids of the requests that were swapped out (they
        must be recomputed)."""
        swapped = list(self.req_to_cpu_blocks)
        for rid in swapped:
            self.free_cpu_blocks(rid)
        self._write_through.clear()   # (their GPU content stays; the blocks are copied at eviction if needed)
        self._write_through_next.clear()
        self.take_swaps()
        if self.cpu is not None:
            self.cpu.reset_prefix_cache()
        return swapped

    @property
    def has_pending_swaps(self) -> bool:
        """Copies (or a fence) that the next step must carry."""
        return bool(self._swaps.swap_out or self._swaps.swap_in or self._swaps.fence)

    @property
    def has_write_through_candidates(self) -> bool:
        """Prefix blocks waiting for their write-through copy (a step that runs takes some)."""
        return bool(self._write_through or self._write_through_next)

    def reset_cpu_prefix_cache(self) -> None:
        """The GPU prefix index was dropped (its blocks lose their hashes, so taking one calls no hook): the next
        step waits for every write-through copy before its forward, and the CPU index goes too."""
        if self._wt_step:
            self._swaps.fence = max(self._swaps.fence, max(self._wt_step.values()))
            self._wt_step.clear()
        self._write_through.clear()
        self._write_through_next.clear()
        if self.cpu is not None:
            self.cpu.reset_prefix_cache()

    # ------------------------------------------------------------------ prefix cache tier
    def _queue_write_through(self, block) -> None:
        """BlockPool hook: a prefix hit reuses a cached block for the first time; unless the CPU tier holds its
        content already, its copy goes in the write-through list of a step after this one."""
        if self.cpu.lookup(block.block_hash, block.parent_hash, block.tokens) is None:
            self._write_through_next[block.block_id] = block.block_hash

    def _select_write_through(self, step_id: int) -> None:
        """Up to WRITE_THROUGH_BLOCKS_PER_STEP of the queued blocks, oldest first, into this step's write-through
        list, each to a CPU block indexed now (the copy runs before any later step's swap-in could read it: the
        runner's side stream is in order). A block given new content since it was queued is skipped."""
        pending, blocks, out = self._write_through, self.block_pool.blocks, self._swaps.write_through
        while pending and len(out) < WRITE_THROUGH_BLOCKS_PER_STEP:
            block_id = next(iter(pending))
            block_hash = pending.pop(block_id)
            block = blocks[block_id]
            if block.block_hash != block_hash:
                continue
            cpu_block = self.cpu.store(block_hash, block.parent_hash, block.tokens)
            if cpu_block is not None:   # None: the content is there already, or every CPU block is held
                out.append((block_id, cpu_block))
                self._wt_step[block_id] = step_id
        self.num_blocks_swapped_out += len(out)
        self.num_blocks_written_through += len(out)

    def _evict_to_cpu(self, block) -> None:
        """BlockPool hook: a cached GPU block is about to get new content. If its write-through copy may still be
        in flight, the step waits for it (``fence``). Else keep a copy in the CPU tier if it was reused (a prefix
        hit since it was filled, ``KVBlock.hits``) and is not there yet (not written through: its first hit was
        in this step, or the write-through budget of the steps since ran out): a copy the forward waits for. A
        block nobody has shared (a request's own prompt tail and output) is dropped, not copied: on W10 copying
        every evicted block made the tier cost more than the recomputation it saved (BENCHMARKS.md, ninth
        session)."""
        step = self._wt_step.pop(block.block_id, None)
        if step is not None and step > self._swaps.fence:
            self._swaps.fence = step
        self._write_through.pop(block.block_id, None)
        self._write_through_next.pop(block.block_id, None)
        if block.hits < 1:
            return
        cpu_block = self.cpu.store(block.block_hash, block.parent_hash, block.tokens)
        if cpu_block is not None:
            self._swaps.swap_out.append((block.block_id, cpu_block))
            self.num_blocks_swapped_out += 1

    def _lookup_cpu(self, request, hashes: list[int], key, start: int, stop: int) -> int:
        """CPU-tier prefix hits for blocks start..stop-1 (after the GPU hits; ``key(i)``: block i's key),
        remembered for allocate_slots. Returns their number.

        Every hit is restored, however few blocks: there is no swap-in-vs-recompute threshold. A step's swap-in
        of n blocks costs ~60 us plus n x the block's bytes over PCIe (~46 GB/s; kv_swap_bench on an H200: 56 us
        for 1 block of the 0.5b shape), a recompute 2 x params x 16 n FLOPs inside a batched prefill: for the 7b
        shape one block's recompute (~0.24 TFLOP, ~0.4 ms) costs more than its copy already; only models under
        ~1B parameters might gain, by tens of microseconds a hit. Not worth a rule until a GPU run says so."""
        self._cpu_hits.pop(request.request_id, None)
        if self.cpu is None:
            return 0
        hits = []
        for i in range(start, stop):
            block = self.cpu.lookup(hashes[i], hashes[i - 1] if i else None, key(i))
            if block is None:
                break
            hits.append(block)
        if hits:
            self._cpu_hits[request.request_id] = hits
        return len(hits)

    def _restore_cpu_hits(self, cpu_hits: list[int], gpu_ids: list[int]) -> None:
        """Swap-ins of CPU prefix hits into the first len(cpu_hits) of the new GPU blocks."""
        self._swaps.swap_in.extend(zip(cpu_hits, gpu_ids))
        for g in gpu_ids[:len(cpu_hits)]:   # a restore is a hit: the block stays worth keeping on the CPU
            self.block_pool.blocks[g].hits = 1
        self.num_blocks_swapped_in += len(cpu_hits)
        self.num_cpu_hit_blocks += len(cpu_hits)

    # ------------------------------------------------------------------ swap-based preemption
    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.req_to_cpu_blocks

    def swap_out(self, request) -> bool:
        """Move a preempted request's KV to the CPU tier: its GPU blocks are freed, their copies queued for the
        step. False (nothing done) when the tier is off or has too few free blocks."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if self.cpu is None or not blocks or getattr(self, "req_to_cross_blocks", {}).get(rid):
            return False
        cpu_ids = self.cpu.take(len(blocks))
        if cpu_ids is None:
            return False
        self._swaps.swap_out.extend(zip(blocks, cpu_ids))
        self.num_blocks_swapped_out += len(blocks)
        self.req_to_cpu_blocks[rid] = cpu_ids
        del self.req_to_blocks[rid]
        self._num_cached.pop(rid, None)
        self.block_pool.give_back(blocks[::-1])
        return True

    def swap_in(self, request, num_new_tokens: int) -> list[int] | None:
        """Bring a swapped-out request's KV back into new GPU blocks and reserve room for ``num_new_tokens`` more.

        Returns:
            Its whole block table, or None when the GPU pool is short (nothing is taken then).
        """
        rid = request.request_id
        cpu_ids = self.req_to_cpu_blocks[rid]
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if max(total, len(cpu_ids)) > self.block_pool.num_free_blocks:
            return None
        gpu_ids = self.block_pool.take(len(cpu_ids))
        self._swaps.swap_in.extend(zip(cpu_ids, gpu_ids))
        self.num_blocks_swapped_in += len(cpu_ids)
        del self.req_to_cpu_blocks[rid]
        self.cpu.free_after_step(cpu_ids)
        self.req_to_blocks[rid] = gpu_ids
        self.cache_full_blocks(request, request.num_computed_tokens)
        new = self.allocate_slots(request, num_new_tokens)
        assert new is not None
        return list(self.req_to_blocks[rid])

    def free_cpu_blocks(self, request_id: str) -> None:
        """A swapped-out request ends (abort): its CPU blocks are free (after this step's copies into them)."""
        cpu_ids = self.req_to_cpu_blocks.pop(request_id, None)
        self._cpu_hits.pop(request_id, None)
        if cpu_ids:
            self.cpu.give_back(cpu_ids)

    def swap_stats(self) -> dict[str, int]:
        """The CPU tier's counters (engine stats, /metrics, bench JSON): blocks copied each way, prefix-cache
        blocks restored from the CPU tier, the tier's size and its blocks in use."""
        return {"num_blocks_swapped_out": self.num_blocks_swapped_out,
                "num_blocks_swapped_in": self.num_blocks_swapped_in,
                "cpu_prefix_cache_hit_blocks": self.num_cpu_hit_blocks,
                "num_blocks_written_through": self.num_blocks_written_through,
                "num_cpu_kv_blocks": self.cpu.num_blocks if self.cpu is not None else 0,
                "num_used_cpu_kv_blocks": self.num_used_cpu_blocks}

    @property
    def num_used_cpu_blocks(self) -> int:
        return self.cpu.num_used_blocks if self.cpu is not None else 0
