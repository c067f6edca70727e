"""The CPU KV tier's write-through: a prefix block is copied to the CPU after its first hit (within a per-step
budget), its eviction then copies nothing, and no step gives a block new content while its copy may still run
(the scheduler's fence + the runner's WriteThroughEvents, with the side stream simulated on the CPU)."""

from __future__ import annotations

import pytest

from hayabusa.config import SchedulerConfig
from hayabusa.core import cpu_kv_tier
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request
from hayabusa.core.scheduler import Scheduler
from hayabusa.sampling_params import SamplingParams
from hayabusa.worker.kv_swap import WriteThroughEvents

PREFIX = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]   # 4 blocks of 4


def make_request(rid, prompt, max_tokens=8):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,), max_tokens=max_tokens)


def _shared_prefix(mgr):
    """Two requests share PREFIX: blocks 0..3 get their first hit (in that order) when the second is admitted."""
    a, a2 = make_request("a", PREFIX + [50]), make_request("a2", PREFIX + [51])
    assert mgr.allocate_slots(a, 17) == [0, 1, 2, 3, 4]
    hits, n = mgr.get_computed_blocks(a2)
    assert hits == [0, 1, 2, 3] and n == 16
    assert mgr.allocate_slots(a2, 1, hits) == [5]
    return a, a2


def test_hit_blocks_are_written_through_within_the_budget_and_their_eviction_copies_nothing(monkeypatch):
    monkeypatch.setattr(cpu_kv_tier, "WRITE_THROUGH_BLOCKS_PER_STEP", 2)
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    a, a2 = _shared_prefix(mgr)                # blocks 4 and 5 (own tokens, never hit) are not candidates
    assert mgr.take_swaps(step_id=1).write_through == []        # hit in step 1, which may be computing them
    s2 = mgr.take_swaps(step_id=2)
    assert s2.write_through == [(0, 0), (1, 1)] and s2.swap_out == [] and s2.fence == 0   # the budget: 2
    assert mgr.take_swaps(step_id=3).write_through == [(2, 2), (3, 3)]                    # the rest, next step
    assert mgr.take_swaps(step_id=4).write_through == [] and not mgr.has_write_through_candidates
    assert mgr.num_blocks_written_through == 4 and mgr.num_blocks_swapped_out == 4
    mgr.free(a2)
    mgr.free(a)
    b = make_request("b", PREFIX + [52])       # hit again: not a first hit, and the CPU holds them: not queued
    hits, _ = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, 1, hits)
    mgr.free(b)
    assert not mgr.has_write_through_candidates
    # a request taking all 8 blocks evicts 0..3: no copy, but the step waits for step 3's write-through copies
    c = make_request("c", list(range(100, 132)))
    assert sorted(mgr.allocate_slots(c, 32)) == list(range(8))
    s5 = mgr.take_swaps(step_id=5)
    assert s5.swap_out == [] and s5.write_through == [] and s5.fence == 3
    assert mgr.num_blocks_swapped_out == 4
    mgr.free(c)
    mgr.take_swaps(step_id=6)
    d = make_request("d", PREFIX + [53])
    assert mgr.get_computed_blocks(d) == ([], 16)       # all 4 blocks found in the CPU tier
    new = mgr.allocate_slots(d, 1, [])
    assert mgr.take_swaps(step_id=7).swap_in == [(0, new[0]), (1, new[1]), (2, new[2]), (3, new[3])]


def test_a_block_evicted_before_its_write_through_is_copied_at_eviction(monkeypatch):
    monkeypatch.setattr(cpu_kv_tier, "WRITE_THROUGH_BLOCKS_PER_STEP", 2)
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    a, a2 = _shared_prefix(mgr)
    mgr.take_swaps(step_id=1)
    assert mgr.take_swaps(step_id=2).write_through == [(0, 0), (1, 1)]
    mgr.free(a2)
    mgr.free(a)                                # free queue: 6, 7, 5, 4, 3, 2, 1, 0
    c = make_request("c", list(range(100, 132)))
    mgr.allocate_slots(c, 32)                  # evicts all: 3 and 2 still queued -> copied now, the forward waits
    s3 = mgr.take_swaps(step_id=3)
    assert s3.swap_out == [(3, 2), (2, 3)] and s3.write_through == [] and s3.fence == 2
    assert not mgr.has_write_through_candidates and mgr.num_blocks_swapped_out == 4


def test_reset_prefix_cache_fences_every_write_through():
    mgr = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    a, a2 = _shared_prefix(mgr)
    mgr.take_swaps(step_id=6)
    assert len(mgr.take_swaps(step_id=7).write_through) == 4
    mgr.free(a2)
    mgr.free(a)
    assert mgr.reset_prefix_cache()            # the blocks lose their hashes: no eviction hook will see them
    assert mgr.has_pending_swaps and mgr.take_swaps(step_id=8).fence == 7
    assert mgr.cpu.cached == {}


class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_write_through_events_fence_returns_the_latest_covered_event_and_drops_done_ones():
    ev = WriteThroughEvents()
    e3, e5, e8 = FakeEvent(), FakeEvent(), FakeEvent()
    ev.record(3, e3)
    ev.record(5, e5)
    assert ev.fence(2) is None and len(ev) == 2           # nothing written through by step 2 is in flight
    assert ev.fence(4) is e3 and len(ev) == 1             # step 3's event; forgotten once waited for
    e5.done = True
    ev.record(8, e8)                                      # step 5's copies are done: dropped
    assert len(ev) == 1 and ev.fence(6) is None
    assert ev.fence(9) is e8 and len(ev) == 0


class SideStream:
    """The runner's side stream on the CPU: a step's write-through copies finish LAG steps after they start,
    unless a forward waits for them (a fence); WriteThroughEvents is the runner's own logic."""

    LAG = 8   # steps a copy runs unless waited for (longer than any real copy: the check must see overlaps)

    def __init__(self):
        self.events = WriteThroughEvents()
        self.in_flight: list[tuple[int, FakeEvent, set[int]]] = []   # (step, event, GPU blocks read)
        self.num_waits = 0

    def run_step(self, out, block_size):
        for step, event, _ in self.in_flight:
            if out.step_id - step >= self.LAG:
                event.done = True
        if out.write_through_fence:
            event = self.events.fence(out.write_through_fence)
            if event is not None:                             # the forward waits: that event and the earlier
                self.num_waits += not event.done
                for _, e, _ in self.in_flight:
                    e.done = True
                    if e is event:
                        break
        written = [b for r in out.scheduled_new_reqs for b in r.block_ids[r.num_computed_tokens // block_size:]]
        written += [b for ids in out.scheduled_cached_reqs.new_block_ids for b in ids]
        busy = {b for _, e, blocks in self.in_flight if not e.done for b in blocks}
        assert not busy & set(written), f"step {out.step_id} overwrites blocks whose copy is in flight"
        self.in_flight = [x for x in self.in_flight if not x[1].done]
        if out.blocks_to_write_through:
            event = FakeEvent()
            self.events.record(out.step_id, event)
            self.in_flight.append((out.step_id, event, {g for g, _ in out.blocks_to_write_through}))


def _run_stream(fences: bool):
    """A W10-like stream (4 prefixes of 4 blocks, 3 requests each, cycled twice) on a GPU cache of 20 blocks, too
    small for all: freed prefix blocks are written through, then evicted and reused while their copies still
    run. Returns (kv, side stream, whether a step overwrote a block whose copy was in flight)."""
    bs = 4
    kv = KVCacheManager(20, bs, enable_prefix_caching=True, num_cpu_blocks=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64), kv)
    n = 0
    for _ in range(2):
        for p in range(1, 5):
            for j in range(3):
                sched.add_request(make_request(f"r{n}", [100 * p + i for i in range(16)] + [7, j, n], max_tokens=4))
                n += 1
    side = SideStream()
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if not fences:
            out.write_through_fence = 0
        try:
            side.run_step(out, bs)
        except AssertionError:
            return kv, side, True
        sched.update_from_output(out, {rid: [5] for rid in out.sampling_req_ids})
    assert not sched.has_unfinished_requests()
    return kv, side, False


def test_no_block_is_overwritten_while_its_write_through_copy_is_in_flight():
    kv, side, overwritten = _run_stream(fences=True)
    assert not overwritten
    assert kv.num_blocks_written_through == 16            # every prefix went to the CPU ahead of its eviction
    assert kv.num_cpu_hit_blocks == 16                    # and came back from there in the second cycle
    assert kv.num_blocks_swapped_out == 16                # so no eviction copied anything
    assert side.num_waits > 0                             # a fence held a forward back
    assert kv.num_free_blocks == 20 and kv.num_used_cpu_blocks == 0


def test_without_the_fences_a_step_would_overwrite_a_block_in_flight():
    """The simulation sees the hazard: the same stream with the fences dropped trips its check."""
    assert _run_stream(fences=False)[2]


def test_auto_preemption_recomputes_a_request_whose_context_is_mostly_a_shared_prefix(monkeypatch):
    """Auto mode counts what a recompute would compute: the tokens after the prefix the request shares with
    running requests (found in the prefix cache when it comes back). Two requests of 16 + 4 tokens decode until
    the cache of 12 blocks is short. Nothing shared: each holds 6 blocks then, and the one preempted has 24
    computed tokens (>= SWAP_MIN_TOKENS, patched to 24): swapped. The 16 shared: 4 blocks shared + 4 own each,
    32 computed tokens of which 16 its own (< 24): recomputed, where counting all 32 would have swapped."""
    monkeypatch.setattr(cpu_kv_tier, "SWAP_MIN_TOKENS", 24)
    counts = {}
    for shared in (True, False):
        kv = KVCacheManager(12, 4, enable_prefix_caching=True, num_cpu_blocks=32)
        sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), kv)
        for i in range(2):
            prefix = PREFIX if shared else [200 * (i + 1) + t for t in range(16)]
            sched.add_request(make_request(f"r{i}", prefix + [60 + i, 61, 62, 63], max_tokens=24))
        for _ in range(200):
            if not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            sched.update_from_output(out, {rid: [5] for rid in out.sampling_req_ids})
        assert not sched.has_unfinished_requests() and kv.num_free_blocks == 12
        counts[shared] = (sched.num_preemptions, sched.num_swap_preemptions)
    assert counts[True][0] > 0 and counts[True][1] == 0          # preempted, recomputed
    assert counts[False][1] == counts[False][0] > 0              # nothing shared: swapped
    assert kv.num_shared_prefix_tokens(make_request("x", PREFIX)) == 0
