"""Bad input fails at the edge, by name (issue #14 items 7 and 9): wrong types, non-finite numbers, lone
surrogates, unknown keywords, and a prompt with no room for one output token are a HayabusaValidationError naming
the parameter -- on LLM.generate / LLM.chat and AsyncLLMEngine alike -- and the engine serves the next request.
CPU, stories260K."""

from __future__ import annotations

import asyncio
import math

import pytest

from hayabusa import LLM, AsyncEngineArgs, AsyncLLMEngine, HayabusaValidationError, SamplingParams
from hayabusa.engine.input_processor import check_prompt_length
from hayabusa.errors import HayabusaTypeError
from hayabusa.sampling_params import MAX_N

MAX_LEN = 64
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
OK = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(stories_dir, max_model_len=MAX_LEN, max_num_seqs=4)


@pytest.fixture(scope="module")
def aengine(stories_dir):
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=stories_dir, disable_log_requests=True,
                                                          max_model_len=MAX_LEN, max_num_seqs=4))
    yield eng
    eng.shutdown()


def serves(llm) -> None:
    out = llm.generate("Once upon a time", OK, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and not llm.llm_engine.has_unfinished_requests()


# -- SamplingParams --------------------------------------------------------------------------------------------

BAD_PARAMS = [
    # (keyword arguments, parameter named, also a TypeError)
    (dict(skip_special_tokens=0), "skip_special_tokens", True),
    (dict(ignore_eos="false"), "ignore_eos", True),          # a non-empty str would count as True
    (dict(detokenize=None), "detokenize", True),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output", True),
    (dict(spaces_between_special_tokens="yes"), "spaces_between_special_tokens", True),
    (dict(n=2.0), "n", True),
    (dict(n=True), "n", True),
    (dict(n=MAX_N + 1), "n", False),
    (dict(best_of=MAX_N + 1), "best_of", False),
    (dict(max_tokens=float("inf")), "max_tokens", True),
    (dict(max_tokens="16"), "max_tokens", True),
    (dict(min_tokens=1.5), "min_tokens", True),
    (dict(top_k=2.0), "top_k", True),
    (dict(logprobs=True), "logprobs", True),
    (dict(seed=1.0), "seed", True),
    (dict(truncate_prompt_tokens=math.nan), "truncate_prompt_tokens", True),
    (dict(temperature=float("inf")), "temperature", False),
    (dict(temperature=math.nan), "temperature", False),
    (dict(temperature=None), "temperature", True),
    (dict(temperature="0.5"), "temperature", True),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", False),
    (dict(presence_penalty=True), "presence_penalty", True),
    (dict(top_p=math.nan), "top_p", False),
    (dict(min_p=-math.inf), "min_p", False),
    (dict(stop="\ud800"), "stop", False),
    (dict(stop=["ok", "a\udfffb"]), "stop", False),
    (dict(stop=["ok", 5]), "stop", True),
    (dict(stop_token_ids=[1, 2.0]), "stop_token_ids", True),
    (dict(stop_token_ids=[True]), "stop_token_ids", True),
    (dict(bad_words="x"), "bad_words", True),
    (dict(extra_args=[1]), "extra_args", True),
    (dict(temprature=0.5), "temprature", True),             # unknown keyword
]


@pytest.mark.parametrize("kwargs, parameter, is_type_error", BAD_PARAMS, ids=[p for _, p, _ in BAD_PARAMS])
def test_sampling_params_types_and_ranges_are_named(kwargs, parameter, is_type_error):
    with pytest.raises(HayabusaValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == parameter and parameter in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError) == is_type_error
    assert isinstance(e.value, HayabusaTypeError) == is_type_error


def test_unknown_keyword_is_catchable_as_type_error_like_vllm():
    with pytest.raises(TypeError, match="'max_token'"):
        SamplingParams(max_token=5)


def test_good_values_of_other_numeric_types_are_kept_as_python_ints():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), temperature=np.float32(0.5), seed=np.uint64(7),
                        stop_token_ids=(np.int64(3),))
    assert (type(sp.n), type(sp.max_tokens), type(sp.seed), sp.stop_token_ids) == (int, int, int, [3])
    assert SamplingParams(n=MAX_N, best_of=MAX_N).n == MAX_N


# -- LLM.generate / LLM.chat -----------------------------------------------------------------------------------

def test_bad_prompts_are_named_and_the_engine_serves_on(llm):
    cases = [
        ("\ud800", "prompt"),
        ("Once upon a \udc80 time", "prompt"),
        ({"prompt": "ok \ud800", "prompt_token_ids": [1, 2]}, "prompt"),
        ({"prompt": 5, "prompt_token_ids": [1, 2]}, "prompt"),
        ({"prompt_token_ids": [1, float("inf")]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
        ({"prompt_token_ids": 7}, "prompt_token_ids"),
        ({"prompt_token_ids": "1 2"}, "prompt_token_ids"),
        ([1.5, 2], "prompt"),
        (None, "prompts"),
        (3.5, "prompt"),
    ]
    for prompt, parameter in cases:
        with pytest.raises(HayabusaValidationError) as e:
            llm.generate(prompt, OK, use_tqdm=False)
        assert e.value.parameter == parameter, (prompt, e.value)
        serves(llm)


def test_bad_sampling_params_argument_is_named(llm):
    for sp in (5, "greedy", [OK, 5], {"temperature": 0}):
        with pytest.raises(HayabusaValidationError) as e:
            llm.generate(["Once", "Lily"], sp, use_tqdm=False)
        assert e.value.parameter == "sampling_params" and isinstance(e.value, TypeError)
    serves(llm)


def test_lora_request_is_refused_by_name(llm):
    with pytest.raises(HayabusaValidationError, match="lora_request") as e:
        llm.generate("Once", OK, use_tqdm=False, lora_request=object())
    assert e.value.parameter == "lora_request"
    with pytest.raises(HayabusaValidationError, match="lora_request") as e:
        llm.chat([{"role": "user", "content": "hi"}], OK, chat_template=TEMPLATE, lora_request="adapter")
    assert e.value.parameter == "lora_request"
    serves(llm)


def test_bad_chat_arguments_are_named(llm):
    msgs = [{"role": "user", "content": "Once upon a time"}]
    cases = [
        (dict(chat_template=0), "chat_template"),
        (dict(chat_template=b"{{ x }}"), "chat_template"),
        (dict(chat_template=TEMPLATE, chat_template_kwargs="enable_thinking"), "chat_template_kwargs"),
        (dict(chat_template=TEMPLATE, chat_template_kwargs=[("a", 1)]), "chat_template_kwargs"),
        (dict(chat_template=TEMPLATE, tools="search"), "tools"),
        (dict(chat_template=TEMPLATE, add_generation_prompt="no"), "add_generation_prompt"),
        (dict(chat_template=TEMPLATE, chat_template_content_format=1), "chat_template_content_format"),
    ]
    for kwargs, parameter in cases:
        with pytest.raises(HayabusaValidationError) as e:
            llm.chat(msgs, OK, **kwargs)
        assert e.value.parameter == parameter, (kwargs, e.value)
    for bad in ([{"role": "user", "content": "hi \ud800"}],
                [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]):
        with pytest.raises(HayabusaValidationError) as e:
            llm.chat(bad, OK, chat_template=TEMPLATE)
        assert e.value.parameter == "messages" and "messages[0]" in str(e.value)
    with pytest.raises(HayabusaValidationError) as e:   # a surrogate that reaches the text through the template
        llm.chat(msgs, OK, chat_template=TEMPLATE + "{{ extra }}", chat_template_kwargs={"extra": "\ud800"})
    assert e.value.parameter == "messages"
    assert llm.chat(msgs, OK, chat_template=TEMPLATE)[0].outputs[0].token_ids
    serves(llm)


# -- one length rule (item 9) ----------------------------------------------------------------------------------

def test_check_prompt_length_leaves_room_for_one_token():
    check_prompt_length(MAX_LEN - 1, MAX_LEN)
    for n in (MAX_LEN, MAX_LEN + 1):
        with pytest.raises(HayabusaValidationError, match=f"max_model_len={MAX_LEN}") as e:
            check_prompt_length(n, MAX_LEN)
        assert (e.value.parameter, e.value.value) == ("prompt", n)


def test_llm_prompt_length_rule(llm):
    for n in (MAX_LEN, MAX_LEN + 5):
        with pytest.raises(HayabusaValidationError, match="no room") as e:
            llm.generate({"prompt_token_ids": [5] * n}, OK, use_tqdm=False)
        assert (e.value.parameter, e.value.value) == ("prompt", n)
        serves(llm)
    # One token shorter is accepted and gets exactly the one token there is room for.
    out = llm.generate({"prompt_token_ids": [5] * (MAX_LEN - 1)},
                       SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    # truncate_prompt_tokens applies first: the rule sees the kept tokens.
    out = llm.generate({"prompt_token_ids": [5] * MAX_LEN}, SamplingParams(max_tokens=2, truncate_prompt_tokens=8),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 8


def test_async_engine_same_rules(aengine):
    async def first(prompt, params, rid):
        return [o async for o in aengine.generate(prompt, params, rid)][-1]

    async def main():
        for i, (prompt, params, parameter) in enumerate([
            ({"prompt_token_ids": [5] * MAX_LEN}, OK, "prompt"),
            ("\ud800", OK, "prompt"),
            ({"prompt_token_ids": [1, float("inf")]}, OK, "prompt_token_ids"),
        ]):
            with pytest.raises(HayabusaValidationError) as e:
                await first(prompt, params, f"bad-{i}")
            assert e.value.parameter == parameter
        with pytest.raises(HayabusaValidationError) as e:
            async for _ in aengine.generate("Once", OK, "lora", lora_request=object()):
                pass
        assert e.value.parameter == "lora_request"
        out = await first({"prompt_token_ids": [5] * (MAX_LEN - 1)}, SamplingParams(max_tokens=None), "edge")
        assert len(out.outputs[0].token_ids) == 1
        return await first("Once upon a time", OK, "ok")

    out = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 3


def test_a_wrong_type_in_a_batch_names_the_prompt_and_queues_nothing(llm):
    with pytest.raises(TypeError) as e:          # HayabusaTypeError: also a HayabusaValidationError
        llm.generate(["Once", {"prompt_token_ids": [1, 2.5]}], OK, use_tqdm=False)
    assert isinstance(e.value, HayabusaValidationError) and e.value.parameter == "prompt_token_ids"
    assert str(e.value).startswith("prompts[1]: ") and not llm.llm_engine.has_unfinished_requests()
    serves(llm)


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1e-30), dict(temperature=1e30),
                                    dict(temperature=1e-5, repetition_penalty=1e30), dict(top_k=10 ** 30),
                                    dict(seed=2 ** 64 - 1), dict(max_tokens=10 ** 20, ignore_eos=True)])
def test_extreme_but_valid_values_are_served(llm, kwargs):
    """Finite extremes are accepted and do not break a step (which would abort every request in flight)."""
    kwargs = {"max_tokens": 4, **kwargs}
    out = llm.generate("Once upon a time", SamplingParams(**kwargs), use_tqdm=False)[0]
    assert out.finished and 1 <= len(out.outputs[0].token_ids) <= MAX_LEN


def test_a_folder_without_tokenizer_files_is_named_not_an_empty_vocabulary(tiny_qwen2, tmp_path):
    # transformers 5 makes an empty (1-token) tokenizer from config.json alone; that must not pass for a tokenizer
    import shutil

    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_qwen2}/{name}", tmp_path / name)
    with pytest.raises(HayabusaValidationError, match="no tokenizer files") as e:
        LLM(str(tmp_path), max_model_len=128)
    assert e.value.parameter == "tokenizer"
    llm = LLM(str(tmp_path), max_model_len=128, skip_tokenizer_init=True)   # ids in, ids out still works
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_t5_folder_without_tokenizer_files_is_refused(tmp_path):
    # for model_type t5, transformers 5 makes a 104-token tokenizer (specials and sentinels only) from config.json
    # alone: every word became <unk> and the server answered with empty texts (a `bench --make-model` T5)
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    T5ForConditionalGeneration(cfg).save_pretrained(str(tmp_path), safe_serialization=True)
    with pytest.raises(HayabusaValidationError, match="no tokenizer files") as e:
        LLM(str(tmp_path), max_model_len=32)
    assert e.value.parameter == "tokenizer"
    llm = LLM(str(tmp_path), max_model_len=32, skip_tokenizer_init=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
