"""``evaluate``: run a task over a grid of settings (engine arguments x sampling settings), optionally against the
HF reference, and return one row per setting plus the per-item records.

``--sweep key=v1,v2`` may be given several times; the grid is their product, in the order given. A key is an
engine argument (any ``EngineArgs`` field: max_num_seqs, enforce_eager, enable_prefix_caching, quantization,
kv_cache_dtype, dtype, ...) or a ``SamplingParams`` field (temperature, top_p, max_tokens, n, ...). Values:
``none``/``null`` -> None, ``true/false/on/off/yes/no`` -> bool, then int, float, else the string.

Accuracy of a setting is compared with the reference accuracy: the HF run with ``--reference hf``, else the first
setting that ran; a setting more than ``tolerance`` below it is flagged. Agreement is measured against the same
reference's answers.

Token-level agreement (the "differ" column, ``token_differ`` in the JSON): per hayabusa setting, how many items'
output token ids differ from those of its token baseline: the same setting with max_num_seqs=1 (else the first
hayabusa setting with max_num_seqs=1, else the first that ran). A batch effect (a kernel whose result depends on
the other requests) shows here at once, before it moves accuracy; with ``batch_invariant=True`` the count must be 0.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from hayabusa.config import EngineArgs, cli_arg_type, optional_field
from hayabusa.envs import parse_sweep_switch
from hayabusa.errors import HayabusaValidationError
from hayabusa.eval import report, tasks
from hayabusa.eval.data import EvalItem
from hayabusa.eval.runner import RunOutput, run_hayabusa, run_hf
from hayabusa.sampling_params import ENGINE_FILLED_FIELDS, SamplingParams

ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams) if f.init} - ENGINE_FILLED_FIELDS
# true / false switches: a sweep's 1 / 0 for them means on / off (as HAYABUSA_BATCH_INVARIANT=1 does)
_SWITCHES = [f for f in (*dataclasses.fields(EngineArgs), *dataclasses.fields(SamplingParams))
             if cli_arg_type(f) == "bool"]
BOOL_KEYS = {f.name for f in _SWITCHES}
# ... of which these also take none (their default, e.g. batch_invariant=None: the environment variable decides)
NULLABLE_BOOL_KEYS = {f.name for f in _SWITCHES if optional_field(f)}


def parse_value(text: str) -> Any:
    t = text.strip()
    low = t.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "on", "yes"):
        return True
    if low in ("false", "off", "no"):
        return False
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse_sweeps(specs: list[str] | None) -> list[dict[str, Any]]:
    """["max_num_seqs=1,16", "enforce_eager=true,false"] -> the grid of overrides ([{}] without sweeps).

    Raises:
        HayabusaValidationError: a spec without "=", no values, a key that is neither an engine argument nor
            a sampling parameter, or a switch's value that is not on / off (1 / true / yes / on, 0 / false / no /
            off; none too for a switch whose default is None).
    """
    axes: list[tuple[str, list[Any]]] = []
    for spec in specs or []:
        if "=" not in spec:
            raise HayabusaValidationError(f"--sweep {spec!r}: write KEY=V1,V2 (e.g. max_num_seqs=1,4,16).",
                                          parameter="sweep", value=spec)
        key, values = spec.split("=", 1)
        key = key.strip().replace("-", "_")
        if key not in ENGINE_KEYS | SAMPLING_KEYS:
            raise HayabusaValidationError(
                f"--sweep key {key!r} is neither an engine argument nor a sampling parameter. Engine: "
                f"{', '.join(sorted(ENGINE_KEYS))}. Sampling: {', '.join(sorted(SAMPLING_KEYS))}.",
                parameter="sweep", value=key)
        if key in BOOL_KEYS:   # on / off as the environment variables take them; none where None is the default
            vals = [parse_sweep_switch(v, key, key in NULLABLE_BOOL_KEYS) for v in values.split(",") if v.strip()]
        else:
            vals = [parse_value(v) for v in values.split(",") if v.strip()]
        if not vals:
            raise HayabusaValidationError(f"--sweep {spec!r} has no values.", parameter="sweep", value=spec)
        axes.append((key, vals))
    if not axes:
        return [{}]
    return [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]


def setting_label(setting: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "default"


@dataclass
class EvalResult:
    rows: list[dict[str, Any]]                        # one per run, reference first when there is one
    records: list[dict[str, Any]]                     # one per (run, item)
    reference: str | None                             # label of the reference run
    reference_accuracy: float | None
    runs: list[RunOutput] = field(default_factory=list)


def evaluate(model: str, items: list[EvalItem], task: str, engine_args: dict[str, Any],
             sampling: dict[str, Any], sweeps: list[str] | None = None, reference: str | None = None,
             tolerance: float = 0.02, tokenizer: Any = None, hf_batch_size: int = 1, sampling_seed: int = 0,
             warmup: bool = True, use_tqdm: bool = False, schemas: list[dict] | None = None) -> EvalResult:
    """Run every setting of the grid (and the HF reference when reference == "hf"); score, compare, flag.

    ``schemas`` (one JSON schema per item): every setting runs twice, as is and with each item's output
    constrained to its schema (label ``... +schema``), so the table shows parse failures with and without it.

    Items must already carry prompt_token_ids (``data.render_items``). Settings that fail become error rows."""
    grid = parse_sweeps(sweeps)
    runs: list[RunOutput] = []
    if reference == "hf":
        report.say("running the HF Transformers reference (greedy) ...")
        runs.append(run_hf(model, items, tokenizer, sampling.get("max_tokens") or 256,
                           dtype=_engine_dtype(model, engine_args), device=engine_args.get("device"),
                           batch_size=hf_batch_size, max_model_len=engine_args.get("max_model_len")))
    elif reference not in (None, "first"):
        raise HayabusaValidationError(f"--reference must be 'hf' (or omitted), got {reference!r}.",
                                      parameter="reference", value=reference)
    for k, setting in enumerate(grid):
        label = setting_label(setting)
        report.say(f"setting {k + 1}/{len(grid)}: {label}")
        eng = {**engine_args, **{key: v for key, v in setting.items() if key in ENGINE_KEYS}}
        samp = {**sampling, **{key: v for key, v in setting.items() if key in SAMPLING_KEYS}}
        for constrained in ((False, True) if schemas else (False,)):
            name = label + " +schema" if constrained else label
            runs.append(run_hayabusa(model, items, eng, samp, name, setting, sampling_seed, warmup, use_tqdm,
                                     schemas if constrained else None))
            if runs[-1].error:
                report.say(f"setting {name} failed: {runs[-1].error}")
    return _score_runs(task, items, runs, tolerance)


def token_baseline(runs: list[RunOutput], run: RunOutput) -> int | None:
    """Index of the run that ``run``'s "differ" column compares with: the hayabusa run without error whose setting
    is ``run``'s with max_num_seqs=1 (same schema constraint), else the first hayabusa run without error whose
    setting has max_num_seqs=1, else the first hayabusa run without error; None when there is none."""
    ok = [i for i, r in enumerate(runs) if r.engine == "hayabusa" and not r.error and r.token_ids]
    ones = [i for i in ok if runs[i].setting.get("max_num_seqs") == 1]
    constrained = run.label.endswith(" +schema")
    twin = {**run.setting, "max_num_seqs": 1}
    same = [i for i in ones if {**runs[i].setting, "max_num_seqs": 1} == twin
            and runs[i].label.endswith(" +schema") == constrained]
    return (same or ones or ok or [None])[0]


def token_differences(run: RunOutput, base: RunOutput) -> list[bool | None]:
    """Per item: True when the run's output token ids differ from the baseline's (any sample), None when either
    has no output for it."""
    out: list[bool | None] = []
    for a, b in zip(run.token_ids or [None] * len(base.token_ids), base.token_ids):
        out.append(None if a is None or b is None else a != b)
    return out


def _score_runs(task: str, items: list[EvalItem], runs: list[RunOutput], tolerance: float) -> EvalResult:
    results = [tasks.score_run(task, items, r.texts, r.item_errors) if not r.error else None for r in runs]
    ref_idx = next((i for i, r in enumerate(runs) if not r.error), None)
    if runs and runs[0].engine == "hf" and runs[0].error:
        ref_idx = None                                  # a failed HF reference is not replaced silently
    rows, records = [], []
    for run, res in zip(runs, results):
        summary = agree = text_agree = differs = None
        tok_ref = token_baseline(runs, run) if res is not None and run.engine == "hayabusa" else None
        if tok_ref is not None:
            differs = token_differences(run, runs[tok_ref])
        if res is not None:
            summary = tasks.summarize(task, res)
            if ref_idx is not None:
                agree = tasks.agreement(task, items, res, results[ref_idx])
                text_agree = tasks.text_agreement(run.texts, runs[ref_idx].texts)
            for i, (it, r) in enumerate(zip(items, res)):
                records.append({"setting": run.label, "engine": run.engine, "index": i, "id": it.id,
                                "outputs": run.texts[i], "gold": it.gold, **r,
                                "agreement": agree[i] if agree else None,
                                "tokens_differ": differs[i] if differs else None})
        row = report.make_row(run, summary, agree, text_agree)
        if differs is not None:
            row["token_differ"] = sum(1 for d in differs if d)
            row["token_baseline"] = runs[tok_ref].label
        rows.append(row)
    ref_acc = rows[ref_idx].get("accuracy") if ref_idx is not None else None
    report.flag_rows(rows, ref_acc, tolerance)
    return EvalResult(rows, records, runs[ref_idx].label if ref_idx is not None else None, ref_acc, runs)


def _engine_dtype(model: str, engine_args: dict[str, Any]) -> str | None:
    """The dtype the engine runs in (so the HF reference runs in the same one), or None to let HF choose."""
    try:
        args = {k: v for k, v in engine_args.items() if k not in ("quantization", "kv_cache_dtype")}
        dtype = EngineArgs.from_kwargs(model, **args).create_engine_config().model_config.dtype
        return str(dtype).replace("torch.", "")
    except Exception:  # noqa: BLE001 -- the engine's own error is reported by its row
        return engine_args.get("dtype")
