"""Fuzzed request bodies against a real server: any JSON-ish value (wrong types, unicode with lone surrogates, large
and deeply nested values, NaN / Infinity, huge integers) in the fields of both endpoints. The server must never
answer 5xx, a 4xx must be OpenAI's error shape, a stream must end with [DONE], and afterwards a plain request must
still be answered correctly with every KV block free."""

from __future__ import annotations

import json
import math

import pytest

httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.entrypoints.conftest import Served, wait_idle  # noqa: E402

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "echo",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos",
          "stop_token_ids", "request_id", "truncate_prompt_tokens", "skip_special_tokens", "add_special_tokens",
          "chat_template", "chat_template_kwargs", "response_format", "tools", "tool_choice", "user", "best_of",
          "suffix", "prompt_logprobs", "include_stop_str_in_output", "unknown_field"]

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.one_of(st.text(max_size=40), st.text(alphabet=st.one_of(st.characters(), surrogates), max_size=20),
                  st.sampled_from(["tiny-qwen", "user", "assistant", "text", "", "\n", "吾輩は猫である"]),
                  st.integers(0, 3000).map(lambda n: "ab " * n))
numbers = st.one_of(st.integers(-3, 40), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True),
                    st.sampled_from([0, 1, 2, 0.0, 0.5, 1.0, -1, 1e308, 2 ** 63, -(2 ** 63) - 1]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(texts, inner, max_size=4)), max_leaves=20)
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), values),
                                           "content": st.one_of(texts, values)}), max_size=3)
# A valid request with up to three fields replaced, or a body of random fields.
valid = st.fixed_dictionaries({"model": st.just("tiny-qwen"), "prompt": st.one_of(texts, st.lists(
    st.integers(0, 1000), min_size=1, max_size=30)), "messages": st.just([{"role": "user", "content": "hi"}])})
bodies = st.one_of(
    st.tuples(valid, st.dictionaries(st.sampled_from(FIELDS), values, max_size=3)).map(lambda t: {**t[0], **t[1]}),
    st.fixed_dictionaries({}, optional={f: values for f in FIELDS}).flatmap(
        lambda d: st.fixed_dictionaries({"prompt": st.one_of(texts, values), "messages": st.one_of(messages, values)})
        .map(lambda extra: {**extra, **d})))


def _bounded(body: dict) -> dict:
    """Keep each example cheap: valid sizes are capped (small max_tokens and n), not removed."""
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
            body[key] = 4
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("best_of"), int) and body["best_of"] > 2:
        body["best_of"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4 and not all(
            isinstance(x, int) for x in body["prompt"]):
        body["prompt"] = body["prompt"][:4]
    return body


@pytest.fixture(scope="module")
def fuzz_server(tiny_qwen2):
    s = Served(tiny_qwen2, "tiny-qwen", max_model_len=128, max_num_seqs=16,
               app_kwargs={"trust_request_chat_template": True})
    s.app.state.serving.request_chat_template_time_limit = 1.0
    yield s
    s.close()


def test_fuzzed_bodies_never_get_a_5xx(fuzz_server):
    s = fuzz_server
    client = httpx.Client(base_url=s.url, timeout=30)
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=15000, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies, chat=st.booleans(), stream=st.booleans())
    def one(body: dict, chat: bool, stream: bool) -> None:
        body = _bounded(body)
        body.pop("messages" if not chat else "prompt", None)
        if stream and "stream" not in body:
            body["stream"] = True
        raw = json.dumps(body, allow_nan=True).encode()            # ensure_ascii: surrogates as "\\udXXX"
        r = client.post("/v1/chat/completions" if chat else "/v1/completions", content=raw,
                        headers={"Content-Type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text[:500], raw[:500])
        if r.status_code != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]", r.text[-500:]
            for e in events[:-1]:
                chunk = json.loads(e[len("data: "):])
                assert "error" not in chunk, chunk
        else:
            out = r.json()
            assert out["choices"] and all(math.isfinite(v) for v in out["usage"].values())

    try:
        one()
    finally:
        client.close()
    assert seen.get(400, 0) > 10 and seen.get(200, 0) > 5, seen     # the fuzzer reached both sides
    r = httpx.post(s.url + "/v1/completions", timeout=60,
                   json={"model": "tiny-qwen", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_idle(s.engine)
