"""BlockPool: KV-cache blocks, their reference counts, the LRU free queue and the prefix-cache index
(plain Python)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVBlock:
    """One block of the KV cache.

    Attributes:
        block_id: index into the cache tensors.
        ref_cnt: requests using the block now; 0 = free (it may still hold a cached prefix).
        block_hash: chained hash of the tokens it holds once full and cached, else None.
        tokens: the tokens it holds when cached (checked on a hit, so a hash collision can never reuse a block).
        parent_hash: the hash of the previous block of the prefix (None for the first block).
        hits: prefix hits on the block since it took its content (a block restored from the CPU tier starts at 1:
            that restore was a hit); the CPU tier keeps only blocks with hits (core/cpu_kv_tier.py).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    tokens: tuple[int, ...] | None = None
    parent_hash: int | None = None
    hits: int = 0


class BlockPool:
    """Hands out KV block ids 0..num_blocks-1.

    Free blocks wait in an LRU queue: new blocks are taken from its front and freed blocks join its back, so ids
    are predictable in tests (a fresh pool hands out 0, 1, 2, ...). A free block that still holds a cached prefix
    keeps its hash until it is taken for new content (evicted) -- least recently freed first.

    Args:
        num_blocks: total number of blocks in the KV cache.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block_hash -> block_id
        self.num_evictions = 0
        # called with a cached block about to be evicted, before its content is lost (the CPU tier copies it)
        self.on_evict = None
        # called with a cached block on its first prefix hit since it took its content: the CPU tier queues its
        # write-through copy (core/cpu_kv_tier.py)
        self.on_first_hit = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def take(self, n: int) -> list[int]:
        """Take n blocks from the front of the free queue (evicting any cached content); ref_cnt becomes 1.

        Raises:
            ValueError: fewer than n blocks are free (callers check first).
        """
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict
                if self.on_evict is not None:
                    self.on_evict(block)
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = block.tokens = block.parent_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            block.hits = 0
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Add a reference to each block (a prefix hit); a free one leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1
            block.hits += 1
            if block.hits == 1 and self.on_first_hit is not None:
                self.on_first_hit(block)

    def give_back(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks that reach 0 join the back of the free queue in this order
        (their cached content stays until evicted)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...]) -> None:
        """Record that block_id holds `tokens` after the prefix ending in `parent_hash`."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash, block.parent_hash, block.tokens = block_hash, parent_hash, tokens
        self.cached.setdefault(block_hash, block_id)

    def lookup(self, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `tokens` after `parent_hash`, or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.tokens != tokens or block.parent_hash != parent_hash:  # hash collision: not the same prefix
            return None
        return block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Returns False (and does nothing) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.tokens = block.parent_hash = None
        self.cached.clear()
        return True

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (referenced by a request), in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0
