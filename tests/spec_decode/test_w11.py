"""W11 (copy-heavy extraction) as the bench builds it: deterministic text prompts whose answer starts a copy."""

from __future__ import annotations

from hayabusa.bench.runner import bench_prompts, warmup_requests
from hayabusa.bench.workloads import get_workload


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt and len(messages) == 1
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_w11_requests_are_fixed_and_render_with_the_answer_start():
    w = get_workload("W11")
    assert len(w.requests) == 64 and [v["max_num_seqs"] for v in w.variants] == [1, 4, 16]
    assert w.has_text and not w.has_images and w.max_seq_len == 2048
    r = w.requests[0]
    assert r.max_tokens == 128 and r.text.count("\n") == 41 and r.text.startswith("Order ")
    # the answer prefix is the start of a line of the document (one of the requested city's orders)
    assert r.answer_prefix.startswith("Order ") and r.answer_prefix in r.text
    assert get_workload("W11").requests[5].text == w.requests[5].text          # same rng, same prompts
    prompt = bench_prompts(FakeTokenizer(), [r])[0]["prompt"]
    assert prompt.endswith("</user><assistant>" + r.answer_prefix)
    assert all(q.text and q.answer_prefix for q in warmup_requests(w))


def test_a_tokenizer_without_a_chat_template_is_named():
    """W11 on a base model's tokenizer: a HayabusaValidationError naming ``model``, not transformers' bare
    ValueError (found by a fresh user)."""
    import pytest
    from transformers import AutoTokenizer

    from hayabusa.errors import HayabusaValidationError
    from tests.conftest import TOKENIZERS, require_asset

    tok = AutoTokenizer.from_pretrained(str(require_asset(TOKENIZERS / "llm-jp-v3.1")))
    tok.chat_template = None
    with pytest.raises(HayabusaValidationError, match="chat template") as e:
        bench_prompts(tok, get_workload("W11").requests[:1])
    assert e.value.parameter == "model"


def test_w11_records_carry_tpot_the_issue_measures():
    """Issue #21's W11 target is TPOT at batch 1: a W11 record keeps the run's median TPOT (W1 does not: a
    throughput workload)."""
    from hayabusa.bench.report import make_record
    from hayabusa.bench.runner import RunResult

    res = RunResult(elapsed_s=2.0, num_requests=4, num_sequences=4, prompt_tokens=400, output_tokens=512,
                    startup_s=1.0, ttft_ms=12.5, tpot_ms=0.75, tpot_mean_ms=0.6)
    env = {"gpu": "cpu", "commit": "x", "date": "d", "versions": {}}
    for name, tpot, mean in (("W11", 0.75, 0.6), ("W1", None, None)):
        rec = make_record(get_workload(name, 0.02 if name == "W1" else 1.0), res, engine="hayabusa", model="m",
                          engine_args={}, env=env, variant={})
        assert rec["tpot_ms"] == tpot and rec["tpot_mean_ms"] == mean
        assert rec["ttft_ms"] == 12.5 and rec["output_throughput"] == 256.0
