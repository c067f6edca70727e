"""LLM.get_metrics() in vLLM's shape (hayabusa/metrics_reader.py): vLLM's own speculative-decoding example loop
runs unchanged but for the import; names, types and values of the metrics; the per-position acceptance counts with
pinned ids; hayabusa's older dict-style access still answers."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.metrics_reader import Counter, Gauge, Metric, MetricsList, Vector
from tests.core.test_scheduler import req
from tests.spec_decode.test_spec_scheduling import spec_scheduler

PROMPTS = ["Once upon a time", "The capital of France is", "One day, Lily and Tom", "The little dog"]
K = 3
# (the measured turn-off rule off: its per-bucket metrics are tested in test_spec_payoff.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "min_acceptance_rate": 0, "disable_by_payoff": False}
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def ngram_run(stories_dir):
    base = LLM(stories_dir, device="cpu", max_num_seqs=4).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(stories_dir, device="cpu", max_num_seqs=4, speculative_config=NGRAM)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return llm, outputs, base


def test_vllm_spec_decode_example_loop_runs_unchanged(ngram_run):
    llm, outputs, base = ngram_run
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in base]   # greedy kept
    # vLLM's examples/offline_inference/spec_decode.py, the import changed from vllm.v1.metrics.reader
    from hayabusa.v1.metrics.reader import Counter, Vector

    metrics = llm.get_metrics()
    num_drafts = 0
    num_draft_tokens = 0
    num_accepted_tokens = 0
    acceptance_counts = [0] * K
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            assert isinstance(metric, Counter)
            num_draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for pos in range(len(metric.values)):
                acceptance_counts[pos] += metric.values[pos]
    print(f"num_drafts {num_drafts}, draft tokens {num_draft_tokens}, accepted {num_accepted_tokens}, "
          f"per position {acceptance_counts}, mean acceptance length {1 + num_accepted_tokens / num_drafts:.2f}")
    assert 0 < num_drafts <= num_draft_tokens <= K * num_drafts
    assert 0 < num_accepted_tokens <= num_draft_tokens
    assert all(a >= b for a, b in zip(acceptance_counts, acceptance_counts[1:]))    # non-increasing
    assert sum(acceptance_counts) == num_accepted_tokens
    assert acceptance_counts[0] <= num_drafts
    # the engine-wide counters are the sums of the requests' own (RequestOutput.metrics)
    assert num_drafts == sum(o.metrics.spec_num_steps for o in outputs)
    assert num_draft_tokens == sum(o.metrics.spec_num_draft_tokens for o in outputs)
    assert num_accepted_tokens == sum(o.metrics.spec_num_accepted_tokens for o in outputs)


def test_metric_names_types_and_values(ngram_run):
    llm, outputs, _ = ngram_run
    m = llm.get_metrics()
    assert isinstance(m, MetricsList) and all(isinstance(x, Metric) for x in m)
    names = [x.name for x in m]
    assert len(names) == len(set(names))
    assert set(names) == {"vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions",
                          "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts",
                          "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                          "vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:num_requests_running",
                          "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                          # the CPU KV tier (swap_space, on by default): hayabusa's own, as on /metrics
                          "hayabusa:num_swap_preemptions", "hayabusa:kv_blocks_swapped_out",
                          "hayabusa:kv_blocks_swapped_in", "hayabusa:cpu_prefix_cache_hits"}
    for x in m:
        assert x.labels == {"model_name": llm.llm_engine.config.model_config.model, "engine": "0"}
        if isinstance(x, Counter):
            assert type(x.value) is int and x.value >= 0
        elif isinstance(x, Gauge):
            assert type(x.value) is float
        else:
            assert isinstance(x, Vector) and len(x.values) == K and all(type(v) is int for v in x.values)
    assert m.by_name("vllm:prompt_tokens").value == sum(len(o.prompt_token_ids) for o in outputs)
    assert m.by_name("vllm:generation_tokens").value == len(PROMPTS) * PARAMS.max_tokens
    # all requests done: nothing running or waiting, no KV block held
    assert [m.by_name(f"vllm:num_requests_{s}").value for s in ("running", "waiting")] == [0.0, 0.0]
    assert m.by_name("vllm:kv_cache_usage_perc").value == 0.0
    with pytest.raises(KeyError, match="vllm:nope"):
        m.by_name("vllm:nope")


def test_dict_style_shorthand_still_answers(ngram_run):
    llm, _, _ = ngram_run
    m = llm.get_metrics()
    assert set(m.keys()) == {"num_prompt_tokens", "num_generation_tokens", "num_preemptions",
                             "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                             "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
                             "num_swap_preemptions", "num_blocks_swapped_out", "num_blocks_swapped_in",
                             "cpu_prefix_cache_hit_blocks"}
    assert m["spec_decode_num_accepted_tokens"] == m.by_name("vllm:spec_decode_num_accepted_tokens").value > 0
    assert m["spec_decode_num_draft_tokens"] == m.by_name("vllm:spec_decode_num_draft_tokens").value
    assert m["num_prompt_tokens"] == m.by_name("vllm:prompt_tokens").value
    assert m["spec_decode_num_accepted_tokens_per_pos"] == m.by_name(
        "vllm:spec_decode_num_accepted_tokens_per_pos").values
    assert dict(m.items()) == m.as_dict() and list(m.values()) == [m[k] for k in m.keys()]
    assert m["num_blocks_swapped_out"] == m.by_name("hayabusa:kv_blocks_swapped_out").value
    assert "num_preemptions" in m and "vllm:prompt_tokens" not in m and m.get("prompt_tokens") is None
    assert m.get("prompt_tokens", -1) == -1
    assert isinstance(m[0], Metric) and m[0] in m and len(m[:2]) == 2     # ints and slices index the list
    with pytest.raises(KeyError, match="prompt_tokens"):
        m["prompt_tokens"]
    assert llm.llm_engine.get_metrics() == m                               # LLMEngine answers the same


def test_without_speculation_or_cpu_tier(tiny_qwen2):
    llm = LLM(tiny_qwen2, device="cpu", swap_space=0)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    m = llm.get_metrics()
    assert set(m.keys()) == {"num_prompt_tokens", "num_generation_tokens", "num_preemptions"}
    assert not [x.name for x in m if "spec_decode" in x.name or x.name.startswith("hayabusa:")]
    assert m["num_generation_tokens"] == m.by_name("vllm:generation_tokens").value == 8


def test_vllm_import_path_is_the_same_classes():
    import hayabusa.metrics_reader as ours
    from hayabusa.v1.metrics import reader

    for name in ("Metric", "Counter", "Gauge", "Vector", "Histogram"):
        assert getattr(reader, name) is getattr(ours, name)
    h = reader.Histogram(name="vllm:x", labels={}, count=3, sum=1.5, buckets={"1.0": 2, "+Inf": 3})
    assert isinstance(h, Metric) and (h.count, h.sum, h.buckets["+Inf"]) == (3, 1.5, 3)


def test_per_position_counts_with_pinned_ids():
    s = spec_scheduler([50, 51, 52], k=K)
    a = req("a", 6, max_tokens=30)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": [9]})                        # prefill: no proposals
    for sampled in ([50, 60], [50, 51, 52, 7], [70]):                      # 1, 3 then 0 accepted
        out = s.schedule()
        assert out.scheduled_spec_decode_tokens == {"a": [50, 51, 52]}
        s.update_from_output(out, {"a": sampled})
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (3, 9, 4)
    assert s.spec_num_accepted_tokens_per_pos == [2, 1, 1]


def _vllm_loop(metrics) -> tuple[int, int, int, list[int]]:
    """vLLM's example loop over get_metrics(): (num_drafts, draft tokens, accepted tokens, per-position counts)."""
    from hayabusa.v1.metrics.reader import Counter, Vector

    num_drafts = num_draft_tokens = num_accepted_tokens = 0
    acceptance_counts: list[int] = []
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            assert isinstance(metric, Counter)
            num_draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            acceptance_counts = list(metric.values)
    return num_drafts, num_draft_tokens, num_accepted_tokens, acceptance_counts


def test_draft_model_as_its_own_draft_accepts_at_every_position(tiny_llama):
    """Every proposal accepted: position 0 is accepted once per draft, and the counts sum to the draft tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(tiny_llama, device="cpu", max_num_seqs=4,
              speculative_config={"model": tiny_llama, "num_speculative_tokens": K})
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    drafts, draft_tokens, accepted, per_pos = _vllm_loop(llm.get_metrics())
    assert drafts == sum(o.metrics.spec_num_steps for o in outputs) > 0
    assert accepted == draft_tokens and per_pos[0] == drafts and sum(per_pos) == accepted and len(per_pos) == K
