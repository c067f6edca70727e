"""Encoder-decoder requests in the scheduler (no model): cross-attention blocks from the same pool at admission,
sent as plain ids with the encoder input, the per-step encoder budget, preemption re-running the encoder, and
every block back in the pool at the end."""

import pickle

from hayabusa.config import SchedulerConfig
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request
from hayabusa.core.scheduler import Scheduler
from hayabusa.sampling_params import SamplingParams


def make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, max_model_len=32)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def t5_req(rid, n_encoder, max_tokens=4):
    r = Request(rid, [0], SamplingParams(max_tokens=max_tokens), eos_token_ids=(1,), max_tokens=max_tokens)
    r.encoder_prompt_token_ids = list(range(100, 100 + n_encoder))
    return r


def step(s, token=7):
    out = s.schedule()
    sampled = {rid: [token] * s.requests[rid].num_output_placeholders for rid in out.scheduled_req_ids}
    s.update_from_output(out, sampled)
    return out


def test_cross_blocks_are_taken_at_admission_and_sent_with_the_encoder_input():
    s = make_scheduler()
    a, b = t5_req("a", 9), t5_req("b", 3)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert new["a"].cross_block_ids == [0, 1, 2] and new["a"].block_ids == [3]     # 9 encoder tokens, 1 decoder
    assert new["b"].cross_block_ids == [4] and new["b"].block_ids == [5]
    assert new["a"].encoder_prompt_token_ids == list(range(100, 109))
    assert out.scheduled_encoder_prompt_req_ids == ["a", "b"] and out.scheduled_encoder_inputs == {}  # no images
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}                          # the decoder start token
    assert pickle.loads(pickle.dumps(out)).scheduled_new_reqs[0].cross_block_ids == [0, 1, 2]
    out = step(s)                                                                  # a decode step: no encoder
    assert out.scheduled_encoder_prompt_req_ids == [] and s.kv.num_free_blocks == 10
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 16 and not s.kv.req_to_cross_blocks


def test_encoder_budget_per_step():
    """Encoder tokens of one step stay within max_num_batched_tokens (the first encoder input always runs)."""
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=20)
    for rid in "abc":
        s.add_request(t5_req(rid, 12))
    assert step(s).scheduled_encoder_prompt_req_ids == ["a"]
    assert step(s).scheduled_encoder_prompt_req_ids == ["b"]


def test_no_room_for_the_cross_blocks_means_not_admitted():
    s = make_scheduler(num_blocks=4)
    s.add_request(t5_req("a", 12))           # 3 cross blocks + 1 decoder block: fits exactly
    s.add_request(t5_req("b", 1))
    out = step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"] and s.kv.num_free_blocks == 0


def test_preemption_frees_cross_blocks_and_resumes_with_new_ones():
    s = make_scheduler(num_blocks=8)
    a, b = t5_req("a", 8, max_tokens=12), t5_req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    step(s)                                   # a: cross [0, 1] + [2]; b: cross [3, 4] + [5]
    resumed = None
    for _ in range(12):
        out = step(s)
        if out.scheduled_cached_reqs.cross_block_ids:
            resumed = out
            break
    assert s.num_preemptions > 0 and resumed is not None
    (rid, blocks), = resumed.scheduled_cached_reqs.cross_block_ids.items()
    assert len(blocks) == 2 and resumed.scheduled_encoder_prompt_req_ids == [rid]
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 8 and a.output_token_ids == b.output_token_ids == [7] * 12
