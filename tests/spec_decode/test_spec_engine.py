"""Speculative decoding in the engine: greedy token ids never change (n-gram and an oracle proposer that is right
for a while then wrong), under batching, preemption, prefix caching, chunked prefill; max_tokens and stop tokens
inside an accepted run; metrics; config errors."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In 1905, Albert Einstein published",
           "吾輩は猫である。名前はまだ無い。", "東京は日本の首都で、", "今日はいい天気ですね。"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = 24


class OracleProposer:
    """Proposes the reference continuation (from a run without speculation), corrupting every third proposal run
    after its first ``right`` tokens: exercises acceptance of full runs, partial runs and rejections at once."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences
        self.calls = 0

    def propose(self, token_ids, k: int) -> list[int]:
        ids = list(token_ids)
        for seq in self.sequences:
            if seq[:len(ids)] == ids:
                drafts = seq[len(ids):len(ids) + k]
                self.calls += 1
                right = self.calls % 3          # 0: all wrong from the start, 1 / 2: that many right first
                if self.calls % 4 and right < len(drafts):
                    drafts = drafts[:right] + [(t + 1) % 1000 for t in drafts[right:]]
                return drafts
        return []


class RepeatProposer:
    def propose(self, token_ids, k: int) -> list[int]:
        return list(token_ids[-k:])


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama, tiny_qwen2):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    refs = {}
    for name, path in (("llama", tiny_llama), ("qwen2", tiny_qwen2)):
        outs = LLM(path, max_num_seqs=16, device="cpu").generate(PROMPTS, params, use_tqdm=False)
        refs[name] = (path, outs)
    return refs


def _oracle_llm(path: str, outs, spec: dict | None = None, **kwargs) -> tuple[LLM, OracleProposer]:
    """``spec``: more speculative_config keys (e.g. ``{"disable_by_payoff": False}`` where a test compares the
    proposals of two runs of one engine: the measured rule would make them depend on timing)."""
    llm = LLM(path, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3, **(spec or {})},
              **kwargs)
    oracle = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids for o in outs])
    llm.llm_engine.scheduler.spec.proposer = oracle
    return llm, oracle


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_oracle_proposals_keep_greedy_output(reference, arch, max_num_seqs):
    path, outs = reference[arch]
    llm, oracle = _oracle_llm(path, outs, max_num_seqs=max_num_seqs)
    spec = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert _ids(spec) == _ids(outs)
    assert llm.llm_engine.runner.num_greedy_verify_steps > 0   # the greedy verify path (kernels/greedy_verify.py)
    m = llm.get_metrics()
    assert oracle.calls > 0 and m["spec_decode_num_draft_tokens"] > 0
    # some proposals accepted, some rejected
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert sum(o.metrics.spec_num_accepted_tokens for o in spec) == m["spec_decode_num_accepted_tokens"]
    # fewer steps than tokens: accepted runs emit several tokens per step
    assert llm.llm_engine.stats["num_steps"] < len(PROMPTS) * MAX_TOKENS / max_num_seqs + len(PROMPTS)


@pytest.mark.parametrize("feature", ["preempt", "prefix_caching", "chunked_prefill"])
def test_oracle_proposals_keep_greedy_output_under(reference, feature):
    path, outs = reference["llama"]
    kwargs = {"preempt": dict(max_num_seqs=8, num_gpu_blocks_override=20, block_size=4, max_model_len=64),
              "prefix_caching": dict(max_num_seqs=4, enable_prefix_caching=True, block_size=4),
              "chunked_prefill": dict(max_num_seqs=4, max_num_batched_tokens=8)}[feature]
    llm, _ = _oracle_llm(path, outs, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = PROMPTS + PROMPTS[:2] if feature == "prefix_caching" else PROMPTS
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(spec)[:len(PROMPTS)] == _ids(outs)
    if feature == "prefix_caching":
        assert _ids(spec)[len(PROMPTS):] == _ids(outs)[:2]
        spec2 = llm.generate(PROMPTS, params, use_tqdm=False)     # now with prefix hits
        assert _ids(spec2) == _ids(outs)
        assert llm.llm_engine.kv_cache_manager.num_hit_tokens > 0
    if feature == "preempt":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0


def test_max_tokens_and_stop_token_inside_accepted_run(reference):
    path, outs = reference["qwen2"]
    llm, _ = _oracle_llm(path, outs, max_num_seqs=4)
    ref = outs[0].outputs[0].token_ids
    # max_tokens 7: proposals never run past it; the output is the reference's first 7 tokens
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[:7] and out[0].outputs[0].finish_reason == "length"
    # a stop token at reference position 9 ends the request there even inside an accepted run
    stop = ref[9]
    first = ref.index(stop)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                                                   ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[:first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop


def test_mixed_step_with_penalties_logprobs_and_structured_requests(reference):
    from hayabusa.sampling_params import StructuredOutputsParams

    path, outs = reference["llama"]
    # requests that get no proposals (penalty, logprobs, a choice constraint) share steps with ones that do
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in PROMPTS]
    params[1] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    params[2] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    params[3] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                               structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    base = LLM(path, max_num_seqs=16, device="cpu").generate(PROMPTS, params, use_tqdm=False)
    llm, _ = _oracle_llm(path, outs, max_num_seqs=16)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(spec) == _ids(base)
    assert _ids(spec)[0] == _ids(outs)[0] and spec[3].outputs[0].text in ("yes", "no")
    assert [len(o.outputs[0].logprobs) for o in (base[1], spec[1])] == [MAX_TOKENS, MAX_TOKENS]
    for a, b in zip(spec[1].outputs[0].logprobs, base[1].outputs[0].logprobs):   # same tokens and ranks; the
        assert a.keys() == b.keys()                                             # values up to float rounding
        assert all(a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert [spec[i].metrics.spec_num_draft_tokens for i in (1, 2, 3)] == [0, 0, 0]
    assert spec[0].metrics.spec_num_draft_tokens > 0


def test_ngram_keeps_greedy_output(reference):
    path, outs = reference["qwen2"]
    llm = LLM(path, max_num_seqs=3, device="cpu", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == _ids(outs)
    assert llm.llm_engine.runner.num_greedy_verify_steps > 0


def test_batched_ngram_lookups_keep_greedy_output_and_proposals(reference):
    """The scheduler's batched n-gram lookups (SpecDecodeScheduling.lookup_all) against the same proposer called
    per request: the same token ids as without speculation, and the same proposals verified and accepted."""
    path, outs = reference["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for batched in (True, False):
        # (the measured turn-off rule off: the proposal counts compared must not depend on timing)
        llm = LLM(path, max_num_seqs=4, device="cpu", speculative_config=dict(NGRAM, disable_by_payoff=False))
        spec = llm.llm_engine.scheduler.spec
        if not batched:
            proposer = spec.proposer
            spec.proposer = type("SingleOnly", (), {"propose": staticmethod(proposer.propose)})()
        ids = _ids(llm.generate(PROMPTS, params, use_tqdm=False))
        m = llm.get_metrics()
        runs.append((ids, m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]))
    assert runs[0][0] == _ids(outs) and runs[0] == runs[1]
    assert runs[0][1] > 0


def test_sampling_with_seed_is_reproducible(reference):
    path, outs = reference["llama"]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm, _ = _oracle_llm(path, outs, max_num_seqs=4)
        # sampled text leaves the greedy reference at once: propose the last tokens again (some get accepted)
        llm.llm_engine.scheduler.spec.proposer = RepeatProposer()
        runs.append(_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False)))
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert runs[0] == runs[1]
    assert all(len(ids) == 12 for ids in runs[0])


@pytest.mark.parametrize("config, parameter", [
    ({"method": "lookahead", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "speculative_config.bogus"),
])
def test_bad_config_is_named(tiny_llama, config, parameter):
    with pytest.raises(HayabusaValidationError) as e:
        LLM(tiny_llama, device="cpu", speculative_config=config)
    assert e.value.parameter == parameter
    if "method" in parameter:
        assert config["method"] in str(e.value)


def test_more_proposals_than_the_context_holds_is_refused_by_name(tiny_llama):
    # k >= max_model_len can never be verified (a request holds at most max_model_len - 1 tokens after its
    # first); accepted, it sized per-step buffers by k (R x (k + 1) pinned ints on CUDA) and a metric vector of
    # length k. The error names the key and the bound; k = max_model_len - 1 still runs.
    for k in (64, 10**9):
        with pytest.raises(HayabusaValidationError, match="max_model_len") as e:
            LLM(tiny_llama, device="cpu", max_model_len=64,
                speculative_config={"method": "ngram", "num_speculative_tokens": k})
        assert e.value.parameter == "speculative_config.num_speculative_tokens"
        assert str(k) in str(e.value) and "64" in str(e.value)
    llm = LLM(tiny_llama, device="cpu", max_model_len=64, speculative_config={"method": "ngram",
                                                                               "num_speculative_tokens": 63})
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_turn_off_rule_by_batch_size(reference):
    path, outs = reference["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for limit, expect_drafts in ((len(PROMPTS) - 1, False), (len(PROMPTS), True)):
        llm = LLM(path, device="cpu", max_num_seqs=16, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": limit})
        llm.llm_engine.scheduler.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids
                                                                 for o in outs])
        # all requests run together to the end: above the limit no step gets proposals, at it every step may
        assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == _ids(outs)
        assert (llm.get_metrics()["spec_decode_num_draft_tokens"] > 0) == expect_drafts


def test_speculative_config_from_cli_json(tiny_llama):
    import argparse

    from hayabusa.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                            "--device", "cpu"])
    cfg = EngineArgs.from_cli_args(ns, model=tiny_llama).create_engine_config()
    spec = cfg.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 2, 5, 5)
    assert cfg.async_scheduling is False
    only_max = EngineArgs.from_kwargs(tiny_llama, device="cpu", speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}).create_engine_config()
    assert (only_max.speculative_config.prompt_lookup_min, only_max.speculative_config.prompt_lookup_max) == (3, 3)


def test_metrics_endpoint_exports_spec_counters():
    from hayabusa.entrypoints.openai.server import _EngineCollector

    class FakeEngine:
        def get_stats(self):
            return {"num_requests_running": 1, "num_requests_waiting": 0, "kv_cache_usage": 0.5,
                    "num_prompt_tokens": 10, "num_generation_tokens": 20, "num_preemptions": 0,
                    "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 7}

    families = {f.name: f for f in _EngineCollector(FakeEngine(), {"model_name": "m"}).collect()}
    assert families["hayabusa:spec_decode_num_draft_tokens"].samples[0].value == 12
    assert families["hayabusa:spec_decode_num_accepted_tokens"].samples[0].value == 7


def test_speculative_decoding_with_tensor_parallelism_is_refused_by_name(tiny_llama):
    # refused while the engine's config is built, before any worker process starts
    with pytest.raises(HayabusaValidationError, match="not supported yet") as e:
        LLM(tiny_llama, tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert e.value.parameter == "speculative_config"
