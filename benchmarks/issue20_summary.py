"""Issue #20's device claims from `hayabusa bench` records: one line each, with the issue's target.

    python benchmarks/issue20_summary.py DIR_OR_JSON...     # device_run.sh's g_issue20 passes its $WORK folder

- W1P: seconds to finish with preemption_mode=swap vs recompute (and the preemptions each made), per model;
- W1 / W3 with cpu_offload_gb vs without, per model (target: W1 >= 0.5x of no offload);
- W10 output tok/s with the CPU tier on (swap_space > 0) vs off (target >= 2x), per model.
A comparison whose records are missing or failed prints "missing". Reads only; exits 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load_records(paths: list[str]) -> list[dict[str, Any]]:
    """Every record of the bench JSON files named (a folder: its *.json), failed runs dropped."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    out = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for r in data if isinstance(data, list) else []:
            if isinstance(r, dict) and r.get("workload") and not r.get("error"):
                out.append(r)
    return out


def _arg(r: dict[str, Any], key: str, default: Any = None) -> Any:
    return {**(r.get("engine_args") or {}), **(r.get("variant") or {})}.get(key, default)


def _model(r: dict[str, Any]) -> str:
    return Path(str(r.get("model"))).name


def _pairs(records, workload: str, on) -> dict[str, tuple[dict | None, dict | None]]:
    """"model at scale" -> (last record with `on(r)` true, last with it false) of `workload`; runs in the
    batch-invariant mode are left out (another issue's sweep in the same folder)."""
    out: dict[str, list] = {}
    for r in records:
        if r["workload"] == workload and not _arg(r, "batch_invariant"):
            key = _model(r) + ("" if r.get("scale", 1) == 1 else f" (scale {r['scale']:g})")
            out.setdefault(key, [None, None])[0 if on(r) else 1] = r
    return {m: (a, b) for m, (a, b) in out.items()}


def summarize(records: list[dict[str, Any]]) -> list[str]:
    """The summary lines (see the module docstring)."""
    lines = []
    for m, (swap, rec) in _pairs(records, "W1P", lambda r: _arg(r, "preemption_mode") == "swap").items():
        if swap and rec:
            lines.append(f"W1P {m}: swap {swap['elapsed_s']:.2f} s ({swap['extra'].get('num_preemptions')} "
                         f"preemptions, {swap['extra'].get('num_blocks_swapped_out')} blocks out) vs recompute "
                         f"{rec['elapsed_s']:.2f} s ({rec['extra'].get('num_preemptions')} preemptions): "
                         f"{rec['elapsed_s'] / swap['elapsed_s']:.2f}x")
        else:
            lines.append(f"W1P {m}: missing {'recompute' if swap else 'swap'}")
    for w in ("W1", "W3"):
        for m, (off, base) in _pairs(records, w, lambda r: (_arg(r, "cpu_offload_gb", 0) or 0) > 0).items():
            if off is None:
                continue                          # a W1 / W3 run without an offload partner: not this issue's
            if base is None:
                lines.append(f"{w} {m} cpu_offload_gb={_arg(off, 'cpu_offload_gb')}: missing no-offload run")
                continue
            if w == "W1":
                ratio = off["output_throughput"] / base["output_throughput"]
                lines.append(f"W1 {m} cpu_offload_gb={_arg(off, 'cpu_offload_gb')}: {off['output_throughput']:,.0f} "
                             f"vs {base['output_throughput']:,.0f} out tok/s no offload: {ratio:.2f}x "
                             f"(target >= 0.5x: {'met' if ratio >= 0.5 else 'not met'})")
            else:
                ratio = base["tpot_ms"] / off["tpot_ms"]
                lines.append(f"W3 {m} cpu_offload_gb={_arg(off, 'cpu_offload_gb')}: {off['tpot_ms']:.2f} vs "
                             f"{base['tpot_ms']:.2f} ms/token no offload: {ratio:.2f}x")
    for m, (on, off) in _pairs(records, "W10", lambda r: (_arg(r, "swap_space", 0) or 0) > 0).items():
        if on and off:
            ratio = on["output_throughput"] / off["output_throughput"]
            lines.append(f"W10 {m}: CPU tier on {on['output_throughput']:,.0f} vs off "
                         f"{off['output_throughput']:,.0f} out tok/s: {ratio:.2f}x (target >= 2x: "
                         f"{'met' if ratio >= 2 else 'not met'}; CPU hits {on['extra'].get('cpu_prefix_cache_hit_blocks')} "
                         f"blocks, prefix hit {on.get('prefix_cache_hit_rate')} vs {off.get('prefix_cache_hit_rate')})")
        else:
            lines.append(f"W10 {m}: missing tier {'off' if on else 'on'}")
    return lines or ["issue 20: no W1P / offload / W10 records"]


if __name__ == "__main__":
    print("\n".join(summarize(load_records(sys.argv[1:] or ["."]))))
