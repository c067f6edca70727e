"""The runner's fast paths give exactly what the general ones give, at every step (STYLE.md 8): input ids come
from one gather over the runner's own per-row token ids (a step of one token per request skips the per-token
repeats), and the plain-greedy check reads a per-row array. Checked with prefill, chunked prefill, preemption,
prefix hits and async-scheduling placeholders in the mix, against a per-token recomputation of input ids (from the
scheduler's requests, which the runner never sees), placeholders, positions and slot_mapping."""

from __future__ import annotations

import numpy as np
import pytest

from hayabusa import LLM, SamplingParams


def _reference_is_plain_greedy(reqs) -> bool:
    """The rule as the runner first wrote it: a loop over the requests' params. Outputs are counted before this
    step's sample, placeholders included (the scheduler has already added this step's own placeholder)."""
    for r in reqs:
        p = r.sampling_params
        num_output = r.num_output_tokens + r.num_output_placeholders - 1
        if not p.greedy or p.logprobs is not None or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 \
                or p.frequency_penalty != 0.0 or num_output < p.min_tokens:
            return False
    return True


def _reference_input_ids(reqs, computed, num_sched, qsl, prev_sampled_ids):
    """Per request: its tokens computed this step; the last one is a placeholder (0, read on the device from the
    previous step's samples) when its value is not back yet."""
    T = int(qsl[-1])
    ids = np.zeros(T, dtype=np.int64)
    ph_dst, ph_src = [], []
    for i, (r, c, n) in enumerate(zip(reqs, computed, num_sched)):
        toks = r.all_token_ids[c:c + n]
        start = int(qsl[i])
        ids[start:start + len(toks)] = toks
        if len(toks) < n:
            assert len(toks) == n - 1
            ph_dst.append(start + n - 1)
            ph_src.append(prev_sampled_ids.index(r.request_id))
    return ids, np.array(ph_dst, dtype=np.int64), np.array(ph_src, dtype=np.int64)


def _check_step(engine, out, inp, seen) -> None:
    runner, kv = engine.runner, engine.kv_cache_manager
    bs = runner.block_size
    rids = out.scheduled_req_ids
    reqs = [engine.scheduler.requests[rid] for rid in rids]
    num_sched = [out.num_scheduled_tokens[rid] for rid in rids]
    computed = [out.num_computed_tokens[rid] for rid in rids]
    assert inp.req_ids == rids
    assert inp.num_scheduled.tolist() == num_sched
    assert inp.rows.tolist() == [runner.batch.row_of[rid] for rid in rids]
    qsl = np.concatenate([[0], np.cumsum(num_sched)]).astype(np.int32)
    assert inp.query_start_loc.tolist() == qsl.tolist()
    ids, ph_dst, ph_src = _reference_input_ids(reqs, computed, num_sched, qsl, seen["prev_sampled_ids"])
    assert inp.input_ids.tolist() == ids.tolist()
    assert inp.placeholder_dst.tolist() == ph_dst.tolist() and inp.placeholder_src.tolist() == ph_src.tolist()
    positions, slots = [], []
    for rid, c, n in zip(rids, computed, num_sched):
        blocks = kv.get_block_ids(rid)
        for p in range(c, c + n):
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
    assert inp.positions.tolist() == positions and inp.slot_mapping.tolist() == slots
    assert inp.seq_lens.tolist() == [c + n for c, n in zip(computed, num_sched)]
    sampled = [i for i, rid in enumerate(rids) if rid in out.sampling_req_ids]
    assert inp.logits_rows.tolist() == sampled
    assert inp.logits_indices.tolist() == [int(qsl[i + 1]) - 1 for i in sampled]
    sampled_reqs = [reqs[i] for i in sampled]
    seen["prev_sampled_ids"] = [rids[i] for i in sampled]
    if sampled_reqs:
        rows = inp.rows[inp.logits_rows]
        num_output = inp.seq_lens[inp.logits_rows] - runner.batch.num_prompt_tokens[rows]
        plain = runner.batch.is_plain_greedy(rows, num_output)
        assert plain == _reference_is_plain_greedy(sampled_reqs)
        seen["plain" if plain else "sampler"] += 1
    if len(reqs) == out.total_num_scheduled_tokens:
        seen["decode"] += 1
        seen["decode_placeholders"] += len(ph_dst) > 0
        seen["max_placeholders"] = max(seen["max_placeholders"], len(ph_dst))
        seen["decode_known"] += len(ph_dst) < len(reqs)
        seen["one_token_prefill"] += any(c + 1 < r.num_tokens for r, c in zip(reqs, computed))
        seen["new_in_decode"] += len(out.scheduled_new_reqs) > 0
    seen["steps"] += 1


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_fast_step_inputs_equal_general_ones(stories_dir, async_scheduling):
    llm = LLM(stories_dir, skip_tokenizer_init=True, async_scheduling=async_scheduling, block_size=4,
              num_gpu_blocks_override=40, max_model_len=64, max_num_batched_tokens=6, max_num_seqs=6,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    runner = engine.runner
    prepare = runner.prepare_inputs
    seen = dict.fromkeys(["steps", "decode", "decode_placeholders", "decode_known", "one_token_prefill", "new_in_decode", "max_placeholders", "plain",
                          "sampler"], 0)
    seen["prev_sampled_ids"] = []

    def checked_prepare(out):
        inp = prepare(out)
        _check_step(engine, out, inp, seen)
        return inp

    runner.prepare_inputs = checked_prepare
    shared = [5, 9, 13, 17, 21, 25, 29, 33, 37]                  # two full blocks and one token: prefix hits
    prompts = [shared + [40 + i] * (i % 3) for i in range(6)] + [list(range(60, 73)), [7, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    params = [greedy] * 4 + [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, ignore_eos=True),
                             SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True),
                             SamplingParams(temperature=0.8, max_tokens=25, seed=3, ignore_eos=True), greedy]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.num_hit_tokens > 0
    assert seen["decode"] > 10 and seen["decode_known"] > 0 and seen["plain"] > 0 and seen["sampler"] > 0
    assert seen["one_token_prefill"] > 0 and seen["new_in_decode"] > 0, seen
    if async_scheduling:
        assert seen["decode_placeholders"] > 0 and seen["max_placeholders"] >= 4, seen


def test_decode_fast_path_gives_the_same_tokens(stories_dir):
    """End to end: the same greedy tokens with the decode shortcut turned off (the general per-token layout)."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 13, 17, 21, 25, 29][: 3 + i]} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, async_scheduling=True, block_size=4, num_gpu_blocks_override=16,
              max_model_len=48, max_num_seqs=4)
    fast = LLM(stories_dir, **kw)
    general = LLM(stories_dir, **kw)
    general.llm_engine.runner.decode_fast_path = False
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in general.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert fast.llm_engine.scheduler.num_preemptions > 0
