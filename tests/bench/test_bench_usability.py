"""What a new user tripped over in `hayabusa bench` (fresh13): the W1P warm-up preempts as its timed run does and
the preemption / CPU-tier counters are the timed run's, shown in the line and the table; a speculative run says so
in its config cell; no --model and bad JSON engine flags are one line (exit 2) before any run; help texts."""

from __future__ import annotations

import argparse
import json

import pytest

from hayabusa.bench import cli, report
from hayabusa.bench.models import make_model
from hayabusa.bench.runner import TIMED_COUNTERS, run_hayabusa, timed_counters, warmup_requests
from hayabusa.bench.workloads import W1P_WARMUP_REQUESTS, get_workload

SCALE = 1 / 32


@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("usability") / "tiny-llama")
    make_model("tiny-llama", out, device="cpu")
    return out


def test_w1p_warmup_is_more_full_contexts_than_the_cache_holds_with_fresh_ids():
    w = get_workload("W1P", SCALE)
    warm = warmup_requests(w, engine_warmup=True)
    assert len(warm) == W1P_WARMUP_REQUESTS == 10
    assert [len(r.prompt_token_ids) for r in warm] == [224] * 10 and [r.max_tokens for r in warm] == [32] * 10
    blocks = w.engine_defaults["num_gpu_blocks_override"]
    assert len(warm) * -(-(224 + 32) // 16) > blocks        # 10 x 16 blocks > 128: the warm-up must preempt
    timed = {tuple(r.prompt_token_ids) for r in w.requests}
    assert not any(tuple(r.prompt_token_ids) in timed for r in warm)
    # the HF baseline and the other workloads keep the short warm-up
    assert [r.max_tokens for r in warmup_requests(w)] == [2] * 4
    assert [r.max_tokens for r in warmup_requests(get_workload("W1", 0.02), engine_warmup=True)] == [2] * 4


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_w1p_warmup_preempts_and_counters_are_the_timed_runs(tiny_bench_model, mode):
    """The one-time costs of preemption (and of swapping) land in the warm-up whichever variant runs first."""
    w = get_workload("W1P", SCALE)
    args = {**w.engine_defaults, "swap_space": 0.25, "device": "cpu", "skip_tokenizer_init": True,
            "dtype": "float32", "preemption_mode": mode}
    res = run_hayabusa(tiny_bench_model, w, args, use_tqdm=False)
    x = res.extra
    assert x["warmup_num_preemptions"] >= 1 and x["num_preemptions"] >= 1
    if mode == "swap":
        assert x["warmup_num_swap_preemptions"] == x["warmup_num_preemptions"]
        assert x["warmup_num_blocks_swapped_out"] > 0 and x["num_blocks_swapped_out"] > 0
        assert x["num_swap_preemptions"] == x["num_preemptions"]
        assert x["num_blocks_swapped_in"] == x["num_blocks_swapped_out"]   # the timed run's alone
    else:
        assert "warmup_num_swap_preemptions" not in x and x["num_swap_preemptions"] == 0
        assert x["num_blocks_swapped_out"] == 0
    assert res.output_tokens == 32 * 32


def test_timed_counters_subtract_the_warmup():
    before = dict.fromkeys(TIMED_COUNTERS, 0) | {"num_preemptions": 2, "num_blocks_swapped_out": 14}
    after = dict.fromkeys(TIMED_COUNTERS, 0) | {"num_preemptions": 5, "num_blocks_swapped_out": 56}
    out = timed_counters(before, after)
    assert out["num_preemptions"] == 3 and out["num_blocks_swapped_out"] == 42
    assert out["warmup_num_preemptions"] == 2 and out["warmup_num_blocks_swapped_out"] == 14
    assert "warmup_num_blocks_swapped_in" not in out
    # --repeats: the recorded run may be a later one; its warm-up counts are those before the first timed run
    later = timed_counters(after, after | {"num_preemptions": 9}, warmup=before)
    assert later["num_preemptions"] == 4 and later["warmup_num_preemptions"] == 2


def _rec(workload, variant, extra, elapsed=4.09):
    return {**{k: None for k in report.REQUIRED_KEYS}, "workload": workload, "model": "tiny", "engine": "hayabusa",
            "variant": variant, "output_throughput": 250.5, "total_throughput": 2004.2, "ttft_ms": 1415.3,
            "startup_s": 0.29, "elapsed_s": elapsed, "extra": extra, "gpu": "cpu"}


def test_w1p_line_and_table_show_elapsed_preemptions_and_swapped_blocks():
    swap = _rec("W1P", {"preemption_mode": "swap"}, {"num_preemptions": 3, "num_swap_preemptions": 3,
                                                     "num_blocks_swapped_out": 42, "num_blocks_swapped_in": 42,
                                                     "cpu_prefix_cache_hit_blocks": 0})
    rec = _rec("W1P", {"preemption_mode": "recompute"}, {"num_preemptions": 3, "num_swap_preemptions": 0,
                                                         "num_blocks_swapped_out": 0, "num_blocks_swapped_in": 0,
                                                         "cpu_prefix_cache_hit_blocks": 0}, elapsed=3.95)
    line = cli._summary(swap)
    assert ", 4.09 s," in line
    assert ", 3 preemptions (3 by swap), 42 blocks swapped out / 42 in, 0 CPU prefix hit blocks" in line
    lines = report.format_table([swap, rec]).splitlines()
    assert lines[0].endswith("elapsed s  preemptions (swap)  blocks out/in  CPU hit blocks")
    assert lines[2].endswith("4.09               3 (3)          42/42               0")
    assert lines[3].endswith("3.95               3 (0)            0/0               0")
    # other workloads: neither the columns nor the line part, unless their timed run preempted
    w1 = _rec("W1", {}, {"num_preemptions": 0})
    assert "preemptions" not in report.format_table([w1]) and "preemptions" not in cli._summary(w1)
    w1_pre = _rec("W1", {}, {"num_preemptions": 2, "num_swap_preemptions": 0, "num_blocks_swapped_out": 0})
    assert "preemptions (swap)" in report.format_table([w1_pre, w1]).splitlines()[0]
    assert ", 2 preemptions (0 by swap)" in cli._summary(w1_pre)


def test_a_speculative_run_shows_its_method_and_acceptance():
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
            "spec_decode_num_draft_tokens": 200, "spec_decode_num_accepted_tokens": 50,
            "spec_decode_acceptance_rate": 0.25}
    r = _rec("W1", {}, spec)
    assert report.table_rows([r])[0][3] == "spec=ngram k=3 acc=25%"
    assert ", speculative ngram k=3, acceptance 50/200 (25.0%)" in cli._summary(r)
    unknown = _rec("W1", {"max_num_seqs": 8}, {**spec, "spec_decode_num_draft_tokens": 0,
                                               "spec_decode_acceptance_rate": None})
    assert report.table_rows([unknown])[0][3] == "max_num_seqs=8,spec=ngram k=3"
    assert cli._summary(unknown).count("speculative ngram k=3") == 1 and "acceptance" not in cli._summary(unknown)
    assert report.table_rows([_rec("W1", {}, {})])[0][3] == "-"


def test_a_speculative_run_line_shows_the_payoff_rules_state():
    # found by a fresh user: the records' extra.spec_decode_payoff (README) said the rule had turned speculation
    # off at batch 1 (H200 W11, 9f62562: 3,510 spec / 1,065 plain steps), but the printed line and table showed
    # only "acceptance 3557/5812", as if every step had speculated
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
            "spec_decode_num_draft_tokens": 5812, "spec_decode_num_accepted_tokens": 3557,
            "spec_decode_acceptance_rate": 0.612,
            "spec_decode_payoff": {"1": {"speculating": False, "plain_steps": 1065, "spec_steps": 3510,
                                         "spec_rate": 900.0, "plain_rate": 950.0},
                                   "4": {"speculating": True, "plain_steps": 0, "spec_steps": 7,
                                         "spec_rate": None, "plain_rate": None}}}
    line = cli._summary(_rec("W11", {"max_num_seqs": 4}, spec))
    assert (", speculative ngram k=4, acceptance 3557/5812 (61.2%), payoff rule at its end: batch<=1 off "
            "(3510 spec / 1065 plain steps), batch<=4 spec (7 spec / 0 plain steps)") in line
    static = {k: v for k, v in spec.items() if k != "spec_decode_payoff"}   # disable_by_payoff false: no part
    assert "payoff" not in cli._summary(_rec("W11", {}, static))


@pytest.mark.payoff_default
def test_a_speculative_bench_run_records_the_method(tmp_path, tiny_bench_model, capsys):
    path = tmp_path / "out.json"
    assert cli.main(["--workload", "W1", "--model", tiny_bench_model, "--scale", "0.02", "--device", "cpu",
                     "--no-tqdm", "--json", str(path), "--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    rec, = json.loads(path.read_text())
    assert rec["extra"]["speculative_config"]["method"] == "ngram"
    # the measured turn-off rule's decisions per batch-size bucket (hayabusa/spec_decode/payoff.py)
    payoff = rec["extra"]["spec_decode_payoff"]
    assert payoff and all(set(st) == {"speculating", "plain_steps", "spec_steps", "spec_rate", "plain_rate"}
                          and st["spec_steps"] > 0 for st in payoff.values())
    out = capsys.readouterr().out
    assert ", speculative ngram k=3" in out and "  spec=ngram k=3" in out


def test_no_model_names_the_flag_and_suggests_tiny_llama_on_cpu(capsys):
    assert cli.main(["--workload", "W1P", "--scale", "0.03125", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hayabusa bench: --model DIR is required with --workload W1P")
    assert "--make-model tiny-llama DIR" in err and "None" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("value,says", [
    ("ngram", "must be a dict, or a JSON object string such as"),
    ("{bad", "got '{bad', which is not JSON"),
    ('{"method": "foo", "num_speculative_tokens": 2}', "method='foo': unknown method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "x": 1}', "x=1: unknown key"),
    ("-1", "must be a dict"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min=5: must be <= prompt_lookup_max (2)"),
])
def test_bad_speculative_config_is_one_line_before_any_run(tiny_bench_model, capsys, monkeypatch, value, says):
    monkeypatch.setattr(cli, "_run", lambda ns: pytest.fail("a run started"))
    assert cli.main(["--workload", "W1", "--model", tiny_bench_model, "--device", "cpu",
                     f"--speculative-config={value}"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("hayabusa bench: argument --speculative-config: speculative_config ")
    assert says in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err + captured.out


def test_bad_json_in_a_sweep_and_limit_mm_is_refused_up_front(tiny_bench_model, capsys):
    assert cli.main(["--workload", "W1", "--model", tiny_bench_model, "--device", "cpu", "--sweep",
                     "speculative_config=ngram"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hayabusa bench: argument --speculative-config: speculative_config must be a dict")
    assert "got 'ngram', which is not JSON" in err
    assert cli.main(["--workload", "W1", "--model", tiny_bench_model, "--device", "cpu",
                     "--limit-mm-per-prompt", '{"audio": 1}']) == 2
    err = capsys.readouterr().err
    assert err.startswith("hayabusa bench: argument --limit-mm-per-prompt: ") and "unknown modality 'audio'" in err


def test_help_texts():
    p = argparse.ArgumentParser()
    cli._add_args(p)
    helps = {a.dest: a.help for a in p._actions}
    for dest in ("endpoint", "metric_percentiles", "percentile_metrics"):
        assert helps[dest], dest
    assert "ttft" in helps["percentile_metrics"] and "50,90,99" in helps["metric_percentiles"]
    assert "default on" in helps["enable_prefix_caching"]
    assert "EngineArgs default: None" not in "".join(h or "" for h in helps.values())
    assert "[EngineArgs default: 256]" in helps["max_num_seqs"]


def test_config_cell_names_a_quantization_or_kv_cache_dtype_given_outside_a_sweep():
    """Found by a fresh FP8 user (fresh18q): `hayabusa bench --quantization fp8` printed config "-", the same
    cell as a bf16 run, so two runs' tables could not be told apart. The cell now names the quantization and the
    KV-cache dtype when they are not the defaults and the sweep does not already say so."""
    fp8 = {**_rec("W3", {}, {}), "engine_args": {"quantization": "fp8", "kv_cache_dtype": "auto"}}
    both = {**_rec("W3", {}, {}), "engine_args": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
    swept = {**_rec("W3", {"quantization": "fp8"}, {}), "engine_args": {"quantization": "fp8"}}
    plain = {**_rec("W3", {}, {}), "engine_args": {"quantization": None, "kv_cache_dtype": "auto"}}
    rows = report.table_rows([fp8, both, swept, plain])
    assert [r[3] for r in rows] == ["quantization=fp8", "quantization=fp8,kv_cache_dtype=fp8", "quantization=fp8",
                                    "-"]
    # and batch-invariant mode from --batch-invariant (a fresh user, twenty-third session: the cell read "-")
    bi = {**_rec("W3", {}, {}), "engine_args": {"batch_invariant": True}}
    off = {**_rec("W3", {}, {}), "engine_args": {"batch_invariant": False}}
    swept_bi = {**_rec("W3", {"batch_invariant": True}, {}), "engine_args": {"batch_invariant": True}}
    assert [r[3] for r in report.table_rows([bi, off, swept_bi])] == ["batch_invariant=True", "-",
                                                                      "batch_invariant=True"]


def test_records_and_config_cell_keep_the_hayabusa_switches_of_the_run(monkeypatch):
    """Found by a fresh FP8 user (fresh18q): session 18's records of W3 fp8 at 3.641 and 3.133 ms/token have the same
    engine_args and variant; only HAYABUSA_FP8_PREQUANT=0 told them apart, and no record kept it. The record now
    keeps the HAYABUSA_* switches set in the environment (never the API key; not where things are: the assets and
    cache folders, *_DIR, the commit) and the table's config cell shows them."""
    import os

    for k in [k for k in os.environ if k.startswith("HAYABUSA_")]:
        monkeypatch.delenv(k)                 # CI sets HAYABUSA_CACHE; a device run HAYABUSA_COMMIT, ...
    monkeypatch.setenv("HAYABUSA_FP8_PREQUANT", "0")
    monkeypatch.setenv("HAYABUSA_API_KEY", "sk-secret")
    monkeypatch.setenv("HAYABUSA_ASSETS", "/somewhere")
    monkeypatch.setenv("HAYABUSA_CACHE", "/root/.cache/hayabusa")
    monkeypatch.setenv("HAYABUSA_Q05_DIR", "/tmp/q05")
    monkeypatch.setenv("HAYABUSA_COMMIT", "abc1234")
    env = report.environment("cpu")
    assert env["switches"] == {"HAYABUSA_FP8_PREQUANT": "0"}
    rec = {**_rec("W3", {"quantization": "fp8"}, {}), "switches": env["switches"]}
    assert report.table_rows([rec])[0][3] == "quantization=fp8,HAYABUSA_FP8_PREQUANT=0"
    assert "sk-secret" not in json.dumps(env)
    monkeypatch.delenv("HAYABUSA_FP8_PREQUANT")
    assert report.environment("cpu")["switches"] == {}


@pytest.mark.parametrize("value", ["maybe", "2", "ture"])
def test_a_switch_in_a_sweep_takes_only_on_off_values(tiny_bench_model, capsys, value):
    """--sweep batch_invariant=VALUE: 1 / true / yes / on and 0 / false / no / off as the environment variables;
    anything else is refused before a run (it once ran as False: a typo measured default against default)."""
    assert cli._parse_sweep("batch_invariant=1,off,YES") == ("batch_invariant", [True, False, True])
    # none: the argument's default (None: HAYABUSA_BATCH_INVARIANT decides), as eval --sweep reads it
    assert cli._parse_sweep("batch_invariant=none,on") == ("batch_invariant", [None, True])
    assert cli.main(["--workload", "W3", "--model", tiny_bench_model, "--device", "cpu", "--sweep",
                     f"batch_invariant=false,{value}"]) == 2
    err = capsys.readouterr().err
    assert (f"--sweep batch_invariant={value!r}: use 1 / true / yes / on or 0 / false / no / off (any case), or none "
            "(the default).") in err
    assert "Traceback" not in err
    with pytest.raises(ValueError, match="enforce_eager='none': use 1 / true / yes / on or 0 / false / no / off "
                                         r"\(any case\)\.$"):
        cli._parse_sweep("enforce_eager=none")      # a plain switch has no None default


def test_repeats_time_the_workload_n_times_on_one_engine_and_record_the_median(tiny_bench_model):
    """--repeats 3: three timed runs on one engine; the record is the median run, every run's throughput is kept, and
    the prefix cache is reset between runs (W1's prompts are unique: without the reset the second and third runs
    would hit the first's cached prompts)."""
    w = get_workload("W1", 0.1)        # 25 prompts of 51 tokens: three full 16-token blocks each to cache
    assert min(len(r.prompt_token_ids) for r in w.requests) >= 32
    args = {**w.engine_defaults, "device": "cpu", "skip_tokenizer_init": True, "dtype": "float32",
            "enable_prefix_caching": True}
    res = run_hayabusa(tiny_bench_model, w, args, use_tqdm=False, repeats=3)
    x = res.extra
    assert x["repeats"] == 3 and len(x["repeat_elapsed_s"]) == len(x["repeat_output_throughput"]) == 3
    assert round(res.elapsed_s, 6) == sorted(x["repeat_elapsed_s"])[1]
    tokens = sum(r.max_tokens for r in w.requests)
    assert res.output_tokens == tokens
    for e, tps in zip(x["repeat_elapsed_s"], x["repeat_output_throughput"]):
        assert tps == pytest.approx(tokens / e, rel=1e-3)
    assert x["prefix_cache_hit_rate"] < 0.05, x["prefix_cache_hit_rate"]
    assert x["timed_steps"] > 0
    with pytest.raises(ValueError, match="repeats=0"):
        run_hayabusa(tiny_bench_model, w, args, use_tqdm=False, repeats=0)


def test_repeats_flag_in_the_record_and_the_line(tmp_path, tiny_bench_model, capsys):
    path = tmp_path / "out.json"
    assert cli.main(["--workload", "W1", "--model", tiny_bench_model, "--scale", "0.02", "--device", "cpu",
                     "--no-tqdm", "--json", str(path), "--repeats", "2"]) == 0
    rec, = json.loads(path.read_text())
    tps = rec["extra"]["repeat_output_throughput"]
    assert rec["extra"]["repeats"] == 2 and len(tps) == 2
    assert rec["output_throughput"] == pytest.approx(max(tps), rel=1e-3)   # even N: the lower middle time
    assert f", faster middle run of 2 runs (out tok/s {tps[0]:.1f}, {tps[1]:.1f})" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--workload", "W1", "--model", tiny_bench_model, "--repeats", "0"])


def test_a_failed_sweep_row_names_the_flags_given_outside_the_sweep(tmp_path, tiny_bench_model):
    """`--sweep batch_invariant=false,true --quantization int8`: the mode refuses quantization; the error row's
    config cell reads like the good row's (quantization=int8 included), not as if run unquantized."""
    path = tmp_path / "out.json"
    assert cli.main(["--workload", "W1", "--model", tiny_bench_model, "--scale", "0.02", "--device", "cpu",
                     "--no-tqdm", "--json", str(path), "--quantization", "int8",
                     "--sweep", "batch_invariant=false,true"]) == 1
    good, bad = json.loads(path.read_text())
    assert good.get("error") is None and "quantization" in bad["error"]
    assert report._variant_label(good) == "batch_invariant=False,quantization=int8"
    assert report._variant_label(bad) == "batch_invariant=True,quantization=int8"


def test_w6_without_httpx_says_which_extra(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "httpx", None)     # as on an install without the serve extra
    assert cli.main(["--workload", "W6", "--base-url", "http://127.0.0.1:9", "--model", "m"]) == 2
    assert "pip install 'hayabusa[serve]'" in capsys.readouterr().err


def test_repeats_keep_the_warmups_counters_apart(tiny_bench_model):
    """W1P preempts in its warm-up and in every timed run: with --repeats 2 the warmup_* counters are still the
    warm-up's alone (not the warm-up's plus the first timed run's), and the recorded run's are its own."""
    w = get_workload("W1P", SCALE)
    args = {**w.engine_defaults, "swap_space": 0.25, "device": "cpu", "skip_tokenizer_init": True,
            "dtype": "float32", "preemption_mode": "recompute"}
    one = run_hayabusa(tiny_bench_model, w, args, use_tqdm=False).extra
    two = run_hayabusa(tiny_bench_model, w, args, use_tqdm=False, repeats=2).extra
    assert two["warmup_num_preemptions"] == one["warmup_num_preemptions"] >= 1
    assert 1 <= two["num_preemptions"] <= 2 * one["num_preemptions"]
