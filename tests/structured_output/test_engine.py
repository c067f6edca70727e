"""Structured outputs through the engine on a tiny random-weight Qwen2 (it never writes JSON on its own): every
constrained output parses and validates; unconstrained requests in the same batch are unchanged."""

from __future__ import annotations

import json
import re

import numpy as np

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from hayabusa import LLM, SamplingParams  # noqa: E402
from hayabusa.errors import HayabusaValidationError  # noqa: E402
from hayabusa.sampling_params import GuidedDecodingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver", "bronze"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "吾輩は猫である。", "hello", "1 2 3"]


@pytest.fixture(scope="module", params=[1, 16], ids=["seqs1", "seqs16"])
def llm(request, tiny_qwen2):
    # a fixed KV size: on a GPU the later tests' engines must still fit beside this one
    return LLM(tiny_qwen2, max_num_seqs=request.param, max_model_len=512, num_gpu_blocks_override=256)


@pytest.fixture(scope="module")
def plain_outputs(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _json_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 120),
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def test_json_schema_outputs_validate_mixed_with_unconstrained(llm, plain_outputs):
    prompts, params = [], []
    for i, p in enumerate(PROMPTS):
        prompts += [p, p]
        params += [SamplingParams(temperature=0, max_tokens=12),
                   _json_params(temperature=0) if i % 2 else _json_params(temperature=1.0, seed=i)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if i % 2 == 0:   # unconstrained: the same greedy tokens as without constrained neighbours
            assert list(c.token_ids) == list(plain_outputs[i // 2])
        else:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.llm_engine.scheduler.num_structured == 0


def test_n_greater_than_one_and_pydantic_schema(llm):
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        sku: str = pydantic.Field(max_length=6)
        qty: int = pydantic.Field(ge=1, le=9)

    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(json=Item))
    (out,) = llm.generate(["Receipt:"], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for c in out.outputs:
        Item.model_validate_json(c.text)


@pytest.mark.parametrize("spec,check", [
    (dict(regex=r"[a-z]{3,6}@[a-z]{2,5}\.com"), lambda t: re.fullmatch(r"[a-z]{3,6}@[a-z]{2,5}\.com", t)),
    (dict(choice=["yes", "no", "maybe so", 'say "hi"']), lambda t: t in ["yes", "no", "maybe so", 'say "hi"']),
    (dict(grammar='root ::= "(" num " + " num ")"\nnum ::= [0-9] [0-9]?'),
     lambda t: re.fullmatch(r"\(\d\d? \+ \d\d?\)", t)),
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_json_object(llm, spec, check):
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, structured_outputs=StructuredOutputsParams(**spec))
              for i, t in enumerate([0.0, 1.0, 1.0])]
    for o in llm.generate(PROMPTS[:3], params, use_tqdm=False):
        c = o.outputs[0]
        if spec.get("json_object") and c.finish_reason == "length":
            continue   # an open object may run to max_tokens; what matters is that it is JSON so far
        assert c.finish_reason == "stop" and check(c.text), c


def test_max_tokens_ends_early_with_length(llm):
    (out,) = llm.generate(["hi"], _json_params(temperature=0, max_tokens=4), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4 and c.text.startswith("{")


def test_stop_string_and_guided_decoding_alias(llm):
    params = SamplingParams(temperature=0, max_tokens=100, stop=[","],
                            guided_decoding=GuidedDecodingParams(json=SCHEMA))
    assert params.structured_outputs is params.guided_decoding
    (out,) = llm.generate(["hi"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "," and "," not in c.text and c.text.startswith("{")


def test_whitespace_is_bounded_by_default(llm):
    xgr = pytest.importorskip("xgrammar")
    mgr = llm.llm_engine.structured_output
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(text: str, **kw) -> bool:
        m = xgr.GrammarMatcher(mgr.grammar(StructuredOutputsParams(json=schema, **kw)).result())
        return m.accept_string(text)

    assert accepts('{"a": 1}') and accepts('{ "a":  1}')
    assert not accepts('{"a":' + " " * 3)                     # at most 2 whitespace characters by default
    assert accepts('{"a":' + " " * 8, whitespace_pattern=r"[ ]*")   # a pattern lifts the bound
    assert not accepts('{ "a"', disable_any_whitespace=True)


@pytest.mark.parametrize("spec,field", [
    (dict(json={"type": "strin"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="(ab"), "structured_outputs.regex"),
    (dict(grammar="root ::= (("), "structured_outputs.grammar"),
])
def test_invalid_constraint_is_refused_before_queueing(llm, spec, field):
    with pytest.raises(HayabusaValidationError) as e:
        llm.llm_engine.add_request("bad", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert e.value.parameter == field
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_need_exactly_one_kind():
    with pytest.raises(HayabusaValidationError) as e:
        StructuredOutputsParams(json=SCHEMA, regex="a")
    assert e.value.parameter == "structured_outputs"
    with pytest.raises(HayabusaValidationError):
        StructuredOutputsParams()
    with pytest.raises(HayabusaValidationError):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=StructuredOutputsParams(regex="b"))
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    assert SamplingParams().clone(structured_outputs={"choice": ["x"]}).structured_outputs.kind == "choice"


def test_grammar_compiled_once_per_distinct_constraint(llm):
    mgr = llm.llm_engine.structured_output
    a = mgr.grammar(StructuredOutputsParams(json=dict(SCHEMA)))
    b = mgr.grammar(StructuredOutputsParams(json=json.dumps(SCHEMA)) if False else
                    StructuredOutputsParams(json={k: SCHEMA[k] for k in reversed(list(SCHEMA))}))
    assert a is b


def test_async_scheduling_preemption_prefix_caching(tiny_qwen2, plain_outputs_async=None):
    # a tiny KV cache: constrained requests are preempted and recomputed; async scheduling on; prefixes shared
    llm = LLM(tiny_qwen2, max_num_seqs=8, max_model_len=256, num_gpu_blocks_override=24, block_size=16,
              async_scheduling=True, enable_prefix_caching=True)
    prompt = "The capital of France is Paris. " * 6
    plain = llm.generate([prompt] * 2, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
    params = [_json_params(temperature=1.0, seed=i, max_tokens=150) if i % 2 else
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for i in range(8)]
    outs = llm.generate([prompt] * 8, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if i % 2:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert list(c.token_ids) == list(plain[0].outputs[0].token_ids)


def test_batch_fill_equals_one_by_one(llm):
    from hayabusa.structured_output import manager

    mgr = llm.llm_engine.structured_output
    reqs = [mgr.make_request(mgr.grammar(StructuredOutputsParams(json=SCHEMA)), (0,)) for _ in range(10)]
    for i, r in enumerate(reqs):
        assert r.ready()
        r.matcher.accept_string('{"name": "' + "ab"[: i % 3])
    batched = manager.fill_bitmask(reqs)
    one_by_one = np.concatenate([manager.fill_bitmask([r]) for r in reqs])
    assert len(reqs) >= manager.BATCH_FILL_MIN and np.array_equal(batched, one_by_one)
    assert (batched != batched[0]).any()   # the rows differ by state


def test_fill_bitmask_in_place_equals_a_new_mask(llm):
    # the runner's pinned buffer is filled in place: stale words from an earlier step are overwritten, the rows of
    # finished requests (None) allow everything, and the result is a view of the buffer (no copy)
    import torch

    from hayabusa.structured_output import manager

    mgr = llm.llm_engine.structured_output
    for n in (3, manager.BATCH_FILL_MIN + 2):   # one by one, and on xgrammar's threads
        reqs = [mgr.make_request(mgr.grammar(StructuredOutputsParams(json=SCHEMA)), (0,)) for _ in range(n)]
        for i, r in enumerate(reqs):
            assert r.ready()
            r.matcher.accept_string('{"name": "' + "ab"[: i % 3])
        reqs[1] = None
        want = manager.fill_bitmask(reqs)
        buf = torch.zeros(n + 4, want.shape[1], dtype=torch.int32)   # zeros: every token forbidden (stale)
        got = manager.fill_bitmask(reqs, out=buf[:n])
        assert np.array_equal(got, want) and np.shares_memory(got, buf.numpy())
        assert (got[1] == -1).all() and (buf[n:] == 0).all()        # only the n rows written


@pytest.mark.cuda
def test_cuda_bitmask_filled_in_the_runners_pinned_buffer(tiny_qwen2, monkeypatch):
    import torch

    from hayabusa.core import scheduler

    seen = []

    def fill(reqs, out=None):
        seen.append(out)
        return fill_bitmask(reqs, out=out)

    fill_bitmask = scheduler.fill_bitmask
    monkeypatch.setattr(scheduler, "fill_bitmask", fill)
    for async_scheduling in (False, True):
        seen.clear()
        llm = LLM(tiny_qwen2, device="cuda", max_num_seqs=4, max_model_len=256, num_gpu_blocks_override=64,
                  async_scheduling=async_scheduling)
        outs = llm.generate(PROMPTS[:4], _json_params(temperature=0), use_tqdm=False)
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        runner = llm.llm_engine.runner
        buffers = {st["bitmask"].data_ptr() for st in runner._staging_sets if st.get("bitmask") is not None}
        assert seen and all(b is not None and b.is_pinned() and b.data_ptr() in buffers for b in seen)


def test_apply_token_bitmask_masks_only_the_given_rows():
    import torch

    from hayabusa.sample.bitmask import apply_token_bitmask

    logits = torch.zeros(3, 70)
    bm = np.zeros((1, 3), dtype=np.int32)
    bm[0, 0] = 1 << 5
    bm[0, 2] = 1 << 1                       # token 65
    apply_token_bitmask(logits, bm, np.array([1]))
    assert torch.isfinite(logits[[0, 2]]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 65]
    # host tensors (the runner's pinned staging buffers on CUDA) work the same
    logits2 = torch.zeros(3, 70)
    apply_token_bitmask(logits2, torch.from_numpy(bm), torch.tensor([2]))
    assert torch.isfinite(logits2[[0, 1]]).all()
    assert torch.isfinite(logits2[2]).nonzero().flatten().tolist() == [5, 65]


def test_grammar_compile_failure_aborts_only_that_request(tiny_qwen2, monkeypatch):
    llm = LLM(tiny_qwen2, max_num_seqs=4, max_model_len=256, num_gpu_blocks_override=128)
    mgr = llm.llm_engine.structured_output

    def broken(compiler, grammar, key):
        raise RuntimeError("compiler out of memory")

    monkeypatch.setattr(mgr, "_compile", broken)
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=5),
                                     SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
                                         regex="[a-z]+"))], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 5
    assert outs[1].outputs[0].finish_reason == "abort"
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.scheduler.num_structured == 0


def test_other_requests_decode_while_a_grammar_compiles(tiny_qwen2, monkeypatch):
    import pickle
    import threading

    llm = LLM(tiny_qwen2, max_num_seqs=4, max_model_len=256, num_gpu_blocks_override=128)
    eng, mgr = llm.llm_engine, llm.llm_engine.structured_output
    release = threading.Event()
    compile_ = mgr._compile

    def slow(compiler, grammar, key):
        release.wait(30)
        return compile_(compiler, grammar, key)

    monkeypatch.setattr(mgr, "_compile", slow)
    eng.add_request("json", "hi", _json_params(temperature=0, max_tokens=120))
    eng.add_request("plain", "hello", SamplingParams(temperature=0, max_tokens=6))
    done = {}
    for _ in range(20):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if "plain" in done:
            break
    assert "plain" in done and "json" not in done          # decoded to the end while the grammar compiled
    assert eng.scheduler.waiting and eng.scheduler.waiting[0].request_id == "json"
    release.set()
    seen_mask = []
    launch = eng.runner.sample_tokens

    def spy(pending, bitmask):
        seen_mask.append((list(pending.out.structured_output_req_ids), bitmask.shape))
        pickle.loads(pickle.dumps(pending.out))              # still plain data
        return launch(pending, bitmask)

    monkeypatch.setattr(eng.runner, "sample_tokens", spy)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    jsonschema.validate(json.loads(done["json"].outputs[0].text), SCHEMA)
    assert seen_mask and seen_mask[0][0] == ["json"] and seen_mask[0][1][1] * 32 >= eng.config.model_config.vocab_size


def test_async_scheduling_gives_the_synchronous_outputs(tiny_qwen2, monkeypatch):
    # With async scheduling a constrained step's model is queued before the previous step's tokens are accepted
    # by the grammars; the bitmask is filled after. Outputs (greedy and seeded sampling, a stop string that ends a
    # request while its next step is already scheduled, a grammar that completes early) equal the synchronous ones.
    prompts, params = [], []
    for i, p in enumerate(PROMPTS):
        prompts += [p, p, p]
        params += [_json_params(temperature=0), _json_params(temperature=1.0, seed=i, stop=['",']),
                   SamplingParams(temperature=0, max_tokens=10,
                                  structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))]
    from hayabusa.core import scheduler

    finished_rows = []   # rows of requests that finished after their next step was scheduled (async only)

    def fill(reqs, out=None):
        finished_rows.append(sum(r is None for r in reqs))
        return fill_bitmask(reqs, out=out)

    fill_bitmask = scheduler.fill_bitmask
    monkeypatch.setattr(scheduler, "fill_bitmask", fill)
    results = []
    for async_scheduling in (False, True):
        finished_rows.clear()
        llm = LLM(tiny_qwen2, max_num_seqs=16, max_model_len=512, async_scheduling=async_scheduling,
                  num_gpu_blocks_override=256)
        assert llm.llm_engine.async_scheduling is async_scheduling
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].text)
                        for o in outs])
    assert results[0] == results[1]
    assert sum(finished_rows) > 0   # the async run met that case
    for i, (_, reason, text) in enumerate(results[1]):
        if i % 3 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif i % 3 == 2:
            assert text in ("yes", "no", "maybe") and reason == "stop"
    assert any(r == "stop" and not t.endswith("}") for _, r, t in results[1][1::3])  # a stop string ended one
