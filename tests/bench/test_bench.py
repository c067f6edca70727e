"""hayabusa bench on CPU at toy scale: every workload runs and writes the record schema; HF and hayabusa count
tokens the same way; --make-model writes checkpoints transformers loads; floors are the numbers one can check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hayabusa.bench import cli
from hayabusa.bench.ceilings import decode_bytes_per_token, floor_seconds, request_flops
from hayabusa.bench.models import SHAPES, make_model, shape_stats
from hayabusa.bench.report import REQUIRED_KEYS
from hayabusa.bench.workloads import get_workload


@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("bench") / "tiny-llama")
    assert cli.main(["--make-model", "tiny-llama", out, "--device", "cpu"]) == 0
    return out



def _bench(tmp_path, *args: str) -> list[dict]:
    path = tmp_path / "out.json"
    rc = cli.main([*args, "--device", "cpu", "--no-tqdm", "--json", str(path)])
    assert rc == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("workload,scale,num_records", [
    ("W1", 0.02, 1), ("W2", 0.02, 1), ("W3", 0.02, 1), ("W5", 0.02, 2), ("W7", 0.04, 1), ("startup", 1.0, 1)])
def test_workload_writes_records(tmp_path, tiny_bench_model, workload, scale, num_records):
    recs = _bench(tmp_path, "--workload", workload, "--model", tiny_bench_model, "--scale", str(scale))
    assert len(recs) == num_records
    for r in recs:
        assert set(REQUIRED_KEYS) <= set(r) and not r.get("error")
        assert r["workload"] == workload and r["model"] == "tiny-llama" and r["engine"] == "hayabusa"
        assert r["gpu"] == "cpu" and r["peak_memory_bytes"] is None and r["kv_cache_tokens"] > 0
        assert r["output_throughput"] > 0 and r["total_throughput"] > r["output_throughput"]
        assert r["output_tokens"] == get_workload(workload, scale).num_output_tokens
        assert (r["tpot_ms"] is not None) == (r["tpot_mean_ms"] is not None) == (workload == "W3")   # W11 too
        if workload == "W3":   # one stream: the mean TPOT over requests is its median
            assert r["tpot_mean_ms"] == r["tpot_ms"] > 0
        assert r["versions"]["torch"] == torch.__version__
        if workload != "startup":  # the timed run's steps and where their host time went
            x = r["extra"]
            assert x["timed_steps"] >= max(q.max_tokens for q in get_workload(workload, scale).requests)
            parts = [x[k] for k in ("host_schedule_s", "host_launch_s", "host_wait_s", "host_collect_s")]
            assert min(parts) >= 0 and x["host_launch_s"] > 0 and sum(parts) <= r["elapsed_s"] + 1e-3


def test_w4_sweeps_max_num_seqs(tmp_path, tiny_bench_model):
    recs = _bench(tmp_path, "--workload", "W4", "--model", tiny_bench_model, "--scale", "0.02",
                  "--sweep", "max_num_seqs=1,2")
    assert [r["variant"] for r in recs] == [{"max_num_seqs": 1}, {"max_num_seqs": 2}]
    assert [r["engine_args"]["max_num_seqs"] for r in recs] == [1, 2]
    assert all(r["seconds_per_request"] > 0 for r in recs)


def test_quantization_sweep_reports_weight_bytes(tmp_path, tiny_bench_model):
    """weight_bytes is what the model holds: with int8 every Linear but lm_head keeps 1 byte per weight plus one
    fp32 scale per output row, instead of 4 bytes per weight (fp32 on CPU); the rest is unchanged."""
    none, int8 = _bench(tmp_path, "--workload", "W3", "--model", tiny_bench_model, "--scale", "0.02",
                        "--sweep", "quantization=none,int8")
    assert none["variant"] == {"quantization": None} and int8["variant"] == {"quantization": "int8"}
    cfg = json.loads((Path(tiny_bench_model) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    linear = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)        # q, k, v, o, gate, up, down
    saved = none["extra"]["weight_bytes"] - int8["extra"]["weight_bytes"]
    rows = layers * ((h + 2 * kv) + h + 2 * inter + h)                   # one fp32 scale per output row
    assert saved == linear * 4 - (linear + rows * 4)


def test_w5_reports_prefix_caching_honestly(tmp_path, tiny_bench_model):
    on, off = _bench(tmp_path, "--workload", "W5", "--model", tiny_bench_model, "--scale", "0.02")
    assert on["engine_args"]["enable_prefix_caching"] is True and off["engine_args"]["enable_prefix_caching"] is False
    assert on["prompt_tokens"] == off["prompt_tokens"] and on["output_tokens"] == off["output_tokens"]


@pytest.mark.parametrize("workload,scale", [("W2", 0.03), ("W7", 0.04)])
def test_hf_and_hayabusa_count_tokens_alike(tmp_path, tiny_bench_model, workload, scale):
    recs = _bench(tmp_path, "--workload", workload, "--model", tiny_bench_model, "--scale", str(scale),
                  "--engine", "both", "--hf-batch-size", "3")
    ours, hf = recs
    assert (ours["engine"], hf["engine"]) == ("hayabusa", "hf")
    for key in ("prompt_tokens", "output_tokens", "num_requests", "num_sequences"):
        assert ours[key] == hf[key], key
    assert hf["extra"]["hf_batch_size"] == 3 and hf["kv_cache_tokens"] is None
    assert set(REQUIRED_KEYS) <= set(hf)


def test_hf_batch1_requests_limits_only_the_batch1_baseline(tiny_bench_model):
    import dataclasses

    from hayabusa.bench.runner import run_hf

    w = dataclasses.replace(get_workload("W1", 0.02), hf_batch1_requests=2)   # 5 requests
    kw = dict(device="cpu", dtype="float32", warmup=False, use_tqdm=False)
    one = run_hf(tiny_bench_model, w, batch_size=1, **kw)
    assert one.num_requests == 2 and one.output_tokens == sum(r.max_tokens for r in w.requests[:2])
    assert run_hf(tiny_bench_model, w, batch_size=3, **kw).num_requests == len(w.requests) == 5


def test_ceilings_from_file_give_fractions(tmp_path, tiny_bench_model):
    ceil = tmp_path / "ceil.json"
    ceil.write_text(json.dumps({"gpu": "cpu", "copy_bandwidth_gbs": 1.0, "matmul_tflops": 1e-3}))
    w3, = _bench(tmp_path, "--workload", "W3", "--model", tiny_bench_model, "--scale", "0.02",
                 "--ceilings-from", str(ceil))
    assert w3["ceilings"]["copy_bandwidth_gbs"] == 1.0 and w3["ceiling_kind"] == "bandwidth"
    assert w3["fraction_of_ceiling"] == pytest.approx(w3["floor_s"] / (w3["tpot_ms"] / 1e3), rel=1e-2)


def test_make_model_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "q")
    make_model("tiny-qwen2", out, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = model.config
    _, hidden, inter, layers, heads, kv, vocab, tied = SHAPES["tiny-qwen2"]
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.bfloat16
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (hidden, inter, layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (heads, kv, vocab)
    assert cfg.tie_word_embeddings is tied and cfg.max_position_embeddings == 32768 and cfg.rms_norm_eps == 1e-6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == shape_stats("tiny-qwen2")["params"]
    assert model.model.norm.weight.float().eq(1).all()


@pytest.mark.parametrize("shape,params", [("qwen2.5-0.5b-shape", 494_032_768), ("qwen2.5-7b-shape", 7_615_616_512),
                                          ("llama-3-8b-shape", 8_030_261_248)])
def test_real_shapes_have_the_published_sizes(shape, params):
    assert shape_stats(shape)["params"] == params


def test_floors_by_hand():
    stats = {"non_embedding_params": 100, "embedding_params": 20, "num_layers": 2, "num_kv_heads": 1,
             "head_dim": 4, "num_heads": 2}
    # weights: 2 B x (100 + 20); KV: 2 x 2 layers x 1 x 4 x 2 B = 32 B per token, mean context 10 + 1.5
    assert decode_bytes_per_token(stats, 10, 4) == 240 + 32 * 11.5
    # fed tokens 3 + 2 - 1 = 4: dense 2 x 100 x 4 + 2 x 20 x 2; attention 4 x 2 x 2 x 4 x (4 x 5 / 2)
    assert request_flops(stats, 3, 2) == 800 + 80 + 64 * 10
    ceil = {"copy_bandwidth_gbs": 1e-9, "matmul_tflops": 1e-12}   # 1 B/s and 1 FLOP/s
    assert floor_seconds("matmul", stats, ceil, [(3, 2), (3, 2)]) == 2 * 1520
    assert floor_seconds(None, stats, ceil, [(3, 2)]) is None


def test_scale_shrinks_proportionally():
    w = get_workload("W1", 0.5)
    assert len(w.requests) == 128 and len(w.requests[0].prompt_token_ids) == 256 and w.requests[0].max_tokens == 128
    full = get_workload("w2")
    assert len(full.requests) == 256
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in full.requests)
    assert all(100 <= t < 10000 for r in full.requests for t in r.prompt_token_ids)
    assert get_workload("W2").requests[0].prompt_token_ids == full.requests[0].prompt_token_ids  # seed 0
    w5 = get_workload("W5")
    assert w5.requests[0].prompt_token_ids[:1024] == w5.requests[1].prompt_token_ids[:1024]
    assert len(w5.requests[0].prompt_token_ids) == 1152
    w6 = get_workload("W6")
    assert len(w6.requests) == 512 and len(w6.requests[0].prompt_token_ids) == 512
    assert w6.requests[0].max_tokens == 128


def test_bad_arguments_say_what_to_do(tmp_path, capsys):
    assert cli.main(["--workload", "W1", "--model", str(tmp_path)]) == 2
    assert "--make-model" in capsys.readouterr().err
    assert cli.main(["--workload", "W9", "--model", str(tmp_path)]) == 2
    assert cli.main(["--make-model", "gpt-5-shape", str(tmp_path)]) == 2


def test_warmup_shares_a_fresh_prefix_when_the_workload_does():
    """W5's warm-up requests share a prefix as long as the workload's (so the prefix-hit prefill runs before the
    timed part), made of fresh ids (so the workload's own prefix is not cached by the warm-up)."""
    from hayabusa.bench.runner import _common_prefix_len, warmup_requests

    w5 = get_workload("W5", 0.25)
    warm = warmup_requests(w5)
    shared = _common_prefix_len([r.prompt_token_ids for r in w5.requests])
    assert shared == 256 and _common_prefix_len([r.prompt_token_ids for r in warm]) == shared
    assert [len(r.prompt_token_ids) for r in warm] == [len(r.prompt_token_ids) for r in w5.requests[:len(warm)]]
    assert warm[0].prompt_token_ids[:shared] != w5.requests[0].prompt_token_ids[:shared]
    w1 = get_workload("W1", 0.05)
    assert _common_prefix_len([r.prompt_token_ids for r in warmup_requests(w1)]) == 0


def test_workloads_fit_a_small_vocabulary(tmp_path, stories_dir):
    """A trained model with 512 ids (stories260K): ids are mapped into its vocabulary one-to-one, so W5's shared
    prefix stays shared (hits with caching on) and lengths are unchanged; models of record are untouched."""
    from hayabusa.bench.workloads import TOKEN_HIGH, fit_to_vocab

    w = fit_to_vocab(get_workload("W5", 0.02), 512)
    ids = [t for r in w.requests for t in r.prompt_token_ids]
    assert 0 <= min(ids) and max(ids) < 512
    ref = get_workload("W5", 0.02)
    assert [len(r.prompt_token_ids) for r in w.requests] == [len(r.prompt_token_ids) for r in ref.requests]
    big = get_workload("W5", 0.02)
    assert fit_to_vocab(big, TOKEN_HIGH).requests[0].prompt_token_ids == ref.requests[0].prompt_token_ids
    on, off = _bench(tmp_path, "--workload", "W5", "--model", stories_dir, "--scale", "0.02")
    assert "error" not in on and "error" not in off
    assert on["prefix_cache_hit_rate"] > 0.3 and off["prefix_cache_hit_rate"] == 0.0


def test_unsupported_architecture_is_refused_before_any_run(tmp_path, stories_dir, capsys):
    """The same error as LLM() / generate / serve, exit status 2, no traceback (a model_type transformers does
    not know either)."""
    import shutil

    bad = tmp_path / "foo"
    shutil.copytree(stories_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["FooForCausalLM"], model_type="foo")
    (bad / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["--workload", "W1", "--model", str(bad), "--scale", "0.02", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "FooForCausalLM" in err and "LlamaForCausalLM" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("args,names", [
    (["--engine", "hf", "--hf-batch-size", "-2"], ["--hf-batch-size", "-2"]),
    (["--engine", "hf", "--hf-batch-size", "0"], ["--hf-batch-size", "0"]),
    (["--engine", "both", "--sweep", "hf_batch_size=-1,4"], ["--sweep", "-1"]),
    (["--sweep", "max_num_seqs="], ["--sweep", "no values"]),
    (["--sweep", "max_num_seqs=a,b"], ["--sweep", "'a'", "max_num_seqs"]),
    (["--sweep", "max_num_seq=1"], ["async_scheduling", "hf_batch_size"]),
    (["--scale", "inf"], ["--scale", "inf"]),
    (["--device", "cuda"], ["device='cuda'", "CUDA is not available", "device='cpu'"]),
    (["--sweep", "max_num_seqs=1,2", "--sweep", "quantization=none,fp8"], ["--sweep given 2 times"]),
    (["--ceilings-from", "/nonexistent/ceilings.json"], ["--ceilings-from", "cannot read"]),
])
def test_bad_bench_flags_are_refused_by_name(tmp_path, tiny_bench_model, capsys, monkeypatch, args, names):
    """Exit 2 before anything loads, naming the flag and the value (no bogus record, no traceback)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "out.json"
    device = [] if "--device" in args else ["--device", "cpu"]
    assert cli.main(["--workload", "W1", "--model", tiny_bench_model, "--json", str(path), *device, *args]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err
    assert "Traceback" not in err and not path.exists()


def test_make_model_into_a_file_or_unwritable_place_fails(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert cli.main(["--make-model", "tiny-llama", str(a_file), "--device", "cpu"]) == 2
    assert "--make-model" in capsys.readouterr().err and a_file.read_text() == "x"
    assert cli.main(["--make-model", "tiny-llama", str(a_file / "sub"), "--device", "cpu"]) == 2   # under a file
    assert "cannot write there" in capsys.readouterr().err


def test_list_shows_every_make_model_shape(capsys):
    from hayabusa.bench.models import ARCH_SHAPE_NAMES

    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*SHAPES, *ARCH_SHAPE_NAMES])
    assert "GPT2LMHeadModel hidden 2048 intermediate 8192 layers 24 heads 16/16 vocab 44928" in out


def test_hf_run_notes_that_quantization_is_hayabusa_only(tmp_path, tiny_bench_model, capsys):
    """--engine hf with --quantization / --kv-cache-dtype runs (unquantized, as the reference) and says so; an
    empty entry in --workload is ignored."""
    hf, = _bench(tmp_path, "--workload", "W3,", "--model", tiny_bench_model, "--scale", "0.02", "--engine", "hf",
                 "--quantization", "int8", "--kv-cache-dtype", "fp8")
    note = "--quantization int8, --kv-cache-dtype fp8 apply to hayabusa only; the HF baseline runs unquantized."
    assert hf["notes"] == [note] and not hf.get("error")
    assert f"note: {note}" in capsys.readouterr().out


def test_host_summary_on_cpu_says_the_forward_is_in_launch():
    extra = {"timed_steps": 12, "host_wait_s": 0.0, "host_schedule_s": 0.0123, "host_launch_s": 0.5,
             "host_collect_s": 0.004}
    assert cli._host_summary(extra, on_cpu=True) == (
        ", 12 steps, host s (CPU: the forward runs inside launch): wait 0.000 schedule 0.012 launch 0.50 "
        "collect 0.004")
    assert cli._host_summary(extra).startswith(", 12 steps, host s: wait 0.000")


def test_table_error_rows_are_short_and_the_message_follows():
    from hayabusa.bench import report

    env = {"gpu": "cpu", "commit": "c", "date": "d", "versions": {}}
    msg = "HayabusaValidationError: quantization='awq' needs a checkpoint with a quantization_config " + "x" * 80
    bad = report.error_record("W1", engine="hayabusa", model="tiny", engine_args={}, env=env,
                              variant={"quantization": "awq"}, error=msg)
    good = {**{k: None for k in REQUIRED_KEYS}, "workload": "W1", "model": "tiny", "engine": "hayabusa",
            "variant": {}, "output_throughput": 12.5, "total_throughput": 100.0, "startup_s": 1.0, "extra": {}}
    lines = report.format_table([good, bad]).splitlines()
    assert lines[3] == "W1        tiny   hayabusa  quantization=awq  ERROR (see below)"
    assert len(lines[2]) <= len(lines[0]) and all(line == line.rstrip() for line in lines)
    assert lines[4:] == ["errors:", f"  [W1 hayabusa quantization=awq] {msg}"]


def test_a_bench_checkpoint_without_a_tokenizer_says_how_to_run_it(tiny_bench_model):
    """A `--make-model` checkpoint has no tokenizer: LLM() names `tokenizer` and the two ways around it."""
    from hayabusa import LLM
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError, match="skip-tokenizer-init") as e:
        LLM(tiny_bench_model, device="cpu")
    assert e.value.parameter == "tokenizer" and "--tokenizer" in str(e.value)
    assert LLM(tiny_bench_model, device="cpu", skip_tokenizer_init=True).llm_engine.tokenizer is None


def test_structured_output_json_constrains_every_request(tmp_path, tiny_bench_model, stories_dir):
    pytest.importorskip("xgrammar")
    recs = _bench(tmp_path, "--workload", "W1", "--model", tiny_bench_model, "--scale", "0.02",
                  "--structured-output", "json", "--tokenizer", stories_dir)
    (r,) = recs
    assert not r.get("error") and r["output_throughput"] > 0
    assert r["extra"]["structured_output"] == "json" and r["extra"]["grammar_compile_s"] > 0
    assert 0 < r["output_tokens"] <= get_workload("W1", 0.02).num_output_tokens


def test_gc_timer_counts_collector_passes_and_uninstalls():
    import gc

    from hayabusa.bench.common import GCTimer

    pauses: list[float] = []
    with GCTimer(on_pause=pauses.append) as g:
        gc.collect()
        gc.collect()
    assert g.passes == 2 and len(pauses) == 2
    assert g.seconds == pytest.approx(sum(pauses)) and g.seconds > 0
    gc.collect()                      # removed on exit: no further pass is counted
    assert g.passes == 2 and g._callback not in gc.callbacks


def test_batch_invariant_flag_and_sweep_turn_the_mode_on(tmp_path, tiny_bench_model, monkeypatch):
    """`hayabusa bench --batch-invariant` (issue #23's cost measurement) and `--sweep batch_invariant=false,true`
    reach the engine: the records carry the argument and the engine's mode check runs once per engine in the mode,
    never for the default."""
    import hayabusa.batch_invariant as bi

    calls = []
    real = bi.check_batch_invariant
    monkeypatch.setattr(bi, "check_batch_invariant", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    (rec,) = _bench(tmp_path, "--workload", "W3", "--model", tiny_bench_model, "--scale", "0.02", "--batch-invariant")
    assert rec["engine_args"]["batch_invariant"] is True and len(calls) == 1
    off, on = _bench(tmp_path, "--workload", "W3", "--model", tiny_bench_model, "--scale", "0.02",
                     "--sweep", "batch_invariant=false,true")
    assert off["variant"] == {"batch_invariant": False} and on["variant"] == {"batch_invariant": True}
    assert len(calls) == 2 and off["output_tokens"] == on["output_tokens"] > 0
