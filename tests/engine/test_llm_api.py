"""LLM API behaviour on CPU: input forms, order, n > 1, seeded sampling, bad inputs, engine survival."""

from __future__ import annotations

import pytest

from hayabusa import LLM, HayabusaValidationError, SamplingParams


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(stories_dir, max_num_seqs=8)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ids = tok("One day, Tom").input_ids
    a = llm.generate("One day, Tom", params, use_tqdm=False)
    b = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    c = llm.generate([{"prompt": "Lily"}, "One day, Tom", {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == c[1].outputs[0].token_ids
    assert c[2].outputs[0].token_ids == a[0].outputs[0].token_ids
    assert c[0].prompt == "Lily" and c[2].prompt is None
    assert [o.finished for o in c] == [True] * 3
    assert a[0].outputs[0].finish_reason in ("length", "stop")


def test_one_params_per_prompt(llm):
    outs = llm.generate(["Once", "Once"], [SamplingParams(temperature=0, max_tokens=3),
                                           SamplingParams(temperature=0, max_tokens=7)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids


def test_max_tokens_one(llm):
    out = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_n3_gives_three_distinct_seeded_samples(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7)
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs


def test_seeded_request_same_alone_and_in_a_batch(llm):
    target = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=1234)
    alone = llm.generate("Lily and her mom", target, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=t, top_k=k, max_tokens=10 + i, seed=i if i % 2 else None)
              for i, (t, k) in enumerate([(1.0, 0), (0.5, 5), (0.0, 0), (1.3, 0), (0.8, 20), (1.0, 2), (0.7, 0)])]
    prompts = ["Once upon a time", "The dog", "Tom went", "She saw", "A big", "The sun", "One day"]
    batch = llm.generate(prompts[:4] + ["Lily and her mom"] + prompts[4:],
                         others[:4] + [target] + others[4:], use_tqdm=False)
    assert batch[4].outputs[0].token_ids == alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    topk1 = llm.generate("The cat", SamplingParams(temperature=1.0, top_k=1, max_tokens=16), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[2]
    first = base.index(stop_id)
    stopped = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == base[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    # min_tokens masks stop ids (and EOS) until min_tokens outputs exist: the sequence must avoid stop_id early.
    held = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                           stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) == 12 and stop_id not in held.token_ids[:11]
    assert held.finish_reason in ("length", "stop")


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-5), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(logprobs=-1), "logprobs"),
    (dict(seed=2 ** 64), "seed"), (dict(seed=-2 ** 63 - 1), "seed"),  # beyond torch.Generator: once killed a step
])
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(HayabusaValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == param
    assert param in str(e.value)
    assert isinstance(e.value, ValueError)


def test_extreme_seeds_sample_beside_other_requests(llm):
    """The ends of the seed range run (an out-of-range seed once failed the whole step, taking its batch with it)."""
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s) for s in (2 ** 64 - 1, -2 ** 63, 7)]
    outs = llm.generate(["Once upon a time"] * 3, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    again = llm.generate("Once upon a time", params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert again == outs[0].outputs[0].token_ids


def test_unknown_engine_argument_is_named(stories_dir):
    with pytest.raises(HayabusaValidationError, match="max_num_seq") as e:
        LLM(stories_dir, max_num_seq=4)
    assert e.value.parameter == "max_num_seq"


def test_bad_prompts_are_rejected_and_engine_still_serves(llm):
    vocab = llm.llm_engine.config.model_config.vocab_size
    max_len = llm.llm_engine.config.model_config.max_model_len
    cases = [({"prompt_token_ids": [1, vocab]}, "prompt_token_ids"),
             ({"prompt_token_ids": [5] * (max_len + 1)}, "prompt"),
             ({"prompt_token_ids": []}, "prompt"), (42, "prompt")]
    for prompt, param in cases:
        with pytest.raises(HayabusaValidationError) as e:
            llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
        assert e.value.parameter == param
    # a batch with one bad prompt is rejected whole, nothing is left queued
    with pytest.raises(HayabusaValidationError):
        llm.generate(["Once", {"prompt_token_ids": [vocab + 5]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_out_of_vocab_error_names_the_id_the_vocab_and_the_prompt(llm):
    """vLLM says "Token id X is out of vocabulary"; we also say where: the batch index and the position."""
    vocab = llm.llm_engine.config.model_config.vocab_size
    batch = ["Once", {"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, vocab + 5, 7]}]
    with pytest.raises(HayabusaValidationError) as e:
        llm.generate(batch, SamplingParams(max_tokens=4), use_tqdm=False)
    assert str(e.value) == (f"prompts[2]: token id {vocab + 5} at position 1 of prompt_token_ids is out of "
                            f"vocabulary (vocab_size={vocab}: ids are 0 to {vocab - 1}).")
    assert e.value.parameter == "prompt_token_ids" and e.value.value == vocab + 5
    with pytest.raises(HayabusaValidationError) as e:   # one prompt: no index to give
        llm.generate([-1], SamplingParams(max_tokens=4), use_tqdm=False)
    assert str(e.value).startswith("token id -1 at position 0 of prompt_token_ids is out of vocabulary")
    assert not llm.llm_engine.has_unfinished_requests()


def test_kv_cache_too_small_says_which_knob(stories_dir):
    from hayabusa.errors import KVCacheCapacityError

    with pytest.raises(KVCacheCapacityError, match="max_model_len") as info:
        LLM(stories_dir, num_gpu_blocks_override=2, block_size=16)
    # the advice names the setting that sized the cache, not one that cannot help (gpu_memory_utilization)
    assert "raise num_gpu_blocks_override" in str(info.value)
    assert "gpu_memory_utilization" not in str(info.value)
    with pytest.raises(KVCacheCapacityError, match="raise kv_cache_memory_bytes"):
        LLM(stories_dir, kv_cache_memory_bytes=1024, block_size=16)


def test_pickle_checkpoints_refused_by_default(tmp_path, stories_dir):
    import shutil

    import torch
    from safetensors.torch import load_file

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{stories_dir}/{f}", tmp_path / f)
    torch.save(load_file(f"{stories_dir}/model.safetensors"), tmp_path / "pytorch_model.bin")
    with pytest.raises(HayabusaValidationError, match="load_format='pt'"):
        LLM(str(tmp_path))
    llm = LLM(str(tmp_path), load_format="pt")
    assert llm.generate("Once", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_missing_weight_fails_loudly(tmp_path, stories_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{stories_dir}/{f}", tmp_path / f)
    state = load_file(f"{stories_dir}/model.safetensors")
    state.pop("model.layers.0.self_attn.k_proj.weight")
    state["model.layers.0.extra.weight"] = state["model.norm.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HayabusaValidationError) as e:
        LLM(str(tmp_path))
    assert "model.layers.0.extra.weight" in str(e.value) and "qkv_proj.weight#k" in str(e.value)


def test_unsupported_architecture_lists_supported(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FancyForCausalLM"], "model_type": "gpt2"}))
    with pytest.raises(HayabusaValidationError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        LLM(str(tmp_path))


def test_streamed_text_equals_final_text(llm):
    """LLM.generate detokenizes once at the end; the step-by-step (streaming) path must give the same text."""
    prompts = ["Once upon a time", "Lily and her mom", "The cat"]
    params = SamplingParams(temperature=0.8, max_tokens=30, seed=3)
    final = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    streamed = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] = out
    for i, f in enumerate(final):
        s = streamed[f"s{i}"]
        assert s.finished and s.outputs[0].token_ids == f.outputs[0].token_ids
        assert s.outputs[0].text == f.outputs[0].text


def test_logprob_tokens_join_to_the_text(llm):
    """A logprob's token keeps its leading space: SentencePiece's decode drops it from a lone piece ("\u2581there"
    -> "there"), so it is put back from the raw piece (as current vLLM does); the tokens then join to the text."""
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    tokens = [lp[t].decoded_token for t, lp in zip(out.token_ids, out.logprobs)]
    assert "".join(tokens) == out.text
    assert sum(t.startswith(" ") for t in tokens) >= 3      # words after the first carry their space
