"""The eval's token-level agreement column ("differ"): per setting, the items whose output token ids differ from
the max_num_seqs=1 run. A deliberately batch-dependent toy reduction in the lm_head (each row's logits plus the
batch mean) makes batched settings differ; batch-invariant mode is not touched by it and counts 0."""

import json

import torch

from hayabusa.eval.data import load_items, load_tokenizer, render_items
from hayabusa.eval.report import format_table
from hayabusa.eval.sweep import evaluate
from hayabusa.model.llama import LlamaForCausalLM

PROMPTS = ["Once upon a time", "Tom had a red ball.", "The sun was hot and", "Lily went to the park",
           "A little dog", "The cat sat on the mat and"]


def _batch_dependent_logits(hidden, w):
    """Toy batch effect: every row's logits plus the mean logits of the step's rows."""
    logits = torch.nn.functional.linear(hidden, w)
    return logits + logits.mean(0, keepdim=True)


def _items(stories_qwen2_dir, tmp_path):
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "gold": {"name": "Lily"}}) + "\n" for p in PROMPTS))
    items = load_items(str(data), "extraction")
    tok = load_tokenizer(stories_qwen2_dir)
    render_items(items, tok)
    return items, tok


def test_differ_column_counts_batch_effects(stories_qwen2_dir, tmp_path, monkeypatch):
    items, tok = _items(stories_qwen2_dir, tmp_path)
    monkeypatch.setattr(LlamaForCausalLM, "logits_linear", staticmethod(_batch_dependent_logits))
    sweeps = ["max_num_seqs=4,1,6", "batch_invariant=false,true"]
    res = evaluate(stories_qwen2_dir, items, "extraction", {"device": "cpu", "dtype": "bfloat16"},
                   {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}, sweeps, tokenizer=tok,
                   warmup=False)
    by = {r["setting"]: r for r in res.rows}
    runs = {r.label: r for r in res.runs}
    base = runs["max_num_seqs=1,batch_invariant=False"]
    for r in res.rows:          # each mode's own max_num_seqs=1 run, though it is not the first setting
        assert r["token_baseline"] == "max_num_seqs=1," + r["setting"].split(",")[1]
    for label in ("max_num_seqs=4,batch_invariant=False", "max_num_seqs=6,batch_invariant=False"):
        differing = sum(a != b for a, b in zip(runs[label].token_ids, base.token_ids))
        assert by[label]["token_differ"] == differing > 0, label
    assert by[base.label]["token_differ"] == 0
    # the mode's lm_head (linear_bi on the instance) does not take the toy reduction: all three agree
    bi = [runs[f"max_num_seqs={n},batch_invariant=True"].token_ids for n in (1, 4, 6)]
    assert bi[0] == bi[1] == bi[2]
    assert all(by[f"max_num_seqs={n},batch_invariant=True"]["token_differ"] == 0 for n in (1, 4, 6))
    table = format_table(res.rows)
    assert "differ" in table.splitlines()[0]
    recs = [r for r in res.records if r["setting"] == "max_num_seqs=6,batch_invariant=False"]
    assert sum(bool(r["tokens_differ"]) for r in recs) == by["max_num_seqs=6,batch_invariant=False"]["token_differ"]
