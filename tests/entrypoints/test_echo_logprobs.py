"""/v1/completions with echo and logprobs (what lm-eval's loglikelihood requests send): the prompt's tokens come
back with their logprobs in OpenAI's legacy shape, equal to HF's float32 log-softmax; max_tokens=0 with echo."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.entrypoints.conftest import Served
from tests.helpers import _hf_model


@pytest.fixture(scope="module")
def stories_server(stories_dir):
    s = Served(stories_dir, "stories", dtype="float32", max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=128)
    yield s
    s.close()


def _post(s, body):
    return httpx.post(s.url + "/v1/completions", json={"model": s.name, **body}, headers=s.headers(), timeout=60)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_hf(stories_server, stories_dir, max_tokens):
    s = stories_server
    ids = s.tokenizer("Once upon a time there was a little dog").input_ids
    r = _post(s, {"prompt": ids, "max_tokens": max_tokens, "echo": True, "logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    with torch.no_grad():
        ref = torch.log_softmax(_hf_model(stories_dir)(torch.tensor([ids])).logits[0].float(), -1)
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        assert lp["tokens"][p] == s.tokenizer.decode([ids[p]]) or lp["tokens"][p].strip() == \
            s.tokenizer.decode([ids[p]]).strip()
        top = sorted(lp["top_logprobs"][p].values(), reverse=True)
        assert top[0] == pytest.approx(float(ref[p - 1].max()), abs=1e-4)
        assert 2 <= len(lp["top_logprobs"][p]) <= 3
    assert lp["text_offset"] == sorted(lp["text_offset"])
    if max_tokens == 0:
        assert choice["text"] == s.tokenizer.decode(ids)
    else:   # the output token follows, greedy: HF's argmax after the prompt
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)


def test_prompt_logprobs_field(stories_server):
    s = stories_server
    ids = s.tokenizer("The cat sat").input_ids
    r = _post(s, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert all(str(ids[p]) in plp[p] for p in range(1, len(ids)))


@pytest.mark.parametrize("body,param", [({"max_tokens": 0}, "max_tokens"),
                                        ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                        ({"echo": True, "max_tokens": -1}, "max_tokens")])
def test_echo_bad_requests_are_400(stories_server, body, param):
    r = _post(stories_server, {"prompt": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_use_beam_search_equals_llm_beam_search(stories_server, stories_dir):
    """/v1/completions with use_beam_search: the n best beams (vLLM: beam width = n), as LLM.beam_search."""
    from hayabusa import LLM
    from hayabusa.sampling_params import BeamSearchParams

    s = stories_server
    prompts = ["Once upon a time", "The dog"]
    r = _post(s, {"prompt": prompts, "max_tokens": 8, "n": 3, "use_beam_search": True, "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    llm = LLM(stories_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=128)
    outs = llm.beam_search(prompts, BeamSearchParams(3, 8, length_penalty=0.5))
    tok = llm.get_tokenizer()
    want = [tok.decode(seq.tokens[len(tok(p).input_ids):], skip_special_tokens=True)
            for p, o in zip(prompts, outs) for seq in o.sequences]
    assert [c["text"] for c in choices] == want
    assert r.json()["usage"]["completion_tokens"] == sum(len(seq.tokens) - len(tok(p).input_ids)
                                                        for p, o in zip(prompts, outs) for seq in o.sequences)
    bad = _post(s, {"prompt": "hi", "n": 2, "use_beam_search": True, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_stream_equals_non_stream(stories_server, max_tokens):
    s = stories_server
    body = {"prompt": "Once upon a time there was", "max_tokens": max_tokens, "echo": True, "logprobs": 1,
            "temperature": 0}
    whole = _post(s, body).json()["choices"][0]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", s.url + "/v1/completions", json={"model": s.name, **body, "stream": True},
                      headers=s.headers(), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c["text"]
                for key in lp:
                    lp[key] += c["logprobs"][key]
    assert text == whole["text"]
    assert lp == whole["logprobs"]
