"""Score one run (the outputs of one setting) on a task and summarise it into one table row.

A run gives, per item, the texts of its samples (or an error such as "prompt too long"). ``score_run`` turns them
into per-item results (what the results JSONL holds) and ``summarize`` into accuracy, unparsable count, per-field
accuracy and agreement with a reference run.
"""

from __future__ import annotations

from typing import Any

from hayabusa.eval.data import EvalItem
from hayabusa.eval.scoring import (extract_final_answer, field_agreement, field_key, flatten, majority_vote,
                                   parse_choice, score_extraction)


def score_item(task: str, item: EvalItem, texts: list[str]) -> dict[str, Any]:
    """Per-item result: {"answer", "correct" (0..1), "parsable", ...task-specific fields}."""
    if task == "extraction":
        s = score_extraction(texts[0], item.gold)
        return {"answer": s.answer, "correct": s.accuracy, "parsable": s.parsable, "correct_fields": s.correct,
                "total_fields": s.total, "fields": s.fields, "missing": s.missing, "wrong_type": s.wrong_type,
                "extra_fields": s.extra}
    if task == "choice":
        letter = parse_choice(texts[0], item.choices)
        return {"answer": letter, "correct": float(letter == item.gold), "parsable": letter is not None}
    answers = [extract_final_answer(t) for t in texts]
    vote = majority_vote(answers)
    return {"answer": vote, "correct": float(vote == item.gold), "parsable": vote is not None,
            "sample_answers": answers}


def score_run(task: str, items: list[EvalItem], texts: list[list[str] | None],
              errors: dict[int, str]) -> list[dict[str, Any]]:
    """Per-item results of a run; an item with an error (or no texts) scores 0 and is marked unparsable."""
    out = []
    for i, it in enumerate(items):
        if i in errors or not texts[i]:
            res: dict[str, Any] = {"answer": None, "correct": 0.0, "parsable": False,
                                   "error": errors.get(i, "no output")}
            if task == "extraction":
                gold = flatten(it.gold)
                res.update(correct_fields=0, total_fields=len(gold), fields={k: False for k in gold})
        else:
            res = score_item(task, it, texts[i])
        out.append(res)
    return out


def _has_answer(task: str, answer: Any, gold: Any) -> bool:
    """An answer to compare: for extraction a JSON value holding at least one of the gold fields."""
    if answer is None:
        return False
    if task != "extraction":
        return True
    fields = flatten(answer)
    return any(p in fields for p in flatten(gold))


def agreement(task: str, items: list[EvalItem], results: list[dict[str, Any]],
              ref_results: list[dict[str, Any]]) -> list[float | None]:
    """Per item: agreement of the answer with the reference's (field level for extraction, else 0/1); None when
    either side has no output for the item, or neither side's output had an answer (extraction: no gold field in
    either; two unparsable outputs agree on nothing: counted as agreeing, a run of garbage read as 1.000)."""
    out: list[float | None] = []
    for it, r, ref in zip(items, results, ref_results):
        if "error" in r or "error" in ref or not (_has_answer(task, r["answer"], it.gold)
                                                 or _has_answer(task, ref["answer"], it.gold)):
            out.append(None)
        elif task == "extraction":
            out.append(field_agreement(r["answer"], ref["answer"], it.gold))
        else:
            out.append(float(r["answer"] == ref["answer"]))
    return out


def summarize(task: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """accuracy (extraction: correct fields / all gold fields over the set), items_all_correct, unparsable,
    num_errors, and per_field accuracy for extraction."""
    n = len(results)
    summary: dict[str, Any] = {
        "num_items": n, "unparsable": sum(not r["parsable"] and "error" not in r for r in results),
        "num_errors": sum("error" in r for r in results),
        "items_all_correct": sum(r["correct"] == 1.0 for r in results)}
    if task == "extraction":
        total = sum(r["total_fields"] for r in results)
        summary["accuracy"] = sum(r["correct_fields"] for r in results) / total if total else 0.0
        summary["num_fields"] = total
        per: dict[str, list[int]] = {}
        for r in results:
            for path, ok in r["fields"].items():
                c = per.setdefault(field_key(path), [0, 0])
                c[0] += ok
                c[1] += 1
        summary["per_field"] = {k: round(c / t, 4) for k, (c, t) in per.items()}
    else:
        summary["accuracy"] = sum(r["correct"] for r in results) / n if n else 0.0
    return summary


def text_agreement(texts: list[list[str] | None], ref_texts: list[list[str] | None]) -> float | None:
    """Fraction of items whose first sample's text equals the reference's exactly (items both have)."""
    pairs = [(a[0], b[0]) for a, b in zip(texts, ref_texts) if a and b]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None
