"""KVCacheManager: the sole owner of block ids; maps requests to their blocks (plain Python)."""

from __future__ import annotations

from hayabusa.core.block_pool import BlockPool
from hayabusa.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    """Allocates and frees KV-cache blocks for requests.

    A request's blocks form its block table: token position p lives in block ``blocks[p // block_size]`` at
    offset ``p % block_size``. The table only grows while the request runs; it is freed whole when the request
    finishes or is preempted.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Reserve blocks so that ``num_computed_tokens + num_new_tokens`` tokens fit.

        Returns:
            The newly added block ids (appended to the request's block table; may be empty), or None if the pool
            is short (nothing is taken then).
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new = num_needed - len(blocks)
        if num_new <= 0:
            return []
        if num_new > self.block_pool.num_free_blocks:
            return None
        new_ids = self.block_pool.take(num_new)
        blocks.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (last block first, so the tail is reused last)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.give_back(blocks[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks
