"""Async scheduling (step N+1 scheduled and launched before step N's tokens are back) gives the same tokens
as synchronous steps: greedy, seeded sampling, stop strings, max_tokens, preemption, prefix caching, n > 1."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams


def _params(stop_word: str | None = None):
    return [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, max_tokens=17, seed=5),
            SamplingParams(temperature=0.0, max_tokens=1),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=25, seed=11, n=2),
            SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_word] if stop_word else None),
            SamplingParams(temperature=0.0, max_tokens=9, logprobs=2)]


def _run(model_dir, prompts, params, **kw):
    llm = LLM(model_dir, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], engine


@pytest.mark.parametrize("extra", [{}, {"block_size": 4, "num_gpu_blocks_override": 12, "max_model_len": 48,
                                        "max_num_batched_tokens": 24, "max_num_seqs": 8}], ids=["roomy", "preempt_and_chunk"])
def test_async_equals_sync(stories_dir, extra):
    prompts = ["Once upon a time", "Lily and her mom", "The cat sat on the mat.", "One day, Tom", "She saw a",
               "The sun was"]
    params = _params(stop_word=".")
    sync, _ = _run(stories_dir, prompts, params, async_scheduling=False, **extra)
    async_, engine = _run(stories_dir, prompts, params, async_scheduling=True, **extra)
    assert async_ == sync
    assert engine.async_scheduling
    if extra:
        assert engine.scheduler.num_preemptions > 0
    assert sync[4][0][2] == "stop" and sync[2][0][2] == "length" and len(sync[2][0][0]) == 1


def test_requests_needing_history_run_synchronously(stories_dir):
    """Penalties and min_tokens read the request's token history. The engine used to fall back to synchronous
    steps for them (and counted such requests); the runner now keeps the history itself, including the tokens
    still on the device, so they overlap like any request and must give the same tokens."""
    prompts = ["Once upon a time", "The dog"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop_token_ids=[13])]
    sync, _ = _run(stories_dir, prompts, params, async_scheduling=False)
    async_, engine = _run(stories_dir, prompts, params, async_scheduling=True)
    assert async_ == sync
    assert engine.async_scheduling and not engine.has_unfinished_requests()


def test_abort_while_a_step_is_in_flight(stories_dir):
    llm = LLM(stories_dir, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", "The dog", SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    engine.step()
    assert engine._pending is not None
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert finished["b"].outputs[0].finish_reason == "length" and len(finished["b"].outputs[0].token_ids) == 5
    assert "a" not in finished
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_rows_of_requests_that_finish_in_an_empty_step_are_released(stories_dir):
    """Every running request waits on a placeholder that ends it, so the step after is empty (not launched); the
    ids that finished meanwhile must still reach the runner, else their rows leak and a full batch of new
    requests finds no free row (found on the device by profile_decode.py at batch 256: IndexError in add)."""
    B = 4
    llm = LLM(stories_dir, skip_tokenizer_init=True, async_scheduling=True, max_num_seqs=B, max_model_len=128,
              max_num_batched_tokens=96)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 400 + 10 for j in range(40)]} for i in range(B)]
    engine = llm.llm_engine
    for max_tokens in (8, 1, 1, 8, 1):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                    detokenize=False), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [max_tokens] * B
        # the runner may still hold the rows of the last step's requests until the next step tells it
        assert len(engine.runner.batch.row_of) <= B
    engine.add_request("last", {"prompt_token_ids": [11, 12, 13]}, SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.runner.batch.row_of) <= 1
