"""benchmarks/issue20_summary.py: issue #20's device comparisons from bench records (pairs by model and scale,
ratios, targets, missing partners), on the H200 records of runs W and AB and on hand-made ones."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_m = runpy.run_path(str(ROOT / "benchmarks" / "issue20_summary.py"), run_name="issue20_summary")
summarize, load_records = _m["summarize"], _m["load_records"]


def _rec(workload, variant, *, model="/m/q7", scale=1.0, out=100.0, tpot=None, elapsed=1.0, **extra):
    return {"workload": workload, "model": model, "variant": variant, "engine_args": dict(variant),
            "scale": scale, "output_throughput": out, "tpot_ms": tpot, "elapsed_s": elapsed, "extra": extra,
            "prefix_cache_hit_rate": extra.get("prefix_cache_hit_rate")}


def test_recorded_h200_runs_give_benchmarks_md_ratios():
    res = ROOT / "benchmarks" / "results"
    lines = summarize(load_records([str(res / "2026-12-02_h200_3f8c092.bi_offload.json"),
                                    str(res / "2026-12-02_h200_415d10e.w10.json")]))
    # BENCHMARKS.md: W1 0.37x, W3 8.60 vs 1.05 ms (0.12x), W10 0.69x on the 0.5b shape
    assert lines == [
        "W1 qwen2.5-0.5b-shape cpu_offload_gb=0.4: 25,957 vs 70,665 out tok/s no offload: 0.37x "
        "(target >= 0.5x: not met)",
        "W3 qwen2.5-0.5b-shape cpu_offload_gb=0.4: 8.60 vs 1.05 ms/token no offload: 0.12x",
        "W10 qwen2.5-0.5b-shape: CPU tier on 14,241 vs off 20,579 out tok/s: 0.69x (target >= 2x: not met; "
        "CPU hits 1536 blocks, prefix hit 0.8734 vs 0.8349)"]


def test_pairs_by_model_and_scale_and_says_what_is_missing(tmp_path):
    recs = [_rec("W1P", {"preemption_mode": "swap"}, elapsed=10.0, num_preemptions=4, num_blocks_swapped_out=2048),
            _rec("W1P", {"preemption_mode": "recompute"}, elapsed=12.5, num_preemptions=4),
            _rec("W1", {}, scale=0.5, out=10000.0),
            _rec("W1", {"cpu_offload_gb": 7}, scale=0.5, out=6000.0),
            _rec("W1", {"cpu_offload_gb": 7}, model="/m/q05", out=1.0),          # no partner at its model
            _rec("W10", {"swap_space": 4}, out=300.0, cpu_prefix_cache_hit_blocks=64, prefix_cache_hit_rate=0.9),
            _rec("W10", {"swap_space": 0}, out=100.0, prefix_cache_hit_rate=0.5),
            _rec("W10", {"swap_space": 4}, model="/m/q05"),
            {"workload": "W1", "error": "boom"}]
    (tmp_path / "a.json").write_text(json.dumps(recs[:5]))
    (tmp_path / "b.json").write_text(json.dumps(recs[5:]))
    (tmp_path / "notes.json").write_text("not json")
    assert summarize(load_records([str(tmp_path)])) == [
        "W1P q7: swap 10.00 s (4 preemptions, 2048 blocks out) vs recompute 12.50 s (4 preemptions): 1.25x",
        "W1 q7 (scale 0.5) cpu_offload_gb=7: 6,000 vs 10,000 out tok/s no offload: 0.60x (target >= 0.5x: met)",
        "W1 q05 cpu_offload_gb=7: missing no-offload run",
        "W10 q7: CPU tier on 300 vs off 100 out tok/s: 3.00x (target >= 2x: met; CPU hits 64 blocks, prefix hit "
        "0.9 vs 0.5)",
        "W10 q05: missing tier off"]
    assert summarize([]) == ["issue 20: no W1P / offload / W10 records"]
