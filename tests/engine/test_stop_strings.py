"""Stop strings through the whole engine: English and Japanese, starting mid-token, include_stop_str_in_output."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams


def _mid_token_stop(tok, prompt_ids, gen_ids, width):
    """A stop string of `width` chars from the greedy text that starts strictly inside a token."""
    full = tok.decode(prompt_ids + gen_ids)
    base = len(tok.decode(prompt_ids))
    text = full[base:]
    bounds = {len(tok.decode(prompt_ids + gen_ids[:j])) - base for j in range(len(gen_ids) + 1)}
    for i in range(1, len(text) - width):
        piece = text[i:i + width]
        if i not in bounds and piece.strip() and "\ufffd" not in piece and text.find(piece) == i:
            return text, i, piece
    pytest.skip("no mid-token position found")


@pytest.mark.parametrize("model,prompt", [("stories_dir", "Once upon a time"),
                                          ("tiny_llama", "吾輩は猫である。名前はまだ無い。")])
def test_stop_string_starting_mid_token(model, prompt, request):
    llm = LLM(request.getfixturevalue(model))
    tok = llm.get_tokenizer()
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    gen = free.outputs[0].token_ids
    text, i, stop = _mid_token_stop(tok, free.prompt_token_ids, gen, 3)
    assert free.outputs[0].text == text
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:i]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(gen) and out.token_ids == gen[:len(out.token_ids)]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:i + len(stop)]


def test_stop_string_in_a_batch_leaves_others_alone(stories_dir):
    llm = LLM(stories_dir)
    prompts = ["Once upon a time", "One day, Tom went to the", "The cat sat on the mat. The dog"]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=40, stop="."),
              SamplingParams(temperature=0, max_tokens=40)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == free[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == free[2].outputs[0].token_ids
    assert outs[1].outputs[0].text == free[1].outputs[0].text.split(".")[0]
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks
