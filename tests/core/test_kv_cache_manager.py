"""KVCacheManager and BlockPool: exact block ids on tiny sizes."""

from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request
from hayabusa.sampling_params import SamplingParams


def make_request(rid: str, prompt: list[int], max_tokens: int = 16) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,), max_tokens=max_tokens)


def test_allocate_appends_blocks_in_pool_order():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10, 19)))          # 9 tokens -> 3 blocks
    assert mgr.allocate_slots(a, 9) == [0, 1, 2]
    a.num_computed_tokens = 9
    assert mgr.allocate_slots(a, 3) == []                # 12 tokens still fit in 3 blocks
    assert mgr.allocate_slots(a, 4) == [3]               # 13 tokens -> 4th block
    assert mgr.get_block_ids("a") == [0, 1, 2, 3]
    assert mgr.num_free_blocks == 4
    assert mgr.usage == 0.5


def test_allocation_that_does_not_fit_takes_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    assert mgr.allocate_slots(a, 8) == [0, 1]
    b = make_request("b", list(range(9)))
    assert mgr.allocate_slots(b, 9) is None              # needs 3, 1 free
    assert mgr.num_free_blocks == 1
    assert mgr.get_block_ids("b") == []


def test_free_returns_blocks_and_they_are_reused_last_freed_last():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    b = make_request("b", [5, 6])
    assert mgr.allocate_slots(a, 4) == [0, 1]
    assert mgr.allocate_slots(b, 2) == [2]
    mgr.free(a)                                          # given back tail first: free list [3, 1, 0]
    assert mgr.num_free_blocks == 3
    c = make_request("c", [7, 8, 9, 10, 11, 12])
    assert mgr.allocate_slots(c, 6) == [3, 1, 0]
    assert mgr.get_block_ids("a") == []
