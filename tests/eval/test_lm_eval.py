"""lm-evaluation-harness (``lm_eval[api]``, model ``local-completions``) against ``hayabusa serve`` on the bundled
demo model: a local multiple-choice task (loglikelihood requests: echo + logprobs) and a local generate_until task
run to completion, and the multiple-choice accuracy equals the one computed from HF's float32 log-likelihoods of
the same token sequences. Slow tier; skips when lm_eval is not installed (``pip install hayabusa[lmeval]``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hayabusa.assets import demo_model_dir
from tests.entrypoints.test_serve_demo import serve_demo
from tests.helpers import _hf_model

TASKS = Path(__file__).parent / "lmeval_tasks"
LIMIT = 6

pytestmark = pytest.mark.slow


lm_eval = pytest.importorskip(
    "lm_eval", reason="lm_eval is not importable; pip install 'hayabusa[lmeval]' to run this test")


@pytest.fixture(scope="module")
def served_demo():
    """`hayabusa serve` with no model: the bundled demo model, in float32 (HF's reference precision)."""
    with serve_demo("--served-model-name", "stories", "--dtype", "float32") as (url, _):
        yield url


def _tasks_dir(tmp_path: Path) -> Path:
    data = TASKS / "stories_mc.jsonl"
    for name in ("stories_mc.yaml", "stories_gen.yaml"):
        (tmp_path / name).write_text((TASKS / name).read_text().replace("__DATA__", str(data)))
    return tmp_path


def _hf_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """lm-eval's TemplateLM._encode_pair (trailing spaces of the context move to the continuation; the
    continuation's tokens are the whole's after the context's; no special tokens), scored by HF."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def test_lm_eval_local_completions(served_demo, tmp_path):
    import lm_eval.evaluator
    import lm_eval.tasks

    manager = lm_eval.tasks.TaskManager(include_path=str(_tasks_dir(tmp_path)))
    model_args = (f"model=stories,base_url={served_demo}/v1/completions,tokenizer={demo_model_dir()},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,batch_size=4")
    results = lm_eval.evaluator.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=["hayabusa_stories_mc", "hayabusa_stories_gen"],
        task_manager=manager, limit=LIMIT, log_samples=True)
    mc_samples = results["samples"]["hayabusa_stories_mc"]
    gen_samples = results["samples"]["hayabusa_stories_gen"]
    assert len(mc_samples) == len(gen_samples) == LIMIT
    assert all(isinstance(s["resps"][0][0], str) for s in gen_samples)      # generations came back
    assert "exact_match,none" in results["results"]["hayabusa_stories_gen"]

    from transformers import AutoTokenizer

    model, tok = _hf_model(demo_model_dir()), AutoTokenizer.from_pretrained(demo_model_dir())
    correct = 0
    for s in mc_samples:
        ours = [r[0][0] for r in s["resps"]]
        ref = [_hf_loglikelihood(model, tok, *a) for a in s["arguments"]]
        assert ours == pytest.approx(ref, abs=1e-3), s["doc"]
        correct += int(max(range(len(ref)), key=ref.__getitem__) == s["target"])
    acc = results["results"]["hayabusa_stories_mc"]["acc,none"]
    assert acc == pytest.approx(correct / LIMIT)
    json.dumps(results["results"])    # the summary is plain data
