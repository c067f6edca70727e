"""Every scheduling feature leaves greedy output unchanged (STYLE.md 8)."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams

FEATURE_KWARGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=2": dict(max_num_seqs=2),
    "small_chunk": dict(max_num_batched_tokens=5, max_num_seqs=4),
    "block_size=1": dict(block_size=1),
    "block_size=32": dict(block_size=32),
    "force_preempt": dict(block_size=4, num_gpu_blocks_override=20, max_model_len=64),
}


@pytest.fixture(scope="module")
def base_outputs(tiny_qwen2, example_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM(tiny_qwen2).generate(example_prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("feature", list(FEATURE_KWARGS))
def test_feature_does_not_change_greedy_output(tiny_qwen2, example_prompts, base_outputs, feature):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(tiny_qwen2, **FEATURE_KWARGS[feature])
    other = [o.outputs[0].token_ids for o in llm.generate(example_prompts, params, use_tqdm=False)]
    assert other == base_outputs
    if feature == "force_preempt":
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_seeded_sampling_survives_preemption(tiny_qwen2, example_prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=i)
              for i in range(len(example_prompts))]
    base = [o.outputs[0].token_ids for o in LLM(tiny_qwen2).generate(example_prompts, params, use_tqdm=False)]
    llm = LLM(tiny_qwen2, **FEATURE_KWARGS["force_preempt"])
    other = [o.outputs[0].token_ids for o in llm.generate(example_prompts, params, use_tqdm=False)]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert other == base
