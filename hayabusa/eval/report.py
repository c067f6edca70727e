"""The eval table (one row per setting), the tolerance flag, the accuracy-vs-latency plot and wandb logging."""

from __future__ import annotations

import json
import sys
import textwrap
from typing import Any

from hayabusa.eval.runner import RunOutput

COLUMNS = ("setting", "engine", "s/item", "out tok/s", "peak GiB", "accuracy", "unparsable", "errors",
           "agreement", "text agree", "differ", "flag")


def make_row(run: RunOutput, summary: dict[str, Any] | None, agree: list[float | None] | None,
             text_agree: float | None) -> dict[str, Any]:
    """One table row (also the JSON summary record) for a run."""
    row: dict[str, Any] = {"setting": run.label, "engine": run.engine, "setting_args": run.setting,
                           "error": run.error, "flag": ""}
    if run.error:
        return row
    n = sum(t is not None for t in run.texts)   # items that ran: one refused as too long took no time
    secs = run.elapsed_s or 0.0
    known = [a for a in (agree or []) if a is not None]
    row.update({
        "seconds_per_item": secs / n if n else None,
        "output_throughput": run.output_tokens / secs if secs else None,
        "elapsed_s": secs, "startup_s": run.startup_s, "prompt_tokens": run.prompt_tokens,
        "output_tokens": run.output_tokens, "peak_memory_bytes": run.peak_memory_bytes,
        "kv_cache_tokens": run.kv_cache_tokens,
        "agreement": sum(known) / len(known) if known else None, "text_agreement": text_agree,
        **(summary or {})})
    return row


def flag_rows(rows: list[dict[str, Any]], reference_accuracy: float | None, tolerance: float) -> None:
    """Mark rows whose accuracy is more than `tolerance` below the reference ("DROP") and failed ones ("ERROR")."""
    for r in rows:
        if r.get("error"):
            r["flag"] = "ERROR"
        elif reference_accuracy is not None and r.get("accuracy") is not None \
                and r["accuracy"] < reference_accuracy - tolerance - 1e-12:
            r["flag"] = f"DROP >{tolerance:g}"


def engine_settings_line(engine_args: dict[str, Any], swept: set[str] = frozenset()) -> str:
    """The header's engine settings: the engine arguments given (``key=value``, as the setting column writes
    them) and always the batch-invariant mode as it resolves (``batch_invariant=True`` from ``--batch-invariant``,
    ``HAYABUSA_BATCH_INVARIANT`` or ``VLLM_BATCH_INVARIANT``); a key in ``swept`` (the --sweep keys) reads
    ``key=per setting``. Raises HayabusaValidationError for a bad value of those variables."""
    from hayabusa.batch_invariant import batch_invariant_requested

    shown = {k: v for k, v in engine_args.items() if k != "batch_invariant"}
    shown["batch_invariant"] = batch_invariant_requested(engine_args.get("batch_invariant"))
    shown.update({k: "per setting" for k in swept if k in shown})
    return "engine: " + ", ".join(f"{k}={v}" for k, v in shown.items())


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


ERROR_WIDTH = 100   # characters of an error row's message per line (continued under the number columns)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table; an error row carries its whole message in place of the numbers, wrapped at word
    boundaries into lines of ERROR_WIDTH characters (what to do next usually ends the message)."""
    lines: list[list[str] | tuple[str, str, str, str]] = [list(COLUMNS)]
    for r in rows:
        if r.get("error"):
            lines.append((r["setting"], r["engine"], "error: " + str(r["error"]), r["flag"]))
            continue
        peak = r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None
        lines.append([r["setting"], r["engine"], _fmt(r["seconds_per_item"], ".3f"),
                      _fmt(r["output_throughput"], ",.1f"), _fmt(peak, ".2f"), _fmt(r["accuracy"], ".3f"),
                      str(r["unparsable"]), str(r["num_errors"]), _fmt(r["agreement"], ".3f"),
                      _fmt(r["text_agreement"], ".3f"), _fmt(r.get("token_differ"), "d"), r["flag"]])
    widths = [max(len(line[i]) for line in lines if isinstance(line, list)) for i in range(len(COLUMNS))]
    for i in (0, 1):
        widths[i] = max(len(line[i]) for line in lines)
    out = []
    for line in lines:
        if isinstance(line, tuple):   # error row: the whole message in the number columns, wrapped at words
            indent = widths[0] + widths[1] + 4
            wrapped = textwrap.wrap(f"{line[2]}  {line[3]}".rstrip(), ERROR_WIDTH, break_long_words=False,
                                    break_on_hyphens=False) or [""]
            out.append(f"{line[0].ljust(widths[0])}  {line[1].ljust(widths[1])}  {wrapped[0]}".rstrip())
            out.extend(" " * indent + w for w in wrapped[1:])
            continue
        last = len(line) - 1       # setting, engine and flag read left to right; the numbers right-aligned
        out.append("  ".join(c.ljust(w) if j < 2 or j == last else c.rjust(w)
                             for j, (c, w) in enumerate(zip(line, widths))).rstrip())
        if len(out) == 1:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def plot_accuracy_vs_latency(rows: list[dict[str, Any]], path: str, title: str) -> str | None:
    """PNG: one point per setting (x seconds per item, y accuracy), the reference drawn as a star.

    Returns:
        None on success, else why nothing was written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install matplotlib, or drop --plot (the table has every number)."
    ok = [r for r in rows if not r.get("error") and r.get("seconds_per_item") is not None]
    if not ok:
        return "nothing to plot: every setting failed."
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ok:
        ref = r["engine"] == "hf"
        ax.scatter([r["seconds_per_item"]], [r["accuracy"]], marker="*" if ref else "o", s=140 if ref else 50,
                   color="red" if r.get("flag") else ("black" if ref else "tab:blue"))
        ax.annotate(r["setting"], (r["seconds_per_item"], r["accuracy"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xlabel("seconds per item (batch wall time / items)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def log_wandb(rows: list[dict[str, Any]], config: dict[str, Any], project: str = "hayabusa-eval") -> str | None:
    """Log the table to Weights & Biases. Returns None on success, else why nothing was logged."""
    try:
        import wandb
    except ImportError:
        return "wandb is not installed: pip install wandb (and `wandb login`), or drop --wandb."
    cols = ["setting", "engine", "seconds_per_item", "output_throughput", "peak_memory_bytes", "accuracy",
            "unparsable", "num_errors", "agreement", "text_agreement", "token_differ", "flag", "error"]
    try:
        run = wandb.init(project=project, config=config, job_type="eval")
        table = wandb.Table(columns=cols, data=[[_plain(r.get(c)) for c in cols] for r in rows])
        run.log({"eval_table": table})
        run.finish()
    except Exception as e:  # noqa: BLE001 -- logging must not lose the results printed already
        return f"wandb logging failed ({type(e).__name__}: {e})."
    return None


def _plain(v: Any) -> Any:
    return v if v is None or isinstance(v, (int, float, str, bool)) else json.dumps(v, default=str)


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False, default=str) + "\n")


def say(msg: str) -> None:
    print(f"hayabusa eval: {msg}", file=sys.stderr, flush=True)
