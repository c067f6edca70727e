"""Benchmark records (one JSON schema for every engine and workload), the stdout table, and sweep plots.

A record is a flat dict; REQUIRED_KEYS are always present (None where a metric does not apply). Throughputs are
tokens per second of wall time between submitting the first request and the last one finishing.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from typing import Any

import torch

from hayabusa.bench.ceilings import floor_seconds
from hayabusa.bench.runner import RunResult
from hayabusa.bench.workloads import Workload

REQUIRED_KEYS = ("workload", "model", "engine", "gpu", "commit", "date", "output_throughput", "total_throughput",
                 "tpot_ms", "ttft_ms", "startup_s", "peak_memory_bytes", "kv_cache_tokens", "engine_args",
                 "versions", "ceilings", "fraction_of_ceiling")


def git_commit() -> str:
    """HAYABUSA_COMMIT if set, else ``git rev-parse HEAD`` of the source tree (+ "-dirty"), else "unknown"."""
    if os.environ.get("HAYABUSA_COMMIT"):
        return os.environ["HAYABUSA_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str | None]:
    """torch, triton, transformers, python versions (None for a missing package)."""
    out: dict[str, str | None] = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 -- a missing or broken package is just "None"
            out[name] = None
    out["cuda"] = torch.version.cuda
    return out


def gpu_name(device: str | None) -> str:
    """The CUDA device name, or "cpu"."""
    if device not in (None, "auto") and not str(device).startswith("cuda"):
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device) if device not in (None, "auto") else None) \
        if torch.cuda.is_available() else "cpu"


# where things are, not how the engine runs: the assets and cache folders, the test models' folders, and the commit
# (the record has its own field)
_NOT_SWITCHES = ("HAYABUSA_ASSETS", "HAYABUSA_CACHE", "HAYABUSA_COMMIT")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def hayabusa_switches() -> dict[str, str]:
    """The HAYABUSA_* environment variables set for this run (HAYABUSA_FP8_PREQUANT=0, ...: they change which
    kernels run, so two records with equal engine_args can differ by them), sorted; never one whose name says it
    holds a secret (HAYABUSA_API_KEY), nor where things are (_NOT_SWITCHES, *_DIR)."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("HAYABUSA_") and k not in _NOT_SWITCHES and not k.endswith("_DIR")
            and not any(w in k for w in _SECRET_WORDS)}


def environment(device: str | None) -> dict[str, Any]:
    """The fields every record of one process shares (``switches``: hayabusa_switches())."""
    return {"gpu": gpu_name(device), "commit": git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
            "command": " ".join(sys.argv) if sys.argv else None, "switches": hayabusa_switches()}


def _fraction(workload: Workload, res: RunResult, stats: dict | None, ceilings: dict | None,
              elem_bytes: int) -> tuple[float | None, float | None]:
    """(floor, fraction_of_ceiling): floor in s per token (bandwidth) or s per run (matmul)."""
    seqs = [(len(r.prompt_token_ids), r.max_tokens) for r in workload.requests for _ in range(r.n)]
    floor = floor_seconds(workload.ceiling, stats, ceilings, seqs, elem_bytes)
    if floor is None:
        return None, None
    measured = res.tpot_ms / 1e3 if workload.ceiling == "bandwidth" else res.elapsed_s
    if not measured:
        return floor, None
    return floor, round(floor / measured, 4)


def make_record(workload: Workload, res: RunResult, *, engine: str, model: str, engine_args: dict[str, Any],
                env: dict[str, Any], variant: dict[str, Any], stats: dict | None = None,
                ceilings: dict | None = None, elem_bytes: int = 2) -> dict[str, Any]:
    """One JSON record for one timed run (see REQUIRED_KEYS; the rest describe the run in more detail)."""
    secs = res.elapsed_s or float("nan")
    floor, frac = _fraction(workload, res, stats, ceilings, elem_bytes)
    rec = {
        "workload": workload.name, "model": model, "engine": engine, **{k: env[k] for k in ("gpu", "commit", "date")},
        "output_throughput": round(res.output_tokens / secs, 2),
        "total_throughput": round((res.prompt_tokens + res.output_tokens) / secs, 2),
        "tpot_ms": res.tpot_ms if workload.reports_tpot else None,
        "tpot_mean_ms": res.tpot_mean_ms if workload.reports_tpot else None, "ttft_ms": res.ttft_ms,
        "startup_s": round(res.startup_s, 3), "peak_memory_bytes": res.peak_memory_bytes,
        "kv_cache_tokens": res.kv_cache_tokens, "engine_args": engine_args, "versions": env["versions"],
        "ceilings": ceilings, "fraction_of_ceiling": frac,
        "ceiling_kind": workload.ceiling if frac is not None else None,
        "floor_s": floor, "variant": variant, "scale": workload.scale, "elapsed_s": round(res.elapsed_s, 4),
        "seconds_per_request": round(res.elapsed_s / max(res.num_requests, 1), 4),
        "num_requests": res.num_requests, "num_sequences": res.num_sequences,
        "prompt_tokens": res.prompt_tokens, "output_tokens": res.output_tokens,
        "notes": res.notes, "extra": res.extra, "command": env.get("command"), "switches": env.get("switches"),
        "prefix_cache_hit_rate": (res.extra or {}).get("prefix_cache_hit_rate"),
    }
    return rec


def error_record(workload: str, *, engine: str, model: str, engine_args: dict[str, Any], env: dict[str, Any],
                 variant: dict[str, Any], error: str) -> dict[str, Any]:
    """A record for a run that failed (every metric None; "error" says what happened)."""
    rec: dict[str, Any] = {k: None for k in REQUIRED_KEYS}
    rec.update({"workload": workload, "model": model, "engine": engine, "engine_args": engine_args,
                "variant": variant, "error": error, **{k: env[k] for k in ("gpu", "commit", "date", "versions")},
                "switches": env.get("switches")})
    return rec


def write_json(path: str, records: list[dict[str, Any]]) -> None:
    """Write the list of records (atomically: a killed run leaves the previous complete file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1, default=str)
    os.replace(tmp, path)


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def spec_label(extra: dict[str, Any]) -> str | None:
    """"spec=METHOD k=K acc=P%" for a run with speculative decoding (``extra["speculative_config"]``; the
    acceptance rate, accepted / drafted tokens since the engine started, only when known), else None."""
    spec = extra.get("speculative_config")
    if not spec:
        return None
    label = f"spec={spec.get('method')} k={spec.get('num_speculative_tokens')}"
    rate = extra.get("spec_decode_acceptance_rate")
    return label + (f" acc={100 * rate:.0f}%" if rate is not None else "")


def _variant_label(rec: dict[str, Any]) -> str:
    v = dict(rec.get("variant") or {})
    extra = rec.get("extra") or {}
    if rec.get("engine") == "hf" and "hf_batch_size" not in v and extra.get("hf_batch_size"):
        v["batch"] = extra["hf_batch_size"]
    parts = [f"{k}={val}" for k, val in v.items()]
    # numerics given outside a sweep (`--quantization fp8`, `--batch-invariant`): otherwise the cell reads "-" as a
    # default run's does
    args = rec.get("engine_args") or {}
    for key, default in (("quantization", None), ("kv_cache_dtype", "auto"), ("batch_invariant", False)):
        val = args.get(key)
        if val not in (default, None, "none") and key not in v:
            parts.append(f"{key}={val}")
    spec = spec_label(extra)
    if spec and not any(k == "speculative_config" for k in v):
        parts.append(spec)
    # the environment's switches last: the engine's own arguments read first whatever the machine sets
    parts += [f"{k}={val}" for k, val in (rec.get("switches") or {}).items()]
    return ",".join(parts) or "-"


TABLE_COLUMNS = ("workload", "model", "engine", "config", "out tok/s", "total tok/s", "TTFT ms", "TPOT ms", "s/req",
                 "startup s", "weights GiB", "peak GiB", "KV tokens", "prefix hit %", "% ceiling")
# Preemption and the CPU tier: a table holding a record that shows them (``shows_tier``) gets TIER_COLUMNS after
# TABLE_COLUMNS: seconds to finish, preemptions (by swap), blocks swapped out to / in from the CPU tier, and prefix
# blocks restored from it, all of the timed run (``extra``; BENCHMARKS.md asks for them for W1P and W10).
TIER_WORKLOADS = ("W1P", "W10")
TIER_COLUMNS = ("elapsed s", "preemptions (swap)", "blocks out/in", "CPU hit blocks")
TIER_COUNTERS = ("num_preemptions", "num_blocks_swapped_out", "cpu_prefix_cache_hit_blocks")


def shows_tier(rec: dict[str, Any]) -> bool:
    """A record of a workload about preemption and the CPU tier (TIER_WORKLOADS, even with the counters at 0: the
    tier-off side of a comparison), or any run whose timed part preempted or used the CPU tier."""
    extra = rec.get("extra") or {}
    return rec.get("workload") in TIER_WORKLOADS or any(extra.get(k) for k in TIER_COUNTERS)


def table_columns(records: list[dict[str, Any]]) -> tuple[str, ...]:
    """TABLE_COLUMNS, plus TIER_COLUMNS when a record ``shows_tier``."""
    return TABLE_COLUMNS + (TIER_COLUMNS if any(shows_tier(r) for r in records) else ())


def _tier_cells(r: dict[str, Any]) -> list[str]:
    extra = r.get("extra") or {}
    pre, swap = extra.get("num_preemptions"), extra.get("num_swap_preemptions")
    out, back = extra.get("num_blocks_swapped_out"), extra.get("num_blocks_swapped_in")
    return [_fmt(r.get("elapsed_s"), 2), "-" if pre is None else f"{pre} ({swap or 0})",
            "-" if out is None else f"{out}/{back or 0}", _fmt(extra.get("cpu_prefix_cache_hit_blocks"))]


def table_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """One row of cells per record, in ``table_columns(records)`` order."""
    columns = table_columns(records)
    tier = len(columns) > len(TABLE_COLUMNS)
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["workload"], str(r["model"]), r["engine"], _variant_label(r),
                         ERROR_CELL] + [""] * (len(columns) - 5))
            continue
        peak = r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None
        extra = r.get("extra") or {}
        wb = extra.get("gpu_weight_bytes", extra.get("weight_bytes"))   # cpu_offload_gb: what stays on the GPU
        weights = wb / 2**30 if wb else None
        frac = 100 * r["fraction_of_ceiling"] if r.get("fraction_of_ceiling") is not None else None
        rows.append([r["workload"], str(r["model"]), r["engine"], _variant_label(r), _fmt(r["output_throughput"]),
                     _fmt(r["total_throughput"]), _fmt(r["ttft_ms"]), _fmt(r["tpot_ms"], 2),
                     _fmt(r.get("seconds_per_request"), 3), _fmt(r["startup_s"], 2), _fmt(weights, 2), _fmt(peak, 2),
                     _fmt(r["kv_cache_tokens"]),
                     _fmt(100 * r["prefix_cache_hit_rate"] if r.get("prefix_cache_hit_rate") is not None else None),
                     _fmt(frac) + ("" if frac is None else f" ({r['ceiling_kind']})")]
                    + (_tier_cells(r) if tier else []))
    return rows


def format_table(records: list[dict[str, Any]]) -> str:
    """A fixed-width text table of the records (one row each); a failed run's row says "ERROR (see below)" and
    its full message follows the table (so one long error does not widen every row)."""
    columns = table_columns(records)
    rows = [list(columns)] + table_rows(records)
    # an error row's marker spills over the empty columns after it instead of widening "out tok/s"
    widths = [max(len(row[i]) for row in rows if i < len(row) and not (row[4] == ERROR_CELL and i == 4))
              for i in range(len(columns))]
    lines = [_table_line(row, widths) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    errors = [f"  [{r['workload']} {r['engine']} {_variant_label(r)}] {r['error']}" for r in records if r.get("error")]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


ERROR_CELL = "ERROR (see below)"


def _table_line(row: list[str], widths: list[int]) -> str:
    if row[4] == ERROR_CELL:
        return ("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + ERROR_CELL).rstrip()
    return "  ".join(c.rjust(w) if j >= 4 else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()


def plot_sweep(records: list[dict[str, Any]], path: str) -> str | None:
    """PNG of output tok/s (and s/request for W4) against the swept engine argument.

    Returns:
        None on success, else a message saying why nothing was written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install matplotlib, or drop --plot (the JSON has every number)."
    ok = [r for r in records if not r.get("error") and r.get("variant")]
    if len({json.dumps(r["variant"], sort_keys=True) for r in ok}) < 2:
        return "nothing to plot: --plot needs a sweep (--sweep key=v1,v2 or workload W4)."
    key = next(iter(ok[0]["variant"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    w4 = ok[0]["workload"] in ("W4", "W8")   # seconds per request
    for (wl, eng), group in _groups(ok).items():
        xs = [r["variant"].get(key) for r in group]
        ys = [r["seconds_per_request"] if w4 else r["output_throughput"] for r in group]
        ax.plot([str(x) for x in xs], ys, marker="o", label=f"{eng} {wl}")
    ax.set_xlabel(key)
    ax.set_ylabel("seconds per request" if w4 else "output tok/s")
    r0 = ok[0]
    ax.set_title(f"{r0['workload']} on {r0['model']} ({r0['gpu']}, {str(r0['commit'])[:10]})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _groups(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault((r["workload"], r["engine"]), []).append(r)
    return out


def merge_files(out_path: str, paths: list[str]) -> list[dict[str, Any]]:
    """Concatenate the record lists of `paths` (unreadable files are skipped with a message) into out_path."""
    records: list[dict[str, Any]] = []
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
            records.extend(data if isinstance(data, list) else [data])
        except (OSError, ValueError) as e:
            print(f"hayabusa bench: skipped {p}: {e}", file=sys.stderr)
    write_json(out_path, records)
    return records


if __name__ == "__main__":  # python -m hayabusa.bench.report OUT.json IN1.json IN2.json ...: merge + table
    if len(sys.argv) < 2:
        print("usage: python -m hayabusa.bench.report OUT.json IN.json ...", file=sys.stderr)
        sys.exit(2)
    merged = merge_files(sys.argv[1], sys.argv[2:])
    print(format_table([r for r in merged if r.get("workload") != "ceilings"]))
    for r in merged:
        if r.get("workload") == "ceilings" and r.get("ceilings"):
            print(f"ceilings on {r['ceilings']['gpu']}: copy {r['ceilings']['copy_bandwidth_gbs']} GB/s, "
                  f"bf16 matmul {r['ceilings']['matmul_tflops']} TFLOP/s")
