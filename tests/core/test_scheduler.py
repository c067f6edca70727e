"""Scheduler: continuous batching, chunked prefill, token budget, preemption by recompute (no model)."""

from hayabusa.config import SchedulerConfig
from hayabusa.core.kv_cache_manager import KVCacheManager
from hayabusa.core.request import Request, RequestStatus
from hayabusa.core.scheduler import Scheduler
from hayabusa.sampling_params import SamplingParams


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def req(rid, n_prompt, max_tokens=4, **kw):
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(rid, list(range(100, 100 + n_prompt)), params, eos_token_ids=(2,), max_tokens=max_tokens)


def step(s, token=7):
    out = s.schedule()
    # a request whose scheduled tokens complete its sequence samples one token (a placeholder until updated)
    sampled = {rid: [token] * s.requests[rid].num_output_placeholders for rid in out.scheduled_req_ids}
    s.update_from_output(out, sampled)
    return out


def test_prefill_then_decode_then_length_finish():
    s = make_scheduler()
    a = req("a", 6, max_tokens=3)
    s.add_request(a)
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 6} and {r.req_id for r in out.scheduled_new_reqs} == {"a"}
    assert out.new_block_ids == {"a": [0, 1]}
    assert a.output_token_ids == [7] and a.num_computed_tokens == 6
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1} and {r.req_id for r in out.scheduled_new_reqs} == set()
    out = step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [7, 7, 7]
    assert s.kv.num_free_blocks == 16
    out = s.schedule()  # an empty step is not launched: the finished id waits for the next step that runs
    assert out.is_empty and out.finished_req_ids == set()
    s.add_request(req("b", 2))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 2} and out.finished_req_ids == {"a"}


def test_token_budget_chunks_long_prompt_and_mixes_with_decode():
    s = make_scheduler(max_num_batched_tokens=8)
    a, b = req("a", 3), req("b", 20)
    s.add_request(a)
    s.add_request(b)
    out = step(s)                                  # a: 3 prompt tokens, b: first 5-token chunk
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}
    assert b.output_token_ids == [] and a.output_token_ids == [7]
    out = step(s)                                  # a decodes 1, b gets 7 more
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    out = step(s)                                  # b's last prompt token + sampled token
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert b.num_computed_tokens == 20 and b.output_token_ids == [7]


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    out = step(s)
    assert out.scheduled_req_ids == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preemption_by_recompute_frees_blocks_and_requeues_first():
    # 4 blocks of 2 tokens. a and b each take 2 blocks for 3-token prompts; decoding needs more.
    s = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=4)
    a, b = req("a", 3, max_tokens=8), req("b", 3, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step(s)                                       # both prefilled: 4 tokens each incl. sampled
    assert s.kv.num_free_blocks == 0
    out = step(s)                                 # a's 4th token fits block 1; b too -> no new blocks
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    out = step(s)                                 # a needs a 3rd block: b (last admitted) is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    assert "b" in out.preempted_req_ids             # the runner gives its row up (kept apart from finished ones)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.waiting[0] is b and b.output_token_ids == [7, 7]      # outputs kept, recomputed later
    assert s.kv.get_block_ids("a") == [0, 1, 3]


def test_stop_token_and_eos_and_min_tokens():
    s = make_scheduler()
    a = req("a", 2, max_tokens=10, stop_token_ids=[9])
    b = req("b", 2, max_tokens=10, min_tokens=2)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, {"a": [9], "b": [2]})   # b's EOS before min_tokens is not a stop
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 9
    assert b.status == RequestStatus.RUNNING
    out = s.schedule()
    s.update_from_output(out, {"b": [2]})
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason is None


def test_ignore_eos_and_max_model_len():
    s = make_scheduler(max_model_len=5)
    a = req("a", 3, max_tokens=10, ignore_eos=True)
    s.add_request(a)
    step(s, token=2)
    assert a.status == RequestStatus.RUNNING           # EOS ignored
    step(s, token=2)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_tokens == 5


def test_abort_waiting_and_running():
    s = make_scheduler(max_num_seqs=1)
    a, b = req("a", 2), req("b", 2)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 16


def test_async_scheduling_runs_one_step_ahead_with_placeholders():
    """The next step is scheduled before this step's token is back: decode rows carry a placeholder token."""
    s = make_scheduler()
    a = req("a", 3, max_tokens=3)
    s.add_request(a)
    out0 = s.schedule()                                  # prefill, samples token 1
    assert out0.num_scheduled_tokens == {"a": 3} and a.num_output_placeholders == 1
    out1 = s.schedule()                                  # decode of token 1 (value still on the device)
    assert out1.num_scheduled_tokens == {"a": 1} and out1.num_computed_tokens == {"a": 3}
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 4
    s.update_from_output(out0, {"a": [11]})
    assert a.output_token_ids == [11] and a.num_output_placeholders == 1
    out2 = s.schedule()                                  # token 3 would be the last allowed
    assert out2.num_scheduled_tokens == {"a": 1}
    out3 = s.schedule()                                  # 1 known + 2 pending = max_tokens: nothing more
    assert out3.is_empty
    s.update_from_output(out1, {"a": [12]})
    s.update_from_output(out2, {"a": [13]})
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [11, 12, 13]
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests()


def test_token_of_a_request_stopped_in_between_is_dropped():
    s = make_scheduler()
    a = req("a", 3, max_tokens=10)
    s.add_request(a)
    out0 = s.schedule()
    out1 = s.schedule()
    s.update_from_output(out0, {"a": [2]})               # EOS
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert s.update_from_output(out1, {"a": [5]}) == []
    assert a.output_token_ids == [2]


def test_pipeline_depth_schedules_disjoint_sampling_requests():
    """pipeline_depth 2 (two pipeline stages): a request whose sampled token is still in flight waits for it, so
    the next step in flight takes other requests; a prompt chunk (nothing sampled) may follow in the next step."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, pipeline_depth=2)
    s = Scheduler(cfg, KVCacheManager(16, 4))
    a, b = req("a", 3), req("b", 9)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()                           # a's whole prompt (samples), b's first 5-token chunk
    assert first.num_scheduled_tokens == {"a": 3, "b": 5} and a.num_output_placeholders == 1
    second = s.schedule()                          # in flight with the first: a waits, b's chunk goes on
    assert second.num_scheduled_tokens == {"b": 4} and b.num_output_placeholders == 1
    assert s.schedule().is_empty                   # both wait for their tokens
    s.update_from_output(first, {"a": [7], "b": []})
    third = s.schedule()                           # a is back; b still waits
    assert third.num_scheduled_tokens == {"a": 1}
    s.update_from_output(second, {"b": [8]})
    assert s.schedule().num_scheduled_tokens == {"b": 1}
