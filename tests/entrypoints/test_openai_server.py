"""The OpenAI-compatible server through the official `openai` client (and raw httpx for what the client cannot
send): completions, chat, streaming = non-streaming text (Japanese included), usage, stop strings, n = 2,
logprobs, errors in OpenAI's shape with the parameter named (unsupported vLLM fields, max_tokens beyond the context
included), per-request chat templates, API keys, disconnects freeing KV blocks."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.conftest import JA_PROMPTS  # noqa: E402
from tests.entrypoints.conftest import API_KEY, QWEN_TEMPLATE, wait_idle  # noqa: E402

MSG_JA = [{"role": "system", "content": "あなたは親切なアシスタントです。"},
          {"role": "user", "content": "吾輩は猫である。名前は？"}]


def _stream_text(chunks, n: int = 1) -> tuple[list[str], list, object]:
    texts, finish, usage = [""] * n, [None] * n, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] += piece
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, finish, usage


# ------------------------------------------------------------------------------------------------ happy paths
def test_models_health_metrics(qwen_server):
    models = qwen_server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-qwen"]
    assert httpx.get(qwen_server.url + "/health").status_code == 200          # no key needed
    for path in ("/metrics", "/docs", "/openapi.json"):                        # these need it (--api-key set)
        r = httpx.get(qwen_server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(qwen_server.url + "/openapi.json", headers=qwen_server.headers()).status_code == 200
    text = httpx.get(qwen_server.url + "/metrics", headers=qwen_server.headers()).text
    for name in ("hayabusa:num_requests_running", "hayabusa:num_requests_waiting", "hayabusa:kv_cache_usage_perc",
                 "hayabusa:generation_tokens_total", "hayabusa:prompt_tokens_total"):
        assert name in text


@pytest.mark.parametrize("server,prompt", [("qwen_server", "The capital of France is"),
                                           ("qwen_server", JA_PROMPTS[0]),
                                           ("llama_server", JA_PROMPTS[1])])
def test_completion_stream_equals_non_stream(request, server, prompt):
    s = request.getfixturevalue(server)
    c = s.client()
    kw = dict(model=s.name, prompt=prompt, max_tokens=24, temperature=0.0)
    full = c.completions.create(**kw)
    texts, finish, usage = _stream_text(c.completions.create(**kw, stream=True,
                                                             stream_options={"include_usage": True}))
    assert texts == [full.choices[0].text] and finish == [full.choices[0].finish_reason]
    n_prompt = len(s.tokenizer(prompt).input_ids)
    assert full.usage.prompt_tokens == usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == usage.completion_tokens
    assert 1 <= full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    assert full.model == s.name and full.id.startswith("cmpl-")


@pytest.mark.parametrize("server", ["qwen_server", "llama_server"])
def test_chat_stream_equals_non_stream(request, server):
    s = request.getfixturevalue(server)   # llama_server: the chat template comes from --chat-template
    c = s.client()
    kw = dict(model=s.name, messages=MSG_JA, max_tokens=20, temperature=0.0)
    full = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, finish, usage = _stream_text(chunks)
    assert texts == [full.choices[0].message.content] and finish == [full.choices[0].finish_reason]
    assert full.choices[0].message.role == "assistant"
    template = None if server == "qwen_server" else QWEN_TEMPLATE.read_text()
    rendered = s.tokenizer.apply_chat_template(MSG_JA, tokenize=False, add_generation_prompt=True,
                                               chat_template=template)
    assert full.usage.prompt_tokens == len(s.tokenizer(rendered, add_special_tokens=False).input_ids)
    assert usage.completion_tokens == full.usage.completion_tokens and 1 <= usage.completion_tokens <= 20

def test_stop_strings(qwen_server):
    c = qwen_server.client()
    kw = dict(model=qwen_server.name, prompt="Once upon a time", max_tokens=24, temperature=0.0)
    text = c.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text.find(stop)
    r = c.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    streamed, _, _ = _stream_text(c.completions.create(**kw, stop=[stop], stream=True))
    assert streamed == [text[:cut]]
    inc = c.completions.create(**kw, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == text[:cut + len(stop)]


def test_n2_seeded_sampling_streams_alike(qwen_server):
    c = qwen_server.client()
    kw = dict(model=qwen_server.name, prompt=JA_PROMPTS[2], max_tokens=12, temperature=1.0, n=2, seed=7)
    full = c.completions.create(**kw)
    assert sorted(ch.index for ch in full.choices) == [0, 1]
    texts, _, usage = _stream_text(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}),
                                   n=2)
    by_index = {ch.index: ch.text for ch in full.choices}
    assert texts == [by_index[0], by_index[1]]
    assert usage.completion_tokens == full.usage.completion_tokens == 24   # 2 x max_tokens (random weights)
    chat_kw = dict(model=qwen_server.name, messages=MSG_JA, max_tokens=6, n=2, seed=3)
    chat = c.chat.completions.create(**chat_kw)
    texts, _, _ = _stream_text(c.chat.completions.create(**chat_kw, stream=True), n=2)
    assert texts == [ch.message.content for ch in sorted(chat.choices, key=lambda ch: ch.index)]


def test_several_prompts_in_one_request(qwen_server):
    c = qwen_server.client()
    for prompts in (["Once upon a time", JA_PROMPTS[1]], [[100, 200, 300], [7, 8]]):
        kw = dict(model=qwen_server.name, prompt=prompts, max_tokens=5, temperature=0.0, n=2)
        full = c.completions.create(**kw)
        assert sorted(ch.index for ch in full.choices) == [0, 1, 2, 3]
        texts, _, usage = _stream_text(c.completions.create(**kw, stream=True,
                                                            stream_options={"include_usage": True}), n=4)
        assert texts == [ch.text for ch in sorted(full.choices, key=lambda ch: ch.index)]
        n_prompt = sum(len(p) if isinstance(p, list) else len(qwen_server.tokenizer(p).input_ids) for p in prompts)
        assert usage.prompt_tokens == full.usage.prompt_tokens == n_prompt and usage.completion_tokens == 20
    echo = c.completions.create(model=qwen_server.name, prompt="Hello there", max_tokens=3, echo=True)
    assert echo.choices[0].text.startswith("Hello there")


def test_logprobs(qwen_server):
    c = qwen_server.client()
    r = c.completions.create(model=qwen_server.name, prompt="Hello", max_tokens=6, temperature=0.0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and tok_lp <= 0.0
        assert tok_lp == pytest.approx(max(top.values()))     # greedy: the sampled token is the most likely
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = c.chat.completions.create(model=qwen_server.name, messages=MSG_JA, max_tokens=5, temperature=0.0,
                                     logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    streamed = c.chat.completions.create(model=qwen_server.name, messages=MSG_JA, max_tokens=5, temperature=0.0,
                                         logprobs=True, top_logprobs=2, stream=True)
    tokens = [t.token for ch in streamed for c_ in ch.choices if c_.logprobs for t in c_.logprobs.content]
    assert tokens == [t.token for t in content]


# ------------------------------------------------------------------------------------------------ bad input
BAD_COMPLETIONS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"prompt": "word " * 400}, "prompt"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt": [999999999]}, "prompt_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"stop": [""]}, "stop"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"suffix": "x"}, "suffix"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bad,param", BAD_COMPLETIONS)
def test_bad_completion_is_400_naming_the_parameter(qwen_server, bad, param, stream):
    body = {"model": qwen_server.name, "prompt": "hi", "max_tokens": 4, "stream": stream, **bad}
    r = httpx.post(qwen_server.url + "/v1/completions", json=body, headers=qwen_server.headers())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404_model_not_found(qwen_server, stream):
    """OpenAI's (and vLLM's) answer: 404, code model_not_found (the openai client raises NotFoundError)."""
    c = qwen_server.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="hi", max_tokens=2, stream=stream)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert c.completions.create(model=qwen_server.name, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_bad_prompt_in_a_list_is_named_by_index(qwen_server):
    body = {"model": qwen_server.name, "prompt": [[1, 2], [3, 999999999]], "max_tokens": 4}
    r = httpx.post(qwen_server.url + "/v1/completions", json=body, headers=qwen_server.headers())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    vocab = qwen_server.engine.engine.config.model_config.vocab_size
    assert err["param"] == "prompt_token_ids"
    assert err["message"] == (f"prompt[1]: token id 999999999 at position 1 of prompt_token_ids is out of "
                              f"vocabulary (vocab_size={vocab}: ids are 0 to {vocab - 1}).")
    wait_idle(qwen_server.engine)   # the first prompt's request was not left running


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
]


@pytest.mark.parametrize("bad,param", BAD_CHAT)
def test_bad_chat_is_400_naming_the_parameter(qwen_server, bad, param):
    body = {"model": qwen_server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **bad}
    r = httpx.post(qwen_server.url + "/v1/chat/completions", json=body, headers=qwen_server.headers())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


UNSUPPORTED_VLLM_FIELDS = [("prompt_logprobs", 1), ("prompt_logprobs", 0)]


# /v1/completions serves prompt_logprobs and use_beam_search (test_echo_logprobs.py); chat refuses them
@pytest.mark.parametrize("endpoint,field,value",
                         [(e, f, v) for e in ("completions", "chat") for f, v in UNSUPPORTED_VLLM_FIELDS
                          if not (e == "completions" and f == "prompt_logprobs")]
                         + [("chat", "use_beam_search", True)])
def test_unsupported_vllm_field_is_400_naming_it(qwen_server, endpoint, field, value):
    c = qwen_server.client()
    kw = dict(model=qwen_server.name, max_tokens=2)
    create = (lambda **k: c.completions.create(prompt="hi", **k)) if endpoint == "completions" else \
        (lambda **k: c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **k))
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            create(**kw, stream=stream, extra_body={field: value})
        assert e.value.status_code == 400 and e.value.body["param"] == field and field in e.value.body["message"]
    # null (or vLLM's default) is accepted, and the server still answers
    ok = create(**kw, extra_body={field: None})
    assert ok.usage.completion_tokens >= 1
    wait_idle(qwen_server.engine)


def test_unknown_fields_are_still_ignored(qwen_server):
    c = qwen_server.client()
    r = c.completions.create(model=qwen_server.name, prompt="hi", max_tokens=2,
                             extra_body={"some_future_field": {"x": 1}, "metadata": {"a": "b"}})
    assert r.usage.completion_tokens >= 1


# A template that writes a fixed prefix and the last user message, nothing else (no special tokens).
PREFIX_TEMPLATE = "PREFIX: {{ messages[-1]['content'] }}"


def test_per_request_chat_template_is_refused_unless_trusted(qwen_server):
    c = qwen_server.client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=qwen_server.name, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, stream=stream, extra_body={"chat_template": PREFIX_TEMPLATE})
        assert e.value.body["param"] == "chat_template" and "--trust-request-chat-template" in e.value.body["message"]
    assert c.chat.completions.create(model=qwen_server.name, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2).usage.completion_tokens >= 1


def test_per_request_chat_template(llama_server):
    s = llama_server                               # started with --trust-request-chat-template
    c = s.client()
    tok = s.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    kw = dict(model=s.name, messages=msgs, max_tokens=2, temperature=0.0)
    default = c.chat.completions.create(**kw)
    custom = c.chat.completions.create(**kw, extra_body={"chat_template": PREFIX_TEMPLATE})
    expected = len(tok("PREFIX: hello there", add_special_tokens=False).input_ids)
    assert custom.usage.prompt_tokens == expected != default.usage.prompt_tokens
    # the rendered prompt is exactly the template's output: greedy completion of the same text agrees
    same = c.completions.create(model=s.name, prompt="PREFIX: hello there", max_tokens=2,
                                temperature=0.0, extra_body={"add_special_tokens": False})
    assert custom.choices[0].message.content == same.choices[0].text
    # the server's own template is used again on the next request
    assert c.chat.completions.create(**kw).usage.prompt_tokens == default.usage.prompt_tokens


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m.content }",          # does not parse
                                      "{{ raise_exception('no') }}",                    # fails to render
                                      "{{ messages[0]['content'] | no_such_filter }}",
                                      "/etc/passwd"])                                   # a path: not accepted
def test_broken_per_request_chat_template_is_400(llama_server, template):
    c = llama_server.client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=llama_server.name, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, stream=stream, extra_body={"chat_template": template})
        assert e.value.body["param"] == "chat_template"
    assert c.chat.completions.create(model=llama_server.name, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=2).usage.completion_tokens >= 1


def test_max_tokens_beyond_the_context_is_400(qwen_server):
    url, h, name = qwen_server.url, qwen_server.headers(), qwen_server.name
    max_len = qwen_server.engine.engine.config.model_config.max_model_len
    n_prompt = len(qwen_server.tokenizer("hi").input_ids)
    for stream in (False, True):
        r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                       json={"model": name, "prompt": "hi", "max_tokens": 5000, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
        assert err["message"] == (f"This model's maximum context length is {max_len} tokens. However, you requested "
                                  f"{n_prompt + 5000} tokens ({n_prompt} in the messages, 5000 in the completion). "
                                  "Please reduce the length of the messages or completion.")
    # exactly fits: 200 and generates all of it
    r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                   json={"model": name, "prompt": "hi", "ignore_eos": True, "max_tokens": max_len - n_prompt})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == max_len
    # one too many, by one prompt of a list: named by index
    r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                   json={"model": name, "prompt": [[1], [1, 2]], "max_tokens": max_len - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"].startswith("prompt[1]: This model's maximum context length")
    # chat: max_tokens and max_completion_tokens alike; one token too many -> 400, exactly fitting -> 200
    msgs = [{"role": "user", "content": "hi"}]
    n_chat = qwen_server.client().chat.completions.create(model=name, messages=msgs, max_tokens=1).usage.prompt_tokens
    for param in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(url + "/v1/chat/completions", headers=h, timeout=60,
                       json={"model": name, "messages": msgs, param: max_len - n_chat + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert f"({n_chat} in the messages, {max_len - n_chat + 1} in the completion)" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", headers=h, timeout=60,
                       json={"model": name, "messages": msgs, param: max_len - n_chat, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == max_len, r.text
    # max_tokens absent: still generates up to the context
    r = httpx.post(url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"model": name, "messages": msgs, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == max_len, r.text
    wait_idle(qwen_server.engine)


def test_malformed_bodies_and_routes(qwen_server):
    url, h = qwen_server.url, qwen_server.headers()
    for raw in (b"{not json", b"[1, 2]", "\u00ff".encode("latin-1"), b""):
        r = httpx.post(url + "/v1/completions", content=raw, headers={**h, "Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url + "/v1/completions", json={"model": qwen_server.name}, headers=h)   # no prompt
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(url + "/v1/nothing", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    # the openai client maps a 400 to BadRequestError, and the server still answers afterwards
    c = qwen_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=qwen_server.name, prompt="hi", max_tokens=-5)
    assert e.value.body["param"] == "max_tokens"
    assert c.completions.create(model=qwen_server.name, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    wait_idle(qwen_server.engine)


def test_api_key(qwen_server):
    url = qwen_server.url
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    for scheme in ("bearer", "BEARER", "BeArEr"):          # the scheme is case-insensitive (RFC 7235)
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    for wrong in (f"Basic {API_KEY}", f"Bearer{API_KEY}", f"Bearer {API_KEY}x", API_KEY, f"Bearer {API_KEY.upper()}"):
        assert httpx.get(url + "/v1/models", headers={"Authorization": wrong}).status_code == 401, wrong


# ------------------------------------------------------------------------------------------------ disconnects
def test_disconnect_mid_stream_frees_kv_blocks(qwen_server):
    c = qwen_server.client()
    before = qwen_server.engine.get_stats()["num_generation_tokens"]
    stream = c.completions.create(model=qwen_server.name, prompt="Once", max_tokens=240, temperature=0.0,
                                  stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    stats = wait_idle(qwen_server.engine)
    assert 3 <= stats["num_generation_tokens"] - before < 240         # aborted before max_tokens


def test_disconnect_while_waiting_non_streamed(qwen_server):
    body = {"model": qwen_server.name, "prompt": "Once", "max_tokens": 240, "ignore_eos": True}
    before = qwen_server.engine.get_stats()["num_generation_tokens"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(qwen_server.url + "/v1/completions", json=body, headers=qwen_server.headers(), timeout=0.3)
    stats = wait_idle(qwen_server.engine)
    assert stats["num_generation_tokens"] - before < 240         # aborted before max_tokens


# ------------------------------------------------------------------------------------------------ the CLI
def test_hayabusa_serve_cli(stories_dir, tmp_path):
    pytest.importorskip("uvicorn")
    from tests.helpers import start_server

    url, proc = start_server([stories_dir, "--served-model-name", "stories", "--max-model-len", "128",
                              "--max-num-seqs", "4", "--disable-log-requests", "--disable-uvicorn-access-log"])
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "stories", "prompt": "Once upon a time",
                                                      "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert json.loads(httpx.get(url + "/v1/models").text)["data"][0]["max_model_len"] == 128
    finally:
        proc.terminate()
        proc.wait(20)


def test_chat_return_token_ids_plain_and_streamed(qwen_server):
    """vLLM's return_token_ids on chat: the response's prompt_token_ids (the rendered conversation's ids, the same
    in both forms) and each choice's token_ids, whose decode is the choice's text; streamed, the first chunk
    carries prompt_token_ids and the content chunks' token_ids add up to the plain response's."""
    body = {"model": qwen_server.name, "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "n": 2}
    url = qwen_server.url + "/v1/chat/completions"
    r = httpx.post(url, json=body, headers=qwen_server.headers())
    assert r.status_code == 200, r.text
    plain = r.json()
    prompt_ids = plain["prompt_token_ids"]
    assert len(prompt_ids) > 4 and all(isinstance(t, int) for t in prompt_ids)
    assert plain["usage"]["prompt_tokens"] == len(prompt_ids)
    tok = qwen_server.tokenizer
    for choice in plain["choices"]:
        assert len(choice["token_ids"]) == 8
        assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    chunks = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=qwen_server.headers()) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            streamed[ch["index"]] += ch.get("token_ids", [])
    assert [streamed[i] for i in (0, 1)] == [c["token_ids"] for c in sorted(plain["choices"], key=lambda c: c["index"])]
