"""Prefix caching through the engine: greedy output identical with it on and off (shared prefixes, after
eviction, under preemption), n > 1 shares the prompt's blocks, statistics and reset."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _shared_prefix_prompts(tok):
    system = "You are a careful assistant. Answer in one short sentence. 吾輩は猫である。名前はまだ無い。" * 2
    questions = ["What is the capital of France?", "東京の人口は？", "Name a prime number.", "What is 2 + 2?",
                 "Who wrote Botchan?", "今日の天気は？"]
    ids = [tok(system + q).input_ids for q in questions]
    return ids + ids[:2]  # two exact repeats: whole-prompt hits


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("extra", [{}, {"block_size": 4, "num_gpu_blocks_override": 40, "max_model_len": 128}],
                         ids=["roomy", "evict_and_preempt"])
def test_prefix_caching_does_not_change_greedy_output(arch, extra, request):
    model_dir = request.getfixturevalue(arch)
    off = LLM(model_dir, enable_prefix_caching=False, **extra)
    prompts = [{"prompt_token_ids": p} for p in _shared_prefix_prompts(off.get_tokenizer())]
    want = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    on = LLM(model_dir, enable_prefix_caching=True, **extra)
    kv = on.llm_engine.kv_cache_manager
    first = [o.outputs[0].token_ids for o in on.generate(prompts, GREEDY, use_tqdm=False)]
    assert first == want
    assert kv.num_hit_tokens > 0
    again = [o.outputs[0].token_ids for o in on.generate(prompts[::-1], GREEDY, use_tqdm=False)][::-1]
    assert again == want                                   # served from blocks cached by the first call
    if extra:
        assert kv.block_pool.num_evictions > 0
        # preemption with caching: requests recompute from their own cached blocks
        small = LLM(model_dir, enable_prefix_caching=True, block_size=4, num_gpu_blocks_override=32,
                    max_model_len=128, max_num_seqs=8)
        out = [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY, use_tqdm=False)]
        assert small.llm_engine.scheduler.num_preemptions > 0
        assert out == want
    assert kv.num_free_blocks == on.llm_engine.num_blocks


def test_n_samples_share_the_prompt_blocks(tiny_qwen2):
    llm = LLM(tiny_qwen2, block_size=4)
    tok = llm.get_tokenizer()
    prompt = tok("Self-consistency: sample many answers to one long math problem. " * 3).input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=6, temperature=1.0, max_tokens=8, seed=0),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 6
    kv = llm.llm_engine.kv_cache_manager
    full = (len(prompt) - 1) // 4 * 4
    # the first sample computes the prompt; the other five reuse every full block of it
    assert kv.num_hit_tokens == 5 * full
    assert kv.num_query_tokens == 6 * len(prompt)


def test_reset_prefix_cache(tiny_qwen2):
    llm = LLM(tiny_qwen2)
    p = {"prompt_token_ids": list(range(1000, 1040))}
    llm.generate(p, GREEDY, use_tqdm=False)
    kv = llm.llm_engine.kv_cache_manager
    llm.generate(p, GREEDY, use_tqdm=False)
    assert kv.num_hit_tokens == 32
    assert llm.reset_prefix_cache() is True
    llm.generate(p, GREEDY, use_tqdm=False)
    assert kv.num_hit_tokens == 32                          # nothing hit after the reset
