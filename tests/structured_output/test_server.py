"""Structured outputs through the OpenAI server with the real openai client: response_format json_schema /
json_object, vLLM's structured_outputs extra body and the legacy guided_* fields; bad constraints are 400s."""

from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

from tests.entrypoints.conftest import API_KEY, Served, wait_idle  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"merchant": {"type": "string", "maxLength": 10}, "total": {"type": "number", "minimum": 0,
                                                                              "maximum": 1000},
                   "paid": {"type": "boolean"}},
    "required": ["merchant", "total", "paid"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = Served(tiny_qwen2, "tiny-qwen", api_key=API_KEY, max_model_len=256)
    yield s
    s.close()


def _messages():
    return [{"role": "user", "content": "Extract the receipt as JSON."}]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_gives_valid_json(server, stream):
    c = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "receipt", "schema": SCHEMA, "strict": True}}
    kw = dict(model=server.name, messages=_messages(), max_tokens=100, n=2, temperature=1.0, seed=3,
              response_format=rf)
    if stream:
        texts = {0: "", 1: ""}
        for chunk in c.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        outs = list(texts.values())
    else:
        r = c.chat.completions.create(**kw)
        assert all(ch.finish_reason == "stop" for ch in r.choices)
        outs = [ch.message.content for ch in r.choices]
    for text in outs:
        jsonschema.validate(json.loads(text), SCHEMA)
    wait_idle(server.engine)


def test_json_object_and_completions_extra_bodies(server):
    c = server.client()
    r = c.chat.completions.create(model=server.name, messages=_messages(), max_tokens=60, temperature=0,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = c.completions.create(model=server.name, prompt="Answer:", max_tokens=20, temperature=0,
                             extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta")
    r = c.completions.create(model=server.name, prompt="Email:", max_tokens=30, temperature=1.0, seed=1,
                             extra_body={"guided_regex": r"[a-z]{2,5}@x\.org"})
    assert re.fullmatch(r"[a-z]{2,5}@x\.org", r.choices[0].text)
    r = c.completions.create(model=server.name, prompt="JSON:", max_tokens=100, temperature=1.0, seed=2,
                             extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    wait_idle(server.engine)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{oops"}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_grammar": "root ::= (("}, "guided_grammar"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
])
def test_malformed_constraint_is_400_naming_the_field(server, extra, param):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.name, messages=_messages(), max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    wait_idle(server.engine)
