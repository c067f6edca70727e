"""`hayabusa generate`: every line is checked before the model loads or anything generates, and a bad line is
reported as `FILE:LINE: message` (1-based, blank lines counted) with exit status 2 and no traceback."""

from __future__ import annotations

import json

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.entrypoints.cli import main


def write_jsonl(path, lines: list) -> str:
    """`lines`: dicts (written as JSON) or raw strings (written as they are)."""
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("bad,message", [
    ({"prompt": "c", "temperature": -1}, "temperature must be non-negative, got -1."),
    ({"prompt": "c", "max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    ({"prompt": "c", "stop": 5}, "stop"),
    ('{"prompt": "c",}', "not JSON"),
])
def test_bad_line_is_named_before_the_model_loads(tmp_path, monkeypatch, capsys, bad, message):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before every line was checked")

    monkeypatch.setattr("hayabusa.LLM", no_model)
    # line 1 good, line 2 blank (still counted), line 3 good, line 4 bad, line 5 good
    path = write_jsonl(tmp_path / "requests.jsonl", [{"prompt": "a"}, "", {"prompt": "b"}, bad, {"prompt": "d"}])
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--prompts", path, "--output", str(out), "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hayabusa: error: {path}:4: ") and message in err
    assert "Traceback" not in err and not out.exists()


def test_model_check_names_the_line_before_generating(stories_dir, tmp_path, capsys):
    """An out-of-vocabulary token id needs the model to check; it is still found before any request runs."""
    path = write_jsonl(tmp_path / "requests.jsonl", [{"prompt": "Once"}, {"prompt_token_ids": [1, 2, 99999]},
                                                     {"prompt": "Lily", "max_tokens": 3}])
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", stories_dir, "--prompts", path, "--output", str(out), "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert f"hayabusa: error: {path}:2: token id 99999" in err and "vocab_size=512" in err
    assert "Traceback" not in err and not out.exists()


def test_generate_output_matches_llm_generate(stories_dir, tmp_path):
    rows = [{"prompt": "Once upon a time", "id": "a"}, {"prompt_token_ids": [1, 403, 407, 261], "max_tokens": 4},
            {"prompt": "Lily and Tom", "truncate_prompt_tokens": 2, "max_tokens": 3}]
    path = write_jsonl(tmp_path / "requests.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", stories_dir, "--prompts", path, "--output", str(out), "--no-tqdm",
                 "--temperature", "0", "--max-tokens", "6"]) == 0
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=4),
              SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=2)]
    ref = LLM(stories_dir).generate(["Once upon a time", {"prompt_token_ids": [1, 403, 407, 261]}, "Lily and Tom"],
                                    params, use_tqdm=False)
    assert [g["prompt"] for g in got] == [r.prompt for r in ref] == ["Once upon a time", None, "Lily and Tom"]
    assert [g["prompt_token_ids"] for g in got] == [r.prompt_token_ids for r in ref]
    assert len(got[2]["prompt_token_ids"]) == 2 and got[0]["id"] == "a" and "id" not in got[1]
    assert [g["outputs"][0]["token_ids"] for g in got] == [r.outputs[0].token_ids for r in ref]


def test_generate_writes_the_logprobs_a_line_asks_for(stories_dir, tmp_path):
    """A line's `logprobs` / `prompt_logprobs` are accepted, so they are written (as LLM.generate returns them:
    per position {token id: {logprob, rank, decoded_token}}, with cumulative_logprob); lines without them get none."""
    rows = [{"prompt": "Once upon a time", "logprobs": 3, "max_tokens": 4},
            {"prompt": "Lily and Tom", "prompt_logprobs": 2, "max_tokens": 2}, {"prompt": "Once", "max_tokens": 2}]
    path = write_jsonl(tmp_path / "requests.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", stories_dir, "--prompts", path, "--output", str(out), "--no-tqdm",
                 "--temperature", "0"]) == 0
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    ref = LLM(stories_dir).generate(["Once upon a time", "Lily and Tom"],
                                    [SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                                     SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)], use_tqdm=False)
    c, rc = got[0]["outputs"][0], ref[0].outputs[0]
    assert len(c["logprobs"]) == 4 and all(3 <= len(pos) <= 4 for pos in c["logprobs"])
    for pos, rpos in zip(c["logprobs"], rc.logprobs):
        assert {int(k) for k in pos} == set(rpos)
        for k, v in pos.items():
            r = rpos[int(k)]
            assert v["logprob"] == pytest.approx(r.logprob, abs=1e-5) and v["rank"] == r.rank
            assert v["decoded_token"] == r.decoded_token
    assert c["cumulative_logprob"] == pytest.approx(rc.cumulative_logprob, abs=1e-4)
    pl = got[1]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ref[1].prompt_token_ids) and len(pl) > 1
    assert all({int(k) for k in pos} == set(r) for pos, r in zip(pl[1:], ref[1].prompt_logprobs[1:]))
    assert "logprobs" not in got[2]["outputs"][0] and "prompt_logprobs" not in got[2]


def test_not_utf8_is_a_user_error(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    assert main(["generate", "--prompts", str(path), "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hayabusa: error: {path}: not UTF-8 text") and "Traceback" not in err
