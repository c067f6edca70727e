"""The runner's fast paths give exactly what the general ones give, at every step (STYLE.md 8): a step of one
token per request gathers its input ids without per-request slices (``_gather_decode_ids``), and the plain-greedy
check reads a per-row array. Checked with prefill, chunked prefill, preemption, prefix hits and async-scheduling
placeholders in the mix, against the general gather and a per-token recomputation of positions / slot_mapping."""

from __future__ import annotations

import numpy as np
import pytest

from hayabusa import LLM, SamplingParams


def _reference_is_plain_greedy(reqs) -> bool:
    """The rule as the runner first wrote it: a loop over the requests' params."""
    for r in reqs:
        p = r.sampling_params
        if not p.greedy or p.logprobs is not None or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 \
                or p.frequency_penalty != 0.0 or r.num_output_tokens < p.min_tokens:
            return False
    return True


def _check_step(engine, out, inp, seen) -> None:
    runner, kv = engine.runner, engine.kv_cache_manager
    bs = runner.block_size
    reqs = out.scheduled_reqs
    rids = [r.request_id for r in reqs]
    num_sched = [out.num_scheduled_tokens[rid] for rid in rids]
    computed = [out.num_computed_tokens[rid] for rid in rids]
    assert inp.req_ids == rids
    assert inp.num_scheduled.tolist() == num_sched
    assert inp.rows.tolist() == [runner.batch.row_of[rid] for rid in rids]
    qsl = np.concatenate([[0], np.cumsum(num_sched)]).astype(np.int32)
    assert inp.query_start_loc.tolist() == qsl.tolist()
    ids, ph_dst, ph_src = runner._gather_input_ids(reqs, computed, num_sched, qsl, int(qsl[-1]))
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
    if sampled_reqs:
        plain = runner._is_plain_greedy(sampled_reqs, inp.rows[inp.logits_rows])
        assert plain == _reference_is_plain_greedy(sampled_reqs)
        seen["plain" if plain else "sampler"] += 1
    if len(reqs) == out.total_num_scheduled_tokens:
        seen["decode"] += 1
        seen["decode_placeholders"] += len(ph_dst) > 0
        seen["max_placeholders"] = max(seen["max_placeholders"], len(ph_dst))
        seen["decode_known"] += len(ph_dst) < len(reqs)
        seen["one_token_prefill"] += any(c + 1 < r.num_tokens for r, c in zip(reqs, computed))
        seen["new_in_decode"] += any(rid in out.scheduled_new_reqs for rid in rids)
    seen["steps"] += 1


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_fast_step_inputs_equal_general_ones(stories_dir, async_scheduling):
    llm = LLM(stories_dir, skip_tokenizer_init=True, async_scheduling=async_scheduling, block_size=4,
              num_gpu_blocks_override=40, max_model_len=64, max_num_batched_tokens=6, max_num_seqs=6,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    runner = engine.runner
    prepare = runner._prepare_inputs
    seen = dict.fromkeys(["steps", "decode", "decode_placeholders", "decode_known", "one_token_prefill", "new_in_decode", "max_placeholders", "plain",
                          "sampler"], 0)

    def checked_prepare(out):
        inp = prepare(out)
        _check_step(engine, out, inp, seen)
        return inp

    runner._prepare_inputs = checked_prepare
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
    """End to end: the same greedy tokens with the decode gather replaced by the general one."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 13, 17, 21, 25, 29][: 3 + i]} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, async_scheduling=True, block_size=4, num_gpu_blocks_override=16,
              max_model_len=48, max_num_seqs=4)
    fast = LLM(stories_dir, **kw)
    general = LLM(stories_dir, **kw)
    runner = general.llm_engine.runner

    def general_gather(reqs, rids, num_computed):
        R = len(reqs)
        return runner._gather_input_ids(reqs, num_computed.tolist(), [1] * R, np.arange(R + 1), R)

    runner._gather_decode_ids = general_gather
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in general.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert fast.llm_engine.scheduler.num_preemptions > 0
