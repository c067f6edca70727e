"""Batch-invariant mode on CPU: one request's greedy token ids and logprobs are bit-identical alone, batched with
other requests, split into prefill chunks, and after a prefix-cache hit; the mode refuses what it does not cover.

The model is the trained stories260K-qwen2 asset (5 layers, qkv biases, tied embeddings) in bfloat16."""

import json
import random

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.assets import demo_model_dir
from hayabusa.config import EngineArgs
from hayabusa.errors import HayabusaValidationError

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 60) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))]} for _ in range(n)]


TARGET = _prompts(1, 0, 45, 46)[0]


def _key(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)


def _llm(model: str, **kw) -> LLM:
    return LLM(model, dtype="bfloat16", batch_invariant=True, seed=0, **kw)


def test_request_alone_batched_chunked_and_prefix_hit_agree(stories_qwen2_dir):
    alone = _key(_llm(stories_qwen2_dir, max_num_seqs=1, enable_prefix_caching=False).generate(
        [TARGET], PARAMS, use_tqdm=False)[0])
    assert len(alone[0]) == 12 and all(len(d) >= 3 for d in alone[1])
    variants = {}
    # chunked prefill (24-token steps) with 7 other requests, prefix caching on
    llm = _llm(stories_qwen2_dir, max_num_seqs=8, max_num_batched_tokens=24)
    outs = llm.generate(_prompts(3, 1) + [TARGET] + _prompts(4, 2), PARAMS, use_tqdm=False)
    variants["batched+chunked"] = _key(outs[3])
    # the same engine again: the target's full blocks are a prefix-cache hit (alone, then among others)
    variants["prefix hit alone"] = _key(llm.generate([TARGET], PARAMS, use_tqdm=False)[0])
    outs = llm.generate(_prompts(5, 3) + [TARGET], PARAMS, use_tqdm=False)
    variants["prefix hit batched"] = _key(outs[5])
    # a wide step: the whole prompt in one step next to 15 others
    outs = _llm(stories_qwen2_dir, max_num_seqs=16).generate([TARGET] + _prompts(15, 4), PARAMS, use_tqdm=False)
    variants["batched 16"] = _key(outs[0])
    for name, got in variants.items():
        assert got == alone, name


def test_env_var_turns_the_mode_on(stories_qwen2_dir, monkeypatch):
    from hayabusa.config import EngineArgs

    monkeypatch.setenv("HAYABUSA_BATCH_INVARIANT", "1")
    cfg = EngineArgs.from_kwargs(stories_qwen2_dir, device="cpu").create_engine_config()
    assert cfg.model_config.batch_invariant
    monkeypatch.setenv("HAYABUSA_BATCH_INVARIANT", "0")
    cfg = EngineArgs.from_kwargs(stories_qwen2_dir, device="cpu").create_engine_config()
    assert not cfg.model_config.batch_invariant


def test_mode_swaps_linears_attention_and_sampler(stories_qwen2_dir):
    from hayabusa.kernels.batch_invariant import linear_bi
    from hayabusa.quantization.base import BatchInvariantLinearMethod

    runner = _llm(stories_qwen2_dir).llm_engine.runner
    linears = [m for m in runner.model.modules() if hasattr(m, "quant_method")]
    assert linears and all(isinstance(m.quant_method, BatchInvariantLinearMethod) for m in linears)
    assert runner.model.logits_linear is linear_bi
    assert runner.backend.name == "torch-batch-invariant" and runner.sampler.batch_invariant


@pytest.mark.parametrize("kwargs,parameter", [
    (dict(quantization="int8"), "quantization"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}),
     "speculative_config"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
])
def test_mode_refuses_what_it_does_not_cover(stories_qwen2_dir, kwargs, parameter):
    from hayabusa.config import EngineArgs

    with pytest.raises(HayabusaValidationError, match="batch_invariant") as e:
        EngineArgs.from_kwargs(stories_qwen2_dir, device="cpu", batch_invariant=True,
                               **kwargs).create_engine_config()
    assert e.value.parameter == parameter


def test_batch_invariant_must_be_a_bool(stories_qwen2_dir):
    from hayabusa.config import EngineArgs

    with pytest.raises(HayabusaValidationError, match="batch_invariant"):
        EngineArgs.from_kwargs(stories_qwen2_dir, batch_invariant="yes").create_engine_config()


def test_default_mode_unchanged(stories_qwen2_dir):
    """The default mode keeps F.linear, the default backend and the default sampler."""
    runner = LLM(stories_qwen2_dir, dtype="bfloat16").llm_engine.runner
    assert runner.backend.name == "torch" and not runner.sampler.batch_invariant
    assert "logits_linear" not in vars(runner.model)
    assert type(runner.model).logits_linear is torch.nn.functional.linear


def test_invariance_experiment_runs_and_compares(stories_qwen2_dir):
    """The experiment behind tests/test_batch_invariant_cuda.py and benchmarks/batch_invariance.py, on CPU with
    two settings: every mode-on setting is identical to the alone run, and compare() finds a planted divergence."""
    from hayabusa.eval.batch_invariance import Setting, compare, run_experiment

    settings = [Setting("3 others, chunk 16", 3, {"max_num_seqs": 4, "max_num_batched_tokens": 16}),
                Setting("prefix hit, 2 others", 2, {"max_num_seqs": 4, "enable_prefix_caching": True}, True)]
    out = run_experiment(stories_qwen2_dir, settings, modes=(True,), num_tokens=6, target_len=40,
                         base={"device": "cpu", "dtype": "bfloat16", "max_model_len": 256})
    assert [o.setting for o in out] == ["alone, max_num_seqs=1"] + [s.name for s in settings]
    assert all(o.identical and o.num_tokens == 6 for o in out)
    planted = compare(([1, 2, 3], [-0.5, -1.0, -2.0]), ([1, 2, 4], [-0.5, -1.5, -2.0]), "x", False)
    assert (planted.identical, planted.first_divergent_token, planted.first_logprob_mismatch) == (False, 2, 1)
    assert planted.max_abs_logprob_diff == 0.5


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, logprobs=3),
                                    SamplingParams(temperature=0.9, top_p=0.8, min_p=0.01, seed=7, logprobs=2)])
def test_sampler_row_alone_and_in_batch_bitwise(params):
    """Sampler(batch_invariant=True): a row's token, logprobs and rank are the same bits alone and among others
    (seeded rows draw from their own generator; the softmaxes are per-row kernels)."""
    from hayabusa.sample import Sampler, build_sampling_metadata

    V = 300
    gen = torch.Generator().manual_seed(0)
    row = 3 * torch.randn(V, generator=gen)
    other = SamplingParams(temperature=1.1, top_k=40, logprobs=1)

    def run(n: int, at: int):
        logits = 3 * torch.randn(n, V, generator=gen)
        logits[at] = row
        ps = [other] * n
        ps[at] = params
        gens = [None] * n
        gens[at] = torch.Generator().manual_seed(1234)
        md = build_sampling_metadata(ps, [[1, 2]] * n, [[]] * n, gens, None, V, "cpu")
        out = Sampler(batch_invariant=True)(logits, md)
        return (out.sampled_token_ids[at].item(), out.logprob_token_ids[at].tolist(), out.logprobs[at].tolist(),
                out.sampled_token_ranks[at].item())

    alone = run(1, 0)
    for n, at in ((2, 1), (9, 4), (33, 0)):
        assert run(n, at) == alone


def test_prompt_logprobs_alone_and_batched_chunked(stories_qwen2_dir):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)

    def plp(out):
        return [None if d is None else sorted((t, lp.logprob) for t, lp in d.items()) for d in out.prompt_logprobs]

    alone = plp(_llm(stories_qwen2_dir, max_num_seqs=1).generate([TARGET], params, use_tqdm=False)[0])
    assert len(alone) == 45 and alone[0] is None and all(len(d) >= 2 for d in alone[1:])
    outs = _llm(stories_qwen2_dir, max_num_seqs=4, max_num_batched_tokens=16).generate(
        _prompts(2, 5) + [TARGET], params, use_tqdm=False)
    assert plp(outs[2]) == alone


def test_environment_variable_yields_to_an_explicit_false_and_bad_values_are_named(monkeypatch):
    """HAYABUSA_BATCH_INVARIANT decides only when batch_invariant is left at None; refusals say the variable
    turned the mode on; a value that is neither on nor off is refused naming the variable."""
    from hayabusa.batch_invariant import batch_invariant_requested

    monkeypatch.setenv("HAYABUSA_BATCH_INVARIANT", "1")
    assert batch_invariant_requested(None) and not batch_invariant_requested(False)
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=demo_model_dir(), device="cpu", quantization="int8").create_engine_config()
    assert "HAYABUSA_BATCH_INVARIANT" in str(e.value) and e.value.parameter == "quantization"
    EngineArgs(model=demo_model_dir(), device="cpu", quantization="int8", batch_invariant=False).create_engine_config()
    monkeypatch.setenv("HAYABUSA_BATCH_INVARIANT", "banana")
    with pytest.raises(HayabusaValidationError) as e:
        batch_invariant_requested(None)
    assert e.value.parameter == "HAYABUSA_BATCH_INVARIANT"


@pytest.mark.parametrize("mnbt", [13, 16, 27])
def test_logprobs_identical_when_the_prompt_is_chunked_beside_another_request(mnbt):
    """The fresh tester's case: a 31-token prompt in chunks of 13 / 16 / 27 tokens beside another request gives
    the ids and the logprobs of the prompt run alone and whole (before the fix: 1.4e-6 apart)."""
    p = "Once upon a time there was a little dog named Max who loved to run in the park with his friend"
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    alone = LLM(demo_model_dir(), batch_invariant=True, enable_prefix_caching=False).generate([p], sp,
                                                                                             use_tqdm=False)[0]
    beside = LLM(demo_model_dir(), batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=mnbt,
                 max_num_seqs=4).generate(["Lily went", p], sp, use_tqdm=False)[1]

    def lps(o):
        return [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]

    assert beside.outputs[0].token_ids == alone.outputs[0].token_ids and lps(beside) == lps(alone)


def test_vllm_variable_turns_the_mode_on_when_ours_is_unset(monkeypatch):
    """VLLM_BATCH_INVARIANT (vLLM's switch for its mode) decides when HAYABUSA_BATCH_INVARIANT is unset, read as vLLM
    reads it (an integer: nonzero on) or in our spellings; ours wins when set (empty: off); a bad value is named by
    its variable; refusals name the variable that turned it on."""
    from hayabusa.batch_invariant import batch_invariant_requested

    monkeypatch.delenv("HAYABUSA_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert not batch_invariant_requested(None)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert batch_invariant_requested(None) and not batch_invariant_requested(False)
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=demo_model_dir(), device="cpu", quantization="int8").create_engine_config()
    assert "VLLM_BATCH_INVARIANT" in str(e.value) and e.value.parameter == "quantization"
    monkeypatch.setenv("HAYABUSA_BATCH_INVARIANT", "")
    assert not batch_invariant_requested(None)
    monkeypatch.delenv("HAYABUSA_BATCH_INVARIANT")
    for raw, on in (("2", True), ("0", False), ("true", True), ("off", False), ("", False)):   # vLLM's int(), ours
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", raw)
        assert batch_invariant_requested(None) == on, raw
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "maybe")
    with pytest.raises(HayabusaValidationError) as e:
        batch_invariant_requested(None)
    assert e.value.parameter == "VLLM_BATCH_INVARIANT"


def test_refusal_names_the_variable_only_when_it_turned_the_mode_on(monkeypatch):
    """batch_invariant=True given explicitly: a refusal does not blame an environment variable that is set (even to
    off); left at None with the variable on, it does, and says how to turn the mode off."""
    monkeypatch.delenv("HAYABUSA_BATCH_INVARIANT", raising=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=demo_model_dir(), device="cpu", quantization="int8",
                   batch_invariant=True).create_engine_config()
    assert "environment" not in str(e.value) and e.value.parameter == "quantization"
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=demo_model_dir(), device="cpu", quantization="int8").create_engine_config()
    assert "VLLM_BATCH_INVARIANT" in str(e.value) and "--no-batch-invariant" in str(e.value)


@pytest.mark.parametrize("name,value", [("HAYABUSA_BI_GEMM_CONFIGS", "notjson"),
                                        ("HAYABUSA_BI_GEMM_CONFIGS", '{"*": {"FOO": 1}}'),
                                        ("HAYABUSA_BI_GEMM_CONFIGS", '{"*": {"BLOCK_K": -3}}'),
                                        ("HAYABUSA_BI_GEMM_CONFIGS", '{"896x896": {"BLOCK_K": "big"}}'),
                                        ("HAYABUSA_BI_GEMM_BUCKETS", "/nonexistent/buckets.json"),
                                        ("HAYABUSA_BI_GEMM_BUCKETS", {"896x896": [[16, {"BLOCK_Q": 16}]]}),
                                        ("HAYABUSA_BI_GEMM_BUCKETS", {"896x896": [[16, {"BLOCK_K": 32}]]})])
def test_bad_gemm_tuning_variables_are_refused_on_any_device(monkeypatch, tmp_path, name, value):
    """The CPU path ignores the GEMM's tuning variables, but a malformed one (syntax, an unknown field, a bad
    value, a bucket that changes the summation order) is refused by name when the mode is configured, so a typo
    does not wait for a GPU to show."""
    if isinstance(value, dict):
        (tmp_path / "buckets.json").write_text(json.dumps(value))
        value = str(tmp_path / "buckets.json")
    monkeypatch.setenv(name, value)
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=demo_model_dir(), device="cpu", batch_invariant=True).create_engine_config()
    assert e.value.parameter == name
    EngineArgs(model=demo_model_dir(), device="cpu").create_engine_config()     # the mode off: not read
