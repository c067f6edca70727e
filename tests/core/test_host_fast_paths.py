"""The scheduler's per-request fast paths (issue #17): the decode loop (`_schedule_decodes` with
`KVCacheManager.fits_in_blocks`, inlined where `decode_block_lists` allows, and the step's tokens counted as
computed in the same pass), the inlined stop check of `update_from_output` and the SchedulerOutput built
from the plan's keys take the same decisions as the general code, step by step (no model)."""

import dataclasses
import random

import pytest

from hayabusa.config import SchedulerConfig
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request, RequestStatus
from hayabusa.core.scheduler import Scheduler
from hayabusa.sampling_params import SamplingParams


def make_scheduler(num_blocks, prefix_caching, fast=True, block_size=4, max_num_seqs=6, budget=24,
                   max_model_len=48, pipeline_depth=1):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          pipeline_depth=pipeline_depth)
    s = Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))
    if not fast:   # the general loop of _schedule_running alone, and the general stop check
        s._schedule_decodes = lambda plan, budget: (0, budget)
    return s


def make_requests(seed):
    rng = random.Random(seed)
    reqs = []
    for i in range(10):
        kw = {}
        kind = i % 5
        if kind == 1:
            kw = dict(stop_token_ids=[5])
        elif kind == 2:
            kw = dict(min_tokens=3)
        elif kind == 3:
            kw = dict(ignore_eos=True)
        max_tokens = rng.randrange(3, 30)
        prompt = [rng.randrange(3, 9) for _ in range(rng.randrange(1, 20))]   # short alphabet: prefix hits
        params = SamplingParams(max_tokens=max_tokens, **kw)
        params.all_stop_token_ids = set(params.stop_token_ids)
        reqs.append((f"r{i}", prompt, params, max_tokens))
    return reqs


def run(s, reqs, seed, overlap):
    """Add the requests two per step and step until all finish; sampled tokens come from a seeded stream (EOS 2
    and the stop token 5 included). ``overlap``: as async scheduling, step N + 1 is scheduled before step N's
    tokens are back (placeholders). Returns every step's SchedulerOutput as plain fields with the updates, and
    each request's final state."""
    rng = random.Random(seed)
    pending = [Request(rid, p, params, eos_token_ids=(2,), max_tokens=mt) for rid, p, params, mt in reqs]
    made = list(pending)
    trace = []
    previous = None

    def update(out):
        sampled = {rid: [rng.choice([2, 5, 6, 7, 8, 9, 10])] for rid in sorted(out.sampling_req_ids)}
        updates = s.update_from_output(out, sampled)
        fields = dataclasses.asdict(out)
        fields["scheduled_new_reqs"] = [(n.req_id, n.block_ids, n.num_computed_tokens)
                                        for n in out.scheduled_new_reqs]
        trace.append((fields, [(r.request_id, ids, r.status) for r, ids in updates]))

    for _ in range(400):
        for _ in range(2):
            if pending:
                s.add_request(pending.pop(0))
        if not s.has_unfinished_requests() and not pending and previous is None:
            break
        out = s.schedule()
        if out.is_empty:
            out = None
        if not overlap and out is not None:
            update(out)
            continue
        if previous is not None:
            update(previous)
        previous = out
    assert not s.has_unfinished_requests()
    return trace, [(r.request_id, r.output_token_ids, r.status, r.stop_reason, r.num_preemptions) for r in made]


@pytest.mark.parametrize("overlap,pipeline_depth", [(False, 1), (True, 1), (True, 2)])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("num_blocks", [12, 64])       # 12: running requests preempt each other
def test_fast_paths_take_the_general_paths_decisions(prefix_caching, num_blocks, overlap, pipeline_depth):
    """pipeline_depth 2 (pipeline stages): both loops skip a request whose sampled token is in flight."""
    for seed in range(3):
        reqs = make_requests(seed)
        fast_sched = make_scheduler(num_blocks, prefix_caching, pipeline_depth=pipeline_depth)
        calls, decoded = [], []
        fits = fast_sched.kv.fits_in_blocks
        fast_sched.kv.fits_in_blocks = lambda r, n: calls.append(n) or fits(r, n)
        decodes = fast_sched._schedule_decodes

        def counting_decodes(plan, budget):
            result = decodes(plan, budget)
            decoded.append(plan.num_advanced)
            return result

        fast_sched._schedule_decodes = counting_decodes
        fast = run(fast_sched, reqs, seed, overlap)
        assert sum(decoded) > 20                       # the fast loop ran (and advanced its requests itself)
        # without prefix caching its block check is inlined (KVCacheManager.decode_block_lists), else per call
        assert (len(calls) > 20) == prefix_caching
        slow_sched = make_scheduler(num_blocks, prefix_caching, fast=False, pipeline_depth=pipeline_depth)
        slow_sched.update_from_output = _general_update(slow_sched)
        slow = run(slow_sched, reqs, seed, overlap)
        assert fast == slow
        statuses = {st for _, _, st, _, _ in fast[1]}
        # the workload reaches every way to finish, and preempts when the pool is small
        assert statuses == {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED}
        if num_blocks == 12:
            assert any(n for *_, n in fast[1])


def _general_update(s):
    """update_from_output as before the inlined stop check: _check_stop for every request."""
    def update(out, sampled):
        results = []
        for req in s._in_flight.pop(out.step_id, []):
            if req.status.finished:
                continue
            new_ids = sampled.get(req.request_id)
            if not new_ids:
                continue
            req.num_output_placeholders -= len(new_ids)
            req.output_token_ids.extend(new_ids)
            req.all_token_ids.extend(new_ids)
            status = s._check_stop(req)
            if status is not None:
                (s.running if req.status == RequestStatus.RUNNING else s.waiting).remove(req)
                req.status = status
                s._free(req)
            results.append((req, new_ids))
        return results
    return update


def test_fits_in_blocks():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=8)
    r = Request("a", [1, 2, 3, 4, 5, 6], params, eos_token_ids=(2,), max_tokens=8)
    assert not kv.fits_in_blocks(r, 6)                 # no blocks yet: allocate_slots must take them
    assert kv.allocate_slots(r, 6) == [0, 1]
    assert kv._num_cached["a"] == 1                    # block 0 is full
    r.num_computed_tokens = 6
    r.append_output_token_ids([7, 8])                  # 8 tokens: block 1 is full now
    assert kv.fits_in_blocks(r, 1)                     # the 7th token's slot is in block 1
    assert kv.fits_in_blocks(r, 2)
    assert kv._num_cached["a"] == 2                    # and block 1 went into the prefix cache
    assert not kv.fits_in_blocks(r, 3)                 # a 9th slot needs block 2
    assert kv.block_pool.num_free_blocks == 6          # nothing taken by a lookup
