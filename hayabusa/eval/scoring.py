"""Scoring of model answers: JSON extraction (field-level exact match), multiple choice, majority vote.

Everything here is plain Python on strings and parsed JSON, so it is tested on hand-made answers.

Extraction (the metric the document-extraction users report: correct fields / all gold fields):
  - the answer is the first JSON object in the text: inside a ```json fence if there is one, else the first ``{``
    from which a JSON object decodes (prose before and after is ignored); none -> "unparsable";
  - gold and answer are flattened to leaf fields (``a.b``, ``items[0].name``); a gold field is correct when the
    answer has the same path with the same value and the same JSON type (``"1200"`` is not ``1200``; ``1200`` is
    ``1200.0``; ``true`` is not ``1``); extra answer fields do not lower the score but are counted.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_FENCE = re.compile(r"```(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_MISSING = object()


# ------------------------------------------------------------------------------------------------ extraction
def parse_json_answer(text: str) -> dict[str, Any] | None:
    """The first JSON object in `text` (fenced or in prose), or None when there is none."""
    for block in _FENCE.findall(text):
        obj = _first_object(block)
        if obj is not None:
            return obj
    return _first_object(text)


def _first_object(text: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return obj
        start = text.find("{", start + 1)
    return None


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf fields of a JSON value: {"a": {"b": 1}, "c": [2]} -> {"a.b": 1, "c[0]": 2}. Empty containers are
    leaves (so an expected empty list must be answered with an empty list)."""
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and obj:
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def same_value(a: Any, b: Any) -> bool:
    """JSON equality that respects types: numbers compare by value (1 == 1.0), bools only with bools, strings
    exactly."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def field_key(path: str) -> str:
    """Per-field aggregation key: list indices dropped ("items[3].name" -> "items[].name")."""
    return re.sub(r"\[\d+\]", "[]", path)


@dataclass
class ExtractionScore:
    """One answer scored against one gold object."""

    parsable: bool
    correct: int                      # gold fields answered with the right value and type
    total: int                        # gold fields
    fields: dict[str, bool]           # gold path -> correct
    missing: list[str] = field(default_factory=list)     # gold paths absent from the answer
    wrong_type: list[str] = field(default_factory=list)  # present, equal as text, but another JSON type
    extra: list[str] = field(default_factory=list)       # answer paths not in the gold object
    answer: dict[str, Any] | None = None

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 1.0


def score_extraction(text: str, gold: dict[str, Any]) -> ExtractionScore:
    """Field-level exact match of the JSON object in `text` against `gold`."""
    answer = parse_json_answer(text)
    gold_flat = flatten(gold)
    if answer is None:
        return ExtractionScore(False, 0, len(gold_flat), {k: False for k in gold_flat}, missing=list(gold_flat))
    pred = flatten(answer)
    fields, missing, wrong_type = {}, [], []
    for path, g in gold_flat.items():
        p = pred.get(path, _MISSING)
        ok = p is not _MISSING and same_value(p, g)
        fields[path] = ok
        if p is _MISSING:
            missing.append(path)
        elif not ok and _as_text(p) == _as_text(g):
            wrong_type.append(path)
    extra = [p for p in pred if p not in gold_flat]
    return ExtractionScore(True, sum(fields.values()), len(gold_flat), fields, missing, wrong_type, extra, answer)


def _as_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def field_agreement(a: dict[str, Any] | None, b: dict[str, Any] | None, gold: dict[str, Any]) -> float:
    """Fraction of gold fields on which two answers agree (both absent counts as agreeing)."""
    fa, fb = flatten(a) if a is not None else {}, flatten(b) if b is not None else {}
    paths = list(flatten(gold))
    if not paths:
        return 1.0
    same = 0
    for p in paths:
        x, y = fa.get(p, _MISSING), fb.get(p, _MISSING)
        same += (x is _MISSING and y is _MISSING) or (x is not _MISSING and y is not _MISSING and same_value(x, y))
    return same / len(paths)


# ------------------------------------------------------------------------------------------------ final answers
_NUM = r"-?\d[\d,]*(?:\.\d+)?"


def extract_final_answer(text: str) -> str | None:
    """The final answer of a worked solution, normalised (see normalize_answer), or None.

    Looked for in this order: ``#### X`` (GSM8K), the last ``\\boxed{X}``, ``answer is X`` / ``Answer: X`` /
    ``答え(は)X`` / ``答:X``, else the last number in the text."""
    m = re.findall(r"####\s*([^\n]+)", text)
    if m:
        return normalize_answer(m[-1])
    boxed = _last_boxed(text)
    if boxed is not None:
        return normalize_answer(boxed)
    m = re.findall(r"(?:answer is|answer:|Answer:|ANSWER:|答えは|答え[:：]|答[:：])\s*\$?\s*([^\n]+)", text)
    if m:
        num = re.findall(_NUM, m[-1])
        return normalize_answer(num[0] if num else m[-1])
    nums = re.findall(_NUM, unicodedata.normalize("NFKC", text))
    return normalize_answer(nums[-1]) if nums else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_answer(ans: Any) -> str:
    """Canonical text of an answer: NFKC, trimmed, trailing period and ``$`` dropped; numbers without thousands
    separators and trailing zeros ("1,000.50" -> "1000.5", "3.0" -> "3")."""
    s = unicodedata.normalize("NFKC", str(ans)).strip().rstrip(".。").strip().lstrip("$").strip()
    num = s.replace(",", "")
    if re.fullmatch(r"-?\d+(?:\.\d+)?", num):
        if "." in num:
            num = num.rstrip("0").rstrip(".")
        return "0" if num in ("-0", "") else num
    return s


def majority_vote(answers: list[str | None]) -> str | None:
    """The most common non-None answer; ties go to the one seen first; None when every answer is None."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


# ------------------------------------------------------------------------------------------------ multiple choice
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def choice_letter(gold: Any, choices: list[str] | None = None) -> str:
    """Gold answer as a letter: "B", "b", "(B)", 1 (0-based index) or the text of a choice."""
    if isinstance(gold, bool):
        raise ValueError(f"choice answer {gold!r} is not a letter, an index or a choice text.")
    if isinstance(gold, int):
        return LETTERS[gold]
    s = str(gold).strip().strip("()").strip()
    if len(s) == 1 and s.upper() in LETTERS:
        return s.upper()
    if choices and s in choices:
        return LETTERS[choices.index(s)]
    raise ValueError(f"choice answer {gold!r} is not a letter, an index or one of the choices.")


def parse_choice(text: str, choices: list[str] | None = None, num_choices: int | None = None) -> str | None:
    """The letter the model chose, or None.

    Tried in order: "Answer: B" / "answer is (B)" / "答え: B"; a letter alone at the start ("B", "(B)", "B."); the
    first standalone valid letter; else the one choice whose text appears in the answer."""
    n = len(choices) if choices else (num_choices or 4)
    valid = LETTERS[:n]
    t = unicodedata.normalize("NFKC", text).strip()
    pats = [rf"(?:answer is|answer:|Answer:|ANSWER:|答えは|答え:|正解は|正解:)\s*\(?([{valid}])\b",
            rf"^\(?([{valid}])(?:[).:\s]|$)", rf"\b([{valid}])\b"]
    for pat in pats:
        m = re.search(pat, t)
        if m:
            return m.group(1)
    if choices:
        hits = [i for i, c in enumerate(choices) if c and c in t]
        if len(hits) == 1:
            return LETTERS[hits[0]]
    return None
