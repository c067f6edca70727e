"""benchmarks/batch_invariance.py on a model whose context is 512 tokens (the tiny Llama): the engine's
max_model_len, the target's prompt and the other requests' prompts are capped by the model's context (CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hayabusa.errors import HayabusaValidationError
from hayabusa.eval import batch_invariance
from hayabusa.eval.batch_invariance import Setting

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "batch_invariance.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("batch_invariance_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_runs_on_a_512_token_model(tiny_llama, tmp_path, monkeypatch):
    bench = _load_script()
    # One setting keeps it small; 150 tokens: the others' prompts (up to 300 tokens) plus their outputs (up to
    # 2 * 150) would not fit 512 tokens uncapped, nor would max_model_len 2048 + 150.
    monkeypatch.setattr(bench, "default_settings", lambda full: [Setting("2 others", 2, {"max_num_seqs": 4})])
    seen = []
    real = batch_invariance.run_setting

    def spy(model, setting, target, num_tokens, mode, base=None, seed=1):
        seen.append((len(target), base["max_model_len"]))
        return real(model, setting, target, num_tokens, mode, base, seed)

    monkeypatch.setattr(batch_invariance, "run_setting", spy)
    out = tmp_path / "bi.json"
    rc = bench.main([tiny_llama, "--mode", "default", "--num-tokens", "150", "--json", str(out),
                     "--kv-cache-memory-bytes", str(64 << 20)])
    assert rc == 0
    assert seen == [(200, 512), (200, 512)]                   # alone, then the setting; 200 + 150 <= 512
    data = json.loads(out.read_text())
    records = data["records"]
    assert data["complete"] is True
    assert [r["setting"] for r in records] == ["alone, max_num_seqs=1", "2 others"]
    assert [r["num_tokens"] for r in records] == [150, 150]
    assert records[0]["identical"] is True


def test_target_prompt_capped_and_too_many_tokens_refused(tiny_llama, monkeypatch):
    seen = []
    monkeypatch.setattr(batch_invariance, "run_setting",
                        lambda model, s, target, n, mode, base=None: seen.append((len(target), base)) or ([1], [0.0]))
    batch_invariance.run_experiment(tiny_llama, [], modes=(False,), num_tokens=200, target_len=400,
                                    base={"max_model_len": 4096, "dtype": "float32"})
    assert seen == [(312, {"max_model_len": 512, "dtype": "float32"})]    # 512 - 200 tokens of prompt
    with pytest.raises(HayabusaValidationError, match="num_tokens=256") as e:
        batch_invariance.run_experiment(tiny_llama, [], modes=(False,), num_tokens=256)
    assert e.value.parameter == "num_tokens" and e.value.value == 256


def test_json_is_rewritten_after_every_setting(tiny_llama, tmp_path, monkeypatch):
    """A run cut short (here the second setting fails) keeps the records it measured in --json."""
    bench = _load_script()
    monkeypatch.setattr(bench, "default_settings", lambda full: [Setting("a", 1, {}), Setting("b", 2, {})])

    def run(model, setting, target, num_tokens, mode, base=None):
        if setting.name == "b":
            raise RuntimeError("killed")
        return [1, 2], [-0.5, -0.25]

    monkeypatch.setattr(batch_invariance, "run_setting", run)
    out = tmp_path / "bi.json"
    with pytest.raises(RuntimeError, match="killed"):
        bench.main([tiny_llama, "--mode", "default", "--num-tokens", "8", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] is False
    assert [(r["setting"], r["identical"]) for r in data["records"]] == [("alone, max_num_seqs=1", True), ("a", True)]
