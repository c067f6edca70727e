"""KVCacheManager: the sole owner of block ids; maps requests to their blocks and finds cached prefixes
(plain Python)."""

from __future__ import annotations

from hayabusa.core.block_pool import BlockPool
from hayabusa.core.cpu_kv_tier import CpuTierMixin
from hayabusa.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def block_key(request: Request, tokens: list[int], i: int, bs: int) -> tuple:
    """What identifies block ``i`` of ``request`` besides its parent: its tokens, then the content hash of every
    image whose placeholder tokens fall in it (vLLM's extra keys), so the same text with different images never
    shares KV."""
    key = tuple(tokens[i * bs:(i + 1) * bs])
    if not request.mm_inputs:
        return key
    start, end = i * bs, (i + 1) * bs
    extra = tuple(img.content_hash for img in request.mm_inputs if img.offset < end and img.end > start)
    return key + extra if extra else key


class KVCacheManager(CpuTierMixin):
    """Allocates and frees KV-cache blocks for requests; with prefix caching, reuses blocks across requests.

    A request's blocks form its block table: token position p lives in block ``blocks[p // block_size]`` at
    offset ``p % block_size``. The table only grows while the request runs; it is freed whole when the request
    finishes or is preempted.

    Prefix caching (vLLM's automatic prefix caching): a full block is identified by a chained hash of its tokens
    and of every token before it, ``hash((parent_hash, tokens))``. A new request reuses the longest run of cached
    full blocks that starts its token sequence (at most ``num_tokens - 1`` tokens: the last token is always
    recomputed, since sampling needs its logits). Shared blocks are reference counted; a block whose count drops
    to 0 keeps its content in the LRU free queue until a new allocation evicts it.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse cached prefixes.
        num_cpu_blocks: blocks of the CPU tier (``swap_space``; 0 = none): swapped-out requests, and prefix-cache
            blocks evicted from the GPU (see core/cpu_kv_tier.py).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_cross_blocks: dict[str, list[int]] = {}   # encoder-decoder: cross-attention blocks
        self._num_cached: dict[str, int] = {}  # request id -> how many of its blocks are in the cache index
        self.num_query_tokens = 0              # prompt tokens looked up (prefix-hit statistics)
        self.num_hit_tokens = 0
        self.init_cpu_tier(num_cpu_blocks)

    # ------------------------------------------------------------------ prefix cache
    def block_hashes(self, request: Request) -> list[int]:
        """Chained hashes of the request's full blocks (kept on the request, extended as it grows)."""
        hashes: list[int] = request.block_hashes
        bs, tokens = self.block_size, request.all_token_ids
        while len(hashes) < len(tokens) // bs:
            i = len(hashes)
            hashes.append(hash((hashes[-1] if i else None, block_key(request, tokens, i, bs))))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request, in whole blocks.

        Returns:
            (GPU block ids, number of tokens hit). The tokens include blocks found in the CPU tier after the GPU
            ones; ``allocate_slots`` copies those back into new GPU blocks. Nothing is taken here.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs, tokens = self.block_size, request.all_token_ids
        hashes = self.block_hashes(request)
        # NOTE: when the whole prompt hits the cache we still recompute its last token,
        # because sampling needs that token's logits.
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.block_pool.lookup(hashes[i], hashes[i - 1] if i else None,
                                              block_key(request, tokens, i, bs))
            if block_id is None:
                break
            hits.append(block_id)
        num_cpu = self._lookup_cpu(request, hashes, lambda i: block_key(request, tokens, i, bs), len(hits),
                                   max_blocks)   # the CPU tier's run after the GPU's
        return hits, (len(hits) + num_cpu) * bs

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup in the prefix-hit statistics."""
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Enter the request's blocks that are full within its first ``num_tokens`` tokens (default: all the
        tokens its blocks hold) into the prefix-cache index."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        bs = self.block_size
        if num_tokens is None:
            num_tokens = min(request.num_tokens, len(blocks) * bs)
        # only blocks whose tokens are all known: a token sampled by a step still in flight has no value yet
        num_full = min(num_tokens // bs, len(blocks), request.num_tokens // bs)
        start = self._num_cached.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes, tokens = self.block_hashes(request), request.all_token_ids
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i], hashes[i - 1] if i else None,
                                        block_key(request, tokens, i, bs))
        self._num_cached[request.request_id] = num_full

    @property
    def prefix_hit_rate(self) -> float:
        """Cached tokens / looked-up tokens since start (0 when nothing was looked up)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; False (nothing done) while requests hold blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.reset_cpu_prefix_cache()
        return True

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Reserve blocks so that ``num_computed_tokens + (cached tokens) + num_new_tokens`` tokens fit.

        Args:
            request: the request.
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: prefix-hit blocks (from get_computed_blocks) to append first, when admitting.

        Returns:
            The newly allocated block ids (may be empty), or None if the pool is short (nothing is taken then).
        """
        bs = self.block_size
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        cpu_hits = self._cpu_hits.pop(request.request_id, None) if self._cpu_hits else None
        if not new_computed_blocks and not cpu_hits:  # the common decode step: its slot is already in the last block
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * bs:
                if self.enable_prefix_caching and \
                        request.num_tokens // bs > self._num_cached.get(request.request_id, 0):
                    self.cache_full_blocks(request, total)
                return []
        hits = new_computed_blocks or []
        num_cpu = len(cpu_hits) if cpu_hits else 0   # restored into the first of the new blocks
        total = request.num_computed_tokens + (len(hits) + num_cpu) * bs + num_new_tokens
        num_new = cdiv(total, self.block_size) - len(blocks) - len(hits)
        # Hit blocks that sit in the free queue are not available for new content.
        num_hits_free = sum(1 for b in hits if self.block_pool.is_free(b))
        if max(num_new, 0) + num_hits_free > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hits)
        blocks.extend(hits)
        if num_cpu:   # locked first: taking GPU blocks may evict to the CPU tier
            self.cpu.lock(cpu_hits)
        new_ids = self.block_pool.take(num_new) if num_new > 0 else []
        if num_cpu:
            self._restore_cpu_hits(cpu_hits, new_ids)
        blocks.extend(new_ids)
        self.cache_full_blocks(request, total)
        return new_ids

    def fits_in_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """allocate_slots' fast path alone: True when the request's ``num_computed_tokens + num_new_tokens``
        tokens fit the blocks it holds (a decode step inside its last block), having done what allocate_slots
        does then (full blocks entered into the prefix cache); False, with nothing done, when allocate_slots
        must take blocks (or restore CPU-tier hits). The scheduler's decode loop calls this for every running
        request."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None or (self._cpu_hits and rid in self._cpu_hits):
            return False
        total = request.num_computed_tokens + num_new_tokens
        bs = self.block_size
        if total > len(blocks) * bs:
            return False
        if self.enable_prefix_caching and len(request.all_token_ids) // bs > self._num_cached.get(rid, 0):
            self.cache_full_blocks(request, total)
        return True

    def decode_block_lists(self) -> dict[str, list[int]] | None:
        """The request id -> block ids map, for a caller that checks many decode steps at once, when
        ``fits_in_blocks(request, n)`` is exactly ``request.num_computed_tokens + n <= len(blocks) * block_size``
        (blocks = this map's entry; a request without one does not fit): no prefix caching (nothing to enter into
        the cache) and no CPU-tier hits pending. None otherwise: call fits_in_blocks per request. Read only; valid
        until blocks are allocated or freed."""
        if self.enable_prefix_caching or self._cpu_hits:
            return None
        return self.req_to_blocks

    def allocate_cross_blocks(self, request: Request, num_encoder_tokens: int) -> list[int] | None:
        """Reserve the request's cross-attention blocks (encoder-decoder models): ``cdiv(num_encoder_tokens,
        block_size)`` blocks from the same pool, never shared or prefix-cached, freed with the request.

        Returns:
            The block ids, or None if the pool is short (nothing is taken then).
        """
        assert request.request_id not in self.req_to_cross_blocks, request.request_id
        num = cdiv(num_encoder_tokens, self.block_size)
        if num > self.block_pool.num_free_blocks:
            return None
        ids = self.block_pool.take(num)
        self.req_to_cross_blocks[request.request_id] = ids
        return ids

    def free(self, request: Request) -> None:
        """Drop the request's references (last block first, so its tail is evicted before its prefix), its
        cross-attention blocks, and its CPU blocks when it was swapped out."""
        if self.req_to_cpu_blocks or self._cpu_hits:
            self.free_cpu_blocks(request.request_id)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.block_pool.give_back(blocks[::-1])
        cross = self.req_to_cross_blocks.pop(request.request_id, None)
        if cross:
            self.block_pool.give_back(cross[::-1])

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Tokens in the request's leading blocks that other requests hold too (they stay on the GPU if it
        lets its blocks go: a prefix hit when it comes back)."""
        n = 0
        blocks = self.block_pool.blocks
        for block_id in self.req_to_blocks.get(request.request_id, ()):
            if blocks[block_id].ref_cnt < 2:
                break
            n += 1
        return n * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks
