"""A generate() that fails mid-step or is interrupted (Ctrl-C) leaves the LLM usable: the requests in flight are
aborted, their blocks freed, and the next generate() gives the same tokens as a fresh engine. Bad logprobs are
refused before anything runs."""

from __future__ import annotations

import pytest

from hayabusa import LLM, HayabusaValidationError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7, 8, 9, 10]} for i in range(6)]


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_llm_serves_again_after_a_failed_step(tiny_llama, error, async_scheduling):
    ref = [o.outputs[0].token_ids for o in LLM(tiny_llama).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(tiny_llama, async_scheduling=async_scheduling)
    runner = llm.llm_engine.runner
    launch, calls = runner.launch, {"n": 0}

    def failing_launch(out):
        calls["n"] += 1
        if calls["n"] == 4:            # mid-decode, with a step in flight when scheduling is async
            raise error("interrupted")
        return launch(out)

    runner.launch = failing_launch
    with pytest.raises(error):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    runner.launch = launch
    kv = llm.llm_engine.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == ref


def test_logprobs_above_max_logprobs_are_refused(tiny_llama):
    llm = LLM(tiny_llama)
    with pytest.raises(HayabusaValidationError, match="max_logprobs=20") as e:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=600), use_tqdm=False)
    assert e.value.parameter == "logprobs"
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) >= 20
    wide = LLM(tiny_llama, max_logprobs=50).generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=50),
                                                     use_tqdm=False)[0].outputs[0]
    assert len(wide.logprobs[0]) >= 50
    with pytest.raises(HayabusaValidationError, match="max_logprobs"):
        LLM(tiny_llama, max_logprobs=-1)
