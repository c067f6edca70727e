"""vLLM compatibility gaps found by running users' vLLM scripts with only the import changed: vLLM's import paths
(engine.arg_utils, engine.async_llm_engine, inputs, top-level LLMEngine / TokensPrompt / TextPrompt), request ids
that are not str (``uuid.uuid4()``), and an architecture transformers does not know reported as hayabusa's own
unsupported-architecture error."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

import hayabusa
from hayabusa import AsyncEngineArgs, AsyncLLMEngine, EngineArgs, HayabusaValidationError, SamplingParams
from hayabusa.entrypoints.cli import main
from hayabusa.errors import UnsupportedModelError
from hayabusa.model.registry import supported_architectures
from tests.entrypoints.conftest import wait_idle


def test_vllm_import_paths_are_the_same_classes():
    from hayabusa.engine.arg_utils import AsyncEngineArgs as A, EngineArgs as E
    from hayabusa.engine.async_llm_engine import AsyncLLMEngine as AE
    from hayabusa.engine.llm_engine import LLMEngine
    from hayabusa.inputs import TextPrompt, TokensPrompt

    assert (A, E, AE) == (AsyncEngineArgs, EngineArgs, AsyncLLMEngine)
    assert hayabusa.LLMEngine is LLMEngine
    assert hayabusa.TokensPrompt is TokensPrompt and hayabusa.TextPrompt is TextPrompt
    for name in ("LLMEngine", "TokensPrompt", "TextPrompt"):
        assert name in hayabusa.__all__
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}    # plain dicts at run time
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}


def test_uuid_request_id_generates_and_aborts(engine):
    from hayabusa.inputs import TokensPrompt

    rid, to_abort = uuid.uuid4(), uuid.uuid4()

    async def main():
        outs = [o async for o in engine.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=8),
                                                 rid)]
        gen = engine.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]),
                              SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), to_abort)
        first = await gen.__anext__()
        await engine.abort(to_abort)                    # the same UUID object finds the request
        rest = [o async for o in gen]
        return outs, first, rest

    outs, first, rest = asyncio.run(main())
    assert outs[-1].finished and outs[-1].request_id == str(rid)
    assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert rest[-1].request_id == str(to_abort)
    wait_idle(engine)


def test_empty_request_id_is_still_refused(engine):
    async def main():
        with pytest.raises(HayabusaValidationError) as e:
            await engine.generate("Once", SamplingParams(max_tokens=2), "").__anext__()
        return e.value

    assert asyncio.run(main()).parameter == "request_id"


def test_llm_engine_takes_uuid_request_ids(stories_dir):
    eng = hayabusa.LLMEngine.from_engine_args(EngineArgs(model=stories_dir, max_model_len=256))
    rid = uuid.uuid4()
    eng.add_request(rid, "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    with pytest.raises(HayabusaValidationError):
        eng.add_request(str(rid), "Again", SamplingParams(max_tokens=2))      # same id, as str
    eng.step()
    outs = eng.abort_request(rid)
    assert [o.request_id for o in outs] == [str(rid)] and outs[0].outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()


@pytest.fixture
def foo_model(tmp_path):
    d = tmp_path / "foo"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo",
                                               "vocab_size": 10}))
    return str(d)


def test_unknown_model_type_is_an_unsupported_architecture(foo_model):
    with pytest.raises(UnsupportedModelError) as e:
        hayabusa.LLM(model=foo_model, device="cpu")
    msg = str(e.value)
    assert "FooForCausalLM" in msg and "is not supported; supported:" in msg
    assert all(a in msg for a in supported_architectures())
    assert "Transformers does not recognize" not in msg and e.value.__suppress_context__


def test_cli_reports_unknown_architecture_without_traceback(foo_model, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["generate", "--model", foo_model, "--prompts", str(prompts), "--device", "cpu", "--no-tqdm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hayabusa: error: architecture ['FooForCausalLM'] is not supported; supported: ")
    assert "LlamaForCausalLM" in err and "Traceback" not in err
