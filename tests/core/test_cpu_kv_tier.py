"""The KV cache's CPU tier (swap_space): swap-based preemption and the prefix cache's CPU tier, exact block ids."""

from hayabusa.config import SchedulerConfig
from hayabusa.core.cpu_kv_tier import CpuKVTier, prefer_swap
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request, RequestStatus
from hayabusa.core.scheduler import Scheduler
from hayabusa.sampling_params import SamplingParams


def make_request(rid, prompt, max_tokens=8):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,), max_tokens=max_tokens)


def test_cpu_tier_takes_fresh_ids_then_lru_and_evicts_cached_content():
    tier = CpuKVTier(3)
    assert tier.store(11, None, (1,)) == 0 and tier.store(12, 11, (2,)) == 1    # evicted GPU blocks, left free
    assert tier.num_free_blocks == 3 and tier.num_used_blocks == 0
    assert tier.lookup(12, 11, (2,)) == 1 and tier.lookup(12, 99, (2,)) is None  # parent checked
    assert tier.take(2) == [2, 0]                       # the fresh id first, then the LRU block (evicts hash 11)
    assert tier.lookup(11, None, (1,)) is None and tier.num_evictions == 1
    assert tier.take(2) is None                         # one free block left: nothing taken
    tier.lock([1])                                      # read by a swap-in this step: not free until released
    assert tier.take(1) is None
    tier.release_locks()
    assert tier.num_free_blocks == 1 and tier.lookup(12, 11, (2,)) == 1   # still cached after the read
    tier.give_back([2, 0])
    assert tier.num_used_blocks == 0


def test_swap_out_frees_gpu_blocks_and_swap_in_restores_the_table():
    mgr = KVCacheManager(8, 4, enable_prefix_caching=False, num_cpu_blocks=4)
    a = make_request("a", list(range(10, 20)))          # 10 tokens: 3 blocks
    assert mgr.allocate_slots(a, 10) == [0, 1, 2]
    a.num_computed_tokens = 10
    assert mgr.swap_out(a) and mgr.is_swapped("a")
    assert mgr.num_free_blocks == 8 and mgr.num_used_cpu_blocks == 3
    swaps = mgr.take_swaps()
    assert swaps.swap_out == [(0, 0), (1, 1), (2, 2)] and swaps.swap_in == []
    b = make_request("b", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots(b, 5) == [3, 4]           # the freed blocks join the back of the queue
    a.all_token_ids.append(7)                           # its sampled token: 11 tokens, 1 to compute
    assert mgr.swap_in(a, 1) == [5, 6, 7]               # 3 blocks back, the 11th token fits the last one
    swaps = mgr.take_swaps()
    assert swaps.swap_in == [(0, 5), (1, 6), (2, 7)] and swaps.swap_out == []
    assert mgr.num_used_cpu_blocks == 0                 # released when the step's lists were taken
    assert mgr.num_blocks_swapped_out == 3 and mgr.num_blocks_swapped_in == 3


def test_swap_out_refused_when_the_cpu_tier_is_short_and_swap_in_when_the_gpu_is():
    mgr = KVCacheManager(4, 4, num_cpu_blocks=2)
    a = make_request("a", list(range(10, 20)))
    mgr.allocate_slots(a, 10)
    assert not mgr.swap_out(a) and mgr.get_block_ids("a") == [0, 1, 2]    # 3 blocks, 2 CPU blocks: no swap
    assert not KVCacheManager(4, 4).swap_out(a)                            # no tier
    mgr = KVCacheManager(4, 4, num_cpu_blocks=4)
    mgr.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    assert mgr.swap_out(a)
    b = make_request("b", list(range(8)))
    mgr.allocate_slots(b, 8)                            # 2 of 4 GPU blocks left
    assert mgr.swap_in(a, 1) is None and mgr.is_swapped("a") and mgr.num_free_blocks == 2
    mgr.free(a)                                         # abort while swapped out: its CPU blocks come back
    mgr.free(b)
    mgr.take_swaps()
    assert mgr.num_used_cpu_blocks == 0 and mgr.num_free_blocks == 4


def test_evicted_prefix_block_moves_to_cpu_and_comes_back_on_a_hit():
    mgr = KVCacheManager(4, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert mgr.allocate_slots(a, 9) == [0, 1, 2]          # blocks 0 and 1 full and cached
    a2 = make_request("a2", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # shares them: a prefix hit (the tier keeps hit blocks)
    assert mgr.get_computed_blocks(a2) == ([0, 1], 8)
    assert mgr.allocate_slots(a2, 1, [0, 1]) == [3] and mgr.get_block_ids("a2") == [0, 1, 3]
    assert mgr.take_swaps(step_id=1).write_through == []  # step 1 may be computing them: not copied in it
    swaps = mgr.take_swaps(step_id=2)                     # written through once hit, not when evicted:
    assert swaps.write_through == [(0, 0), (1, 1)]        # GPU 0 (tokens 1..4) -> CPU 0, GPU 1 (5..8) -> CPU 1
    assert swaps.swap_out == [] and swaps.fence == 0
    mgr.free(a2)
    mgr.free(a)                                           # free queue: 3, 2, 1, 0
    c = make_request("c", list(range(100, 116)))          # 16 tokens: takes all 4 blocks, evicting 1 and 0
    assert mgr.allocate_slots(c, 16) == [3, 2, 1, 0]
    swaps = mgr.take_swaps(step_id=3)
    assert swaps.swap_out == [] and swaps.write_through == []   # the eviction copies nothing
    assert swaps.fence == 2                               # step 3 overwrites blocks that step 2's copies read
    mgr.free(c)                                           # free queue: 0, 1, 2, 3 (c's 4 blocks cached)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert hits == [] and num_hit == 8                    # both blocks found in the CPU tier
    assert mgr.allocate_slots(b, 1, hits) == [0, 1, 2]    # two restored, one for the last token
    swaps = mgr.take_swaps()
    assert swaps.swap_out == []                           # c's evicted blocks were never shared: dropped, not copied
    assert swaps.swap_in == [(0, 0), (1, 1)]              # CPU 0 (1..4) -> GPU 0, CPU 1 (5..8) -> GPU 1
    assert mgr.num_cpu_hit_blocks == 2 and mgr.get_block_ids("b") == [0, 1, 2]
    assert mgr.get_computed_blocks(make_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == ([0, 1], 8)  # on GPU again
    mgr.free(b)
    mgr.take_swaps()
    assert mgr.num_free_blocks == 4 and mgr.num_used_cpu_blocks == 0


def test_cpu_hit_read_this_step_is_not_overwritten_by_an_eviction_of_the_same_step():
    mgr = KVCacheManager(2, 4, enable_prefix_caching=True, num_cpu_blocks=1)
    a = make_request("a", [1, 2, 3, 4, 5])
    mgr.allocate_slots(a, 5)                              # GPU 0 cached (1..4)
    mgr.free(a)                                           # free queue: 1, 0
    a2 = make_request("a2", [1, 2, 3, 4, 6])              # a prefix hit on GPU 0 (the tier keeps hit blocks)
    assert mgr.get_computed_blocks(a2) == ([0], 4)
    assert mgr.allocate_slots(a2, 1, [0]) == [1]
    mgr.free(a2)                                          # free queue: 1, 0
    c = make_request("c", list(range(100, 108)))
    mgr.allocate_slots(c, 8)                              # evicts GPU 0 -> CPU 0
    mgr.cache_full_blocks(c)
    mgr.free(c)                                           # free queue: 0, 1 (c's tokens cached)
    mgr.take_swaps()
    b = make_request("b", [1, 2, 3, 4, 5])
    assert mgr.get_computed_blocks(b) == ([], 4)
    assert mgr.allocate_slots(b, 1, []) == [0, 1]         # evicting c's blocks finds the only CPU block locked
    swaps = mgr.take_swaps()
    assert swaps.swap_in == [(0, 0)] and swaps.swap_out == []
    assert mgr.cpu.lookup(*mgr.cpu.meta[0]) == 0          # the CPU copy of (1..4) survived


def test_prefer_swap_follows_the_mode_and_the_context_length():
    assert prefer_swap("swap", 1) and not prefer_swap("recompute", 10**6)
    assert not prefer_swap(None, 16) and prefer_swap(None, 4096)


def _scheduler(mode, num_blocks=6, num_cpu_blocks=8):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False, num_cpu_blocks=num_cpu_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                     preemption_mode=mode), kv)


def _run_step(sched, tokens):
    out = sched.schedule()
    sampled = {rid: [tokens] for rid in out.sampling_req_ids}
    sched.update_from_output(out, sampled)
    return out


def _run_all(sched, max_steps=40):
    outs = []
    while sched.has_unfinished_requests() and len(outs) < max_steps:
        outs.append(_run_step(sched, 5))
    assert not sched.has_unfinished_requests()
    return outs


def test_scheduler_swaps_a_preempted_request_out_and_back_in():
    sched = _scheduler("swap")
    a, b = make_request("a", list(range(10, 18))), make_request("b", list(range(30, 38)))
    sched.add_request(a)
    sched.add_request(b)
    out = _run_step(sched, 5)                              # 8 prompt tokens each, +1 sampled
    assert out.new_block_ids == {"a": [0, 1], "b": [2, 3]}
    for _ in range(4):                                     # token 9: a gets block 4, b block 5; then 12 computed
        _run_step(sched, 5)
    out = sched.schedule()                                 # a needs a 4th block: b (admitted last) is swapped out
    assert out.preempted_req_ids == {"b"} and sched.num_swap_preemptions == 1
    assert out.blocks_to_swap_out == [(2, 0), (3, 1), (5, 2)] and out.new_block_ids == {"a": [5]}
    assert b.num_computed_tokens == 12 and b.status == RequestStatus.PREEMPTED
    sched.update_from_output(out, {"a": [5]})
    outs = _run_all(sched)
    resumes = [o for o in outs if o.blocks_to_swap_in]
    assert len(resumes) == 1                               # once a finished: 4 GPU blocks free
    out = resumes[0]
    assert out.scheduled_cached_reqs.req_ids == ["b"] and out.scheduled_cached_reqs.resumed_from_preemption == [True]
    assert [src for src, _ in out.blocks_to_swap_in] == [0, 1, 2]
    assert out.num_computed_tokens["b"] == 12 and out.num_scheduled_tokens["b"] == 1   # nothing recomputed
    assert b.num_output_tokens == 8 and sched.num_preemptions == 1
    sched.kv.take_swaps()
    assert sched.kv.num_free_blocks == 6 and sched.kv.num_used_cpu_blocks == 0


def test_recompute_mode_never_swaps_and_abort_while_swapped_frees_cpu_blocks():
    for mode in ("recompute", "swap"):
        sched = _scheduler(mode)
        a, b = make_request("a", list(range(10, 22))), make_request("b", list(range(30, 42)))
        sched.add_request(a)
        sched.add_request(b)
        for _ in range(2):                                 # 12-token prompts: 3 blocks each; the 13th preempts b
            _run_step(sched, 5)
        assert sched.num_preemptions == 1
        if mode == "recompute":
            assert sched.num_swap_preemptions == 0 and b.num_computed_tokens == 0 and not sched.kv.is_swapped("b")
            _run_all(sched)
        else:
            assert sched.kv.is_swapped("b") and sched.kv.num_used_cpu_blocks == 3
            sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)      # abort during the swap
            assert not sched.kv.is_swapped("b")
            _run_all(sched)
        sched.kv.take_swaps()
        assert sched.kv.num_free_blocks == 6 and sched.kv.num_used_cpu_blocks == 0


def test_after_a_dropped_step_swapped_requests_are_recomputed():
    sched = _scheduler("swap")
    a, b = make_request("a", list(range(10, 22))), make_request("b", list(range(30, 42)))
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(2):
        _run_step(sched, 5)
    assert sched.kv.is_swapped("b") and b.num_computed_tokens == 12
    sched.forget_in_flight()                  # the engine dropped a step: its swap-out may never have run
    assert not sched.kv.is_swapped("b") and b.num_computed_tokens == 0 and sched.kv.num_used_cpu_blocks == 0
    outs = _run_all(sched)
    assert not any(o.blocks_to_swap_in for o in outs)            # b recomputed, not swapped in
    assert b.num_output_tokens == 8
    sched.kv.take_swaps()
    assert sched.kv.num_free_blocks == 6 and sched.kv.num_used_cpu_blocks == 0


def test_only_blocks_that_were_hit_move_to_the_cpu_tier():
    """An evicted block is copied to the CPU only if a prefix hit reused it (KVBlock.hits): a request's own prompt
    and output blocks are dropped, a shared prefix is kept; a block restored from the CPU counts as hit."""
    mgr = KVCacheManager(4, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    solo = make_request("solo", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.allocate_slots(solo, 9)                           # blocks 0, 1 cached, never shared
    mgr.free(solo)
    x = make_request("x", list(range(100, 116)))
    mgr.allocate_slots(x, 16)                             # evicts them: dropped
    assert mgr.take_swaps().swap_out == [] and mgr.num_blocks_swapped_out == 0
    mgr.free(x)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 6])
    mgr.allocate_slots(a, 5)
    hits, n = mgr.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1
    mgr.allocate_slots(b, 1, hits)                        # b shares a's first block: hits 1
    shared = hits[0]
    mgr.free(a)
    mgr.free(b)
    y = make_request("y", list(range(200, 216)))
    mgr.allocate_slots(y, 16)                             # evicts everything: only the shared block is copied
    assert [g for g, _ in mgr.take_swaps().swap_out] == [shared]
    mgr.free(y)
    c = make_request("c", [1, 2, 3, 4, 7])
    assert mgr.get_computed_blocks(c) == ([], 4)          # found in the CPU tier
    new = mgr.allocate_slots(c, 1, [])
    assert mgr.take_swaps().swap_in == [(0, new[0])] and mgr.block_pool.blocks[new[0]].hits == 1
