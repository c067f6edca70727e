"""Prefix caching in the KVCacheManager and the scheduler: exact block ids on tiny sizes."""

from hayabusa.config import SchedulerConfig
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request
from hayabusa.core.scheduler import Scheduler
from hayabusa.sampling_params import SamplingParams


def make_kv_cache_manager(num_blocks, block_size, enable_prefix_caching=True):
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching)


def make_request(rid, prompt, max_tokens=8):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,), max_tokens=max_tokens)


def test_prefix_hit_shares_blocks():
    mgr = make_kv_cache_manager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert mgr.allocate_slots(a, 9) == [0, 1, 2]          # blocks 0 and 1 are full and cached
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42])
    hit_blocks, num_hit_tokens = mgr.get_computed_blocks(b)
    assert hit_blocks == [0, 1] and num_hit_tokens == 8
    assert mgr.block_pool.num_free_blocks == 5             # a lookup takes nothing
    b.num_computed_tokens = 0
    assert mgr.allocate_slots(b, 1, hit_blocks) == [3]     # only the last token needs a new block
    assert mgr.get_block_ids("b") == [0, 1, 3]
    assert mgr.block_pool.blocks[0].ref_cnt == 2 and mgr.block_pool.blocks[3].ref_cnt == 1


def test_partial_hit_stops_at_first_different_block():
    mgr = make_kv_cache_manager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    mgr.allocate_slots(a, 13)                              # blocks 0, 1, 2 full, 3 partial
    b = make_request("b", [1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13])
    assert mgr.get_computed_blocks(b) == ([0], 4)          # same tokens in block 2 do not count: chained hash


def test_whole_prompt_hit_still_recomputes_last_token():
    mgr = make_kv_cache_manager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    mgr.allocate_slots(a, 8)
    mgr.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert mgr.get_computed_blocks(b) == ([0], 4)          # at most num_tokens - 1 = 7 tokens: one whole block


def test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first():
    mgr = make_kv_cache_manager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots(a, 5) == [0, 1, 2]
    mgr.free(a)                                            # free queue: 3, then a's blocks tail first: 2, 1, 0
    assert mgr.block_pool.num_free_blocks == 4
    b = make_request("b", [9, 9, 9])
    assert mgr.allocate_slots(b, 3) == [3, 2]              # takes the never-used block, then a's tail
    assert mgr.block_pool.num_evictions == 0               # block 2 held a partial block: nothing cached in it
    c = make_request("c", [1, 2, 3, 4, 7])
    assert mgr.get_computed_blocks(c) == ([0, 1], 4)       # a's prefix blocks survived
    d = make_request("d", [8, 8, 8])
    assert mgr.allocate_slots(d, 3) == [1, 0]              # now a's cached blocks are evicted, tail first
    assert mgr.block_pool.num_evictions == 2
    assert mgr.get_computed_blocks(c) == ([], 0)


def test_shared_block_is_never_evicted_while_referenced():
    mgr = make_kv_cache_manager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    mgr.allocate_slots(a, 3)                               # [0, 1]; block 0 cached
    b = make_request("b", [1, 2, 5])
    hits, n = mgr.get_computed_blocks(b)
    assert (hits, n) == ([0], 2)
    assert mgr.allocate_slots(b, 1, hits) == [2]
    mgr.free(a)                                            # block 0 still referenced by b
    assert not mgr.block_pool.is_free(0) and mgr.block_pool.blocks[0].ref_cnt == 1
    c = make_request("c", [7, 7, 7, 7])
    assert mgr.allocate_slots(c, 4) == [3, 1]              # never block 0
    assert mgr.allocate_slots(make_request("d", [6, 6, 6]), 3) is None


def test_reset_prefix_cache_only_when_idle():
    mgr = make_kv_cache_manager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    mgr.allocate_slots(a, 3)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("b", [1, 2, 3])) == ([], 0)


def test_disabled_prefix_caching_never_hits():
    mgr = make_kv_cache_manager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.allocate_slots(a, 9)
    assert mgr.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == ([], 0)


def test_scheduler_admits_with_hits_and_counts_them():
    kv = make_kv_cache_manager(num_blocks=16, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    shared = list(range(100, 112))                         # 3 full blocks
    a = make_request("a", shared + [1, 2])
    s.add_request(a)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 14}
    s.update_from_output(out, {"a": [7]})
    b = make_request("b", shared + [3])
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}    # b: 12 cached tokens, only its own token computed
    assert out.num_computed_tokens["b"] == 12 and b.num_cached_tokens == 12
    assert b.num_computed_tokens == 13 and b.num_output_placeholders == 1   # advanced when scheduled
    assert out.new_block_ids["b"][:3] == kv.get_block_ids("a")[:3]
    assert kv.prefix_hit_rate == 12 / (14 + 13)
