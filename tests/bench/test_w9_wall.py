"""benchmarks/w9_wall.py: W9's bench wall split into the engine's steps and what is outside them; the rows
partition the timed region, the requests are W9's, and the engine phases fit inside the steps."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ROWS = ("params", "add", "pre_step", "steps", "between", "post_step", "sync")


def _run(tmp_path, monkeypatch, capsys, *args):
    out = tmp_path / "w9_wall.json"
    script = runpy.run_path(str(REPO / "benchmarks" / "w9_wall.py"), run_name="w9_wall")
    monkeypatch.setattr(sys, "argv", ["w9_wall.py", "--requests", "24", "--repeats", "2", "--json", str(out), *args])
    threads = torch.get_num_threads()
    try:
        script["main"]()
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    return json.loads(out.read_text()), captured.out, captured.err


def _check(rec, bar: bool, cuda: bool = False):
    assert rec["requests"] == 24 and rec["tqdm"] is bar and len(rec["repeats"]) == 2
    for r in rec["repeats"]:
        rows = r["rows"]
        assert sum(rows[k] for k in ROWS) == pytest.approx(r["wall_s"], rel=1e-9)     # a partition of the wall
        assert all(rows[k] >= 0 for k in ROWS) and rows["steps"] > 0 and rows["add"] > 0 and rows["params"] > 0
        # 24 requests x 256 encoder ids fit one step's encoder budget: one admit step, then 63 more tokens (with
        # CUDA's async scheduling one more call collects the last step)
        assert r["n_steps"] == 64 or (cuda and r["n_steps"] == 65)
        assert sum(r["engine"].values()) <= rows["steps"] and r["output_s"] <= rows["steps"]
        assert r["requests_per_s"] == pytest.approx(24 / r["wall_s"])


def test_w9_wall_cpu(tmp_path, monkeypatch, capsys):
    rec, stdout, _ = _run(tmp_path, monkeypatch, capsys, "--fake-forward", "--no-tqdm")
    _check(rec, bar=False)
    assert rec["fake_forward"] and rec["device"] == "cpu"
    assert all(r["triton_compiles"] == [] and r["new_cuda_segments"] == 0 for r in rec["repeats"])
    for row in ROWS + ("wall", "req/s", "compiles"):
        assert f"\n{row:>12}" in stdout


def test_w9_wall_progress_bar_between_steps(tmp_path, monkeypatch, capsys):
    """With the bar on (the bench's default) it is drawn between the steps, and the run still adds up."""
    rec, _, err = _run(tmp_path, monkeypatch, capsys, "--fake-forward")
    _check(rec, bar=True)
    # one bar per repeat, each drawn at 0 and completed (a redraw at 24/24 before the close may add one more)
    assert err.count("| 0/24 [") == 2 and err.count("| 24/24 [") >= 2


@pytest.mark.cuda
def test_w9_wall_cuda(tmp_path, monkeypatch, capsys):
    """On CUDA (tiny T5, real forward, CUDA graphs): the split adds up and the CUDA columns are counted."""
    assert torch.cuda.is_available()
    rec, stdout, _ = _run(tmp_path, monkeypatch, capsys, "--device", "cuda", "--no-tqdm",
                          "--gpu-memory-utilization", "0.3")
    _check(rec, bar=False, cuda=True)
    assert rec["device"].startswith("cuda") and "segments" in stdout
    assert all(isinstance(r["triton_compiles"], list) and r["alloc_retries"] >= 0 for r in rec["repeats"])
