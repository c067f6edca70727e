"""The server's logit_bias (string keys), allowed_token_ids and bad_words: mapped to SamplingParams, bad values a
400 naming the field."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

from tests.entrypoints.conftest import Served, wait_idle  # noqa: E402


@pytest.fixture(scope="module")
def server(stories_dir):
    s = Served(stories_dir, "stories", max_model_len=128, async_scheduling=False)
    yield s
    s.close()


def complete(server, **body):
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, **body}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_logit_bias_string_keys_map_to_token_ids(server):
    r = complete(server, logit_bias={"77": 100})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [77] * 8
    # beyond OpenAI's [-100, 100]: clamped (vLLM's mapping), not refused
    r = complete(server, logit_bias={"77": 1000})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [77] * 8


def test_allowed_token_ids_and_bad_words(server):
    base = complete(server, max_tokens=20).json()["choices"][0]
    assert "Lily" in base["text"]
    r = complete(server, max_tokens=20, bad_words=["Lily"])
    assert r.status_code == 200 and "Lily" not in r.json()["choices"][0]["text"]
    r = complete(server, allowed_token_ids=[261, 298, 13], stream=False)
    assert r.status_code == 200 and set(r.json()["choices"][0]["token_ids"]) <= {261, 298, 13}
    wait_idle(server.engine)


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"1.5": 1}),
    ("logit_bias", {"512": 1}),          # out of the vocabulary (512 ids)
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"1": "x"}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [1, 512]),
    ("allowed_token_ids", [1, "2"]),
    ("bad_words", [""]),
    ("bad_words", "Lily"),
    ("bad_words", [3]),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_values_are_400_naming_the_field(server, field, value, stream):
    r = complete(server, stream=stream, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_chat_takes_them_too(qwen_server):
    body = {"model": qwen_server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0.0, "logprobs": True}
    url, h = qwen_server.url + "/v1/chat/completions", qwen_server.headers()
    r = httpx.post(url, json={**body, "allowed_token_ids": []}, headers=h, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    tok = qwen_server.tokenizer
    a_id = tok.encode("a", add_special_tokens=False)[0]
    r = httpx.post(url, json={**body, "logit_bias": {str(a_id): 100}}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    assert [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]] == ["a"] * 4
