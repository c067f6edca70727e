"""BlockPool: the free list of KV-cache block ids (plain Python)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids 0..num_blocks-1.

    Free blocks are taken from the front of the free list and returned to its back, so ids are predictable in
    tests (a fresh pool hands out 0, 1, 2, ...).

    Args:
        num_blocks: total number of blocks in the KV cache.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Remove n free block ids from the pool. Raises ValueError if fewer are free (callers check first)."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, block_ids: list[int]) -> None:
        """Return blocks to the pool (most recently freed last)."""
        self._free.extend(block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0
