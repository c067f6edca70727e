"""`hayabusa serve` with a T5 model: /v1/completions through the real openai client (plain and streaming) gives
the engine's greedy output for the encoder input; a too-long encoder input is a 400 and the next request is
served."""

from __future__ import annotations

import openai
import pytest

from hayabusa import LLM, SamplingParams
from tests.entrypoints.conftest import Served, wait_idle
from tests.models._t5 import T5_EN_PROMPTS, T5_JA_PROMPTS, save_tiny_t5


@pytest.fixture(scope="module")
def t5_model(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5_server"), "v1.1")


@pytest.fixture(scope="module")
def t5_server(t5_model):
    s = Served(t5_model, "tiny-t5", max_model_len=64, max_num_seqs=4)
    yield s
    s.close()


def test_completions_plain_and_streaming(t5_model, t5_server):
    prompts = [T5_EN_PROMPTS[0], T5_JA_PROMPTS[1]]
    ref = LLM(t5_model, max_model_len=64).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    client = t5_server.client()
    for prompt, want in zip(prompts, ref):
        r = client.completions.create(model="tiny-t5", prompt=prompt, max_tokens=10, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.outputs[0].text and r.usage.completion_tokens == 10
        assert r.usage.prompt_tokens == len(want.encoder_prompt_token_ids) > 1   # the encoder input's tokens
        chunks = client.completions.create(model="tiny-t5", prompt=prompt, max_tokens=10, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    # the decoder (one start token + the completion) fills max_model_len; the encoder input does not count
    r = client.completions.create(model="tiny-t5", prompt=T5_EN_PROMPTS[1], temperature=0.0, max_tokens=63,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 63 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-t5", prompt=T5_EN_PROMPTS[1], max_tokens=64)
    wait_idle(t5_server.engine)


def test_too_long_encoder_input_is_a_400(t5_server):
    """The encoder limit is the model's (n_positions 512), not max_model_len (64: the decoder's)."""
    client = t5_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-t5", prompt=[5] * 513, max_tokens=4)
    assert "512 tokens" in str(e.value) and "513 tokens" in str(e.value)
    # the same message for token ids (bounded before parsing) as for text: the encoder's limit, not a "maximum
    # context length" that leaves "no room for the completion" (max_model_len is 64 here and bounds the decoder)
    text = "word " * 600
    for prompt in ([5] * 513, text, "w" * 10**5):   # ids; text; text too long to be worth tokenizing
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-t5", prompt=prompt, max_tokens=4)
        msg, body = str(e.value), e.value.body
        assert "encoder input limit is 512 tokens" in msg and "max_model_len=64 limits the decoder" in msg, msg
        assert "maximum context length" not in msg and "no room for the completion" not in msg, msg
        assert body["param"] == "prompt" and body["code"] == "context_length_exceeded"
    r = client.completions.create(model="tiny-t5", prompt=[5] * 512, max_tokens=4, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    wait_idle(t5_server.engine)


def test_echo_and_prompt_logprobs_are_refused_for_t5(t5_server):
    # the prompt is the encoder's input: it has no next-token logprobs to echo
    client = t5_server.client()
    for extra in ({"echo": True, "logprobs": 1}, {"extra_body": {"prompt_logprobs": 1}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-t5", prompt=T5_EN_PROMPTS[0], max_tokens=2, **extra)
        assert "encoder-decoder" in str(e.value)
    r = client.completions.create(model="tiny-t5", prompt=T5_EN_PROMPTS[0], max_tokens=2, temperature=0.0)
    assert r.usage.completion_tokens >= 1
    wait_idle(t5_server.engine)


@pytest.fixture(scope="module")
def t5_ids_server(t5_model):
    s = Served(t5_model, "tiny-t5-ids", max_model_len=64, max_num_seqs=4, skip_tokenizer_init=True)
    yield s
    s.close()


def test_return_token_ids_without_a_tokenizer_plain_and_streamed(t5_model, t5_ids_server):
    """--skip-tokenizer-init: "text" is empty, so vLLM's return_token_ids is how a client reads the answer: each
    choice's prompt_token_ids and token_ids (streamed: the new ids per chunk, the prompt's in the first)."""
    prompt = [37, 1782, 19, 3, 9, 248, 1]
    ref = LLM(t5_model, max_model_len=64, skip_tokenizer_init=True).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                       detokenize=False), use_tqdm=False)
    want = list(ref[0].outputs[0].token_ids)
    assert len(want) == 6
    c = t5_ids_server.client()
    kw = dict(model="tiny-t5-ids", prompt=prompt, temperature=0.0, max_tokens=6,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = c.completions.create(**kw)
    choice = r.choices[0].model_dump()
    assert choice["text"] == "" and choice["token_ids"] == want and choice["prompt_token_ids"] == prompt
    chunks = [ch.choices[0].model_dump() for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert [i for ch in chunks for i in ch["token_ids"]] == want
    assert chunks[0]["prompt_token_ids"] == prompt and all(ch["prompt_token_ids"] is None for ch in chunks[1:])
    # off (the default): neither field
    plain = c.completions.create(model="tiny-t5-ids", prompt=prompt, max_tokens=2).choices[0].model_dump()
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    wait_idle(t5_ids_server.engine)
