"""Speculation configured but turned off by batch size, on the device (issue #21, W1): every step replays the
plain decode CUDA graphs exactly as with speculation off (no verify graph runs), nothing speculative is called
(the spies of test_spec_disabled_path.py), greedy ids are unchanged; prints host launch µs per step of both."""

from __future__ import annotations

import pytest

from hayabusa import LLM
from tests.spec_decode.test_spec_disabled_path import MAX_TOKENS, NGRAM, PARAMS, PROMPTS, spy_speculative_path

pytestmark = pytest.mark.cuda

KW = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20, max_num_seqs=len(PROMPTS))


def _run(path, monkeypatch=None, **kwargs):
    llm = LLM(path, **KW, **kwargs)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)                       # warm-up (first replays, allocator)
    runner, stats = llm.llm_engine.runner.decode_runner, llm.llm_engine.stats
    before = (runner.num_runs, runner.num_replays, runner.num_verify_runs, stats["num_steps"], stats["launch_s"])
    spied = spy_speculative_path(monkeypatch, llm) if monkeypatch is not None else None
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    after = (runner.num_runs, runner.num_replays, runner.num_verify_runs, stats["num_steps"], stats["launch_s"])
    runs, replays, verify_runs, steps, launch_s = (a - b for a, b in zip(after, before))
    return ids, dict(runs=runs, replays=replays, verify_runs=verify_runs, steps=steps,
                     launch_us=1e6 * launch_s / steps), llm, spied


def test_disabled_by_batch_size_replays_the_plain_decode_graphs(tiny_llama, monkeypatch):
    off, c_off, llm_off, _ = _run(tiny_llama)
    on, c_on, llm_on, (spies, steps) = _run(tiny_llama, monkeypatch, speculative_config=NGRAM)
    print(f"host launch per step: speculation off {c_off['launch_us']:.1f} us, n-gram off by batch size "
          f"{c_on['launch_us']:.1f} us ({c_on['steps']} steps each)")
    assert on == off and all(len(ids) == MAX_TOKENS for ids in on)
    assert llm_on.llm_engine.async_scheduling
    # the prefill runs eagerly; each of the MAX_TOKENS - 1 decode steps replays the plain decode graph, as off
    assert c_off["runs"] == c_off["replays"] == MAX_TOKENS - 1
    assert (c_on["runs"], c_on["replays"], c_on["steps"]) == (c_off["runs"], c_off["replays"], c_off["steps"])
    assert c_on["verify_runs"] == 0
    assert spies.calls["propose"] == spies.calls["ngram_propose"] == spies.calls["plan_verify"] == 0
    assert steps[1:] == [(len(PROMPTS), len(PROMPTS), 0)] * (MAX_TOKENS - 1)
    s_on, s_off = llm_on.llm_engine.stats, llm_off.llm_engine.stats
    assert s_on["num_overlapped_steps"] == s_off["num_overlapped_steps"]
