"""``hayabusa bench``: the workloads of BENCHMARKS.md on hayabusa or the HF baseline, ceilings, model shapes.

    hayabusa bench --workload W1 --model DIR [--engine hayabusa|hf|both] [--json out.json] [--scale 0.05]
    hayabusa bench --workload W4 --model DIR --plot w4.png          # W4 sweeps max_num_seqs by itself
    hayabusa bench --workload W1 --model DIR --sweep max_num_seqs=64,128,256 --plot w1.png
    hayabusa bench --make-model qwen2.5-7b-shape /tmp/q7b
    hayabusa bench --ceilings [--workload W3 --model DIR]           # GB/s and TFLOP/s; fractions in the rows

``python -m hayabusa.bench.cli ARGS`` is the same as ``hayabusa bench ARGS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

from hayabusa.bench import report
from hayabusa.bench.ceilings import measure_ceilings
from hayabusa.bench.models import ARCH_SHAPE_NAMES, SHAPES, make_model, model_name, model_stats, shape_config
from hayabusa.bench.runner import payoff_state
from hayabusa.bench.vl_models import VL_SHAPES, make_vl_model, vl_shape_config
from hayabusa.bench.workloads import DESCRIPTIONS, WORKLOADS, Workload, fit_to_vocab, get_workload
from hayabusa.config import NOT_CLI_ARGS, EngineArgs, cli_arg_type, optional_field
from hayabusa.envs import parse_sweep_switch
from hayabusa.errors import HayabusaValidationError

HF_ONLY_KEYS = ("hf_batch_size",)


def _positive_int(s: str) -> int:
    """argparse type of --repeats: an int >= 1, else argparse's usage error naming the value."""
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r} is not an int >= 1")
    return v


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", help=f"comma-separated: {', '.join(WORKLOADS)} (see --list)")
    p.add_argument("--model", help="checkpoint folder (make one with --make-model SHAPE DIR)")
    p.add_argument("--engine", default="hayabusa", choices=("hayabusa", "hf", "both"),
                   help="hayabusa, the HF Transformers baseline, or both side by side (default hayabusa)")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="HF baseline batch size in sequences, >= 1 (default: the whole workload in one batch)")
    p.add_argument("--sweep", action="append", metavar="KEY=V1,V2", help="one run per value of an engine argument "
                   "(e.g. max_num_seqs=64,128,256; hf_batch_size=8,32 for the HF baseline)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="shrink request counts and lengths by this factor (1 = the workload of record)")
    p.add_argument("--json", metavar="FILE", help="write the records (a JSON list), rewritten after every run")
    p.add_argument("--plot", metavar="FILE.png", help="plot a sweep (needs matplotlib)")
    p.add_argument("--make-model", nargs=2, metavar=("SHAPE", "DIR"),
                   help="write a random-weight bf16 checkpoint; shapes: "
                        f"{', '.join(list(SHAPES) + list(ARCH_SHAPE_NAMES) + list(VL_SHAPES))}")
    p.add_argument("--ceilings", action="store_true",
                   help="measure copy GB/s and bf16 matmul TFLOP/s on this GPU (and report fractions of them)")
    p.add_argument("--ceilings-from", metavar="FILE",
                   help="reuse ceilings from a JSON file written by an earlier --ceilings --json run")
    p.add_argument("--no-warmup", action="store_true", help="time the very first requests too")
    p.add_argument("--repeats", type=_positive_int, default=1, metavar="N",
                   help="time each hayabusa run N times on one engine (prefix cache reset between runs) and record "
                        "the median run (even N: the faster middle one; odd N is the plain median), with every "
                        "run's throughput in extra.repeat_output_throughput (default 1; HF runs are timed once)")
    p.add_argument("--structured-output", choices=("json",), default=None,
                   help="json: constrain every request to the bundled receipt JSON schema (needs the model's "
                        "tokenizer, or --tokenizer DIR, and xgrammar)")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bars")
    p.add_argument("--list", action="store_true", help="list workloads and model shapes")
    from hayabusa.bench.serve_bench import add_w6_args

    add_w6_args(p)
    EngineArgs.add_cli_args(p)   # --dtype, --device and --seed apply to the HF baseline too


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an argparse subparsers object; dispatch to ``run_bench(ns)``."""
    p = subparsers.add_parser("bench", allow_abbrev=False, help="run the benchmark workloads (BENCHMARKS.md)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    return p


# ------------------------------------------------------------------------------------------------ variants
def _parse_quantization(s: str) -> str | None:
    return None if s.strip().lower() == "none" else s.strip()   # quantization=none,fp8,int4: "none" = unquantized


# Engine arguments --sweep takes (every flag but the list-valued cuda_graph_sizes) -> how a value parses.
# A switch takes the environment variables' on / off spellings (envs.parse_sweep_switch), and none where its default
# is None (eval --sweep reads them the same way).
SWEEP_TYPES: dict[str, Any] = {
    f.name: {int: int, float: float, str: str}[cli_arg_type(f)] if cli_arg_type(f) != "bool" else
    functools.partial(parse_sweep_switch, key=f.name, nullable=optional_field(f))
    for f in dataclasses.fields(EngineArgs) if f.name not in NOT_CLI_ARGS and cli_arg_type(f) != "list"}
SWEEP_TYPES["quantization"] = _parse_quantization
SWEEP_TYPES["hf_batch_size"] = int


def _parse_sweep(spec: str | None) -> tuple[str, list[Any]] | None:
    """``KEY=V1,V2`` -> (key, typed values). Raises ValueError naming --sweep and the bad part."""
    if not spec:
        return None
    if "=" not in spec:
        raise ValueError(f"--sweep {spec!r}: write KEY=V1,V2 (e.g. max_num_seqs=64,128,256).")
    key, values = spec.split("=", 1)
    key = key.strip().replace("-", "_")
    typ = SWEEP_TYPES.get(key)
    if typ is None:
        raise ValueError(f"--sweep key {key!r} is not a bench engine argument; use one of {', '.join(SWEEP_TYPES)}.")
    raw = [v.strip() for v in values.split(",") if v.strip()]
    if not raw:
        raise ValueError(f"--sweep {spec!r}: no values after '='; write {key}=V1,V2.")
    out = []
    for v in raw:
        try:
            out.append(typ(v))
        except HayabusaValidationError:   # a switch: its own message names the key and the spellings
            raise
        except ValueError:
            raise ValueError(f"--sweep {spec!r}: {v!r} is not a valid {key} (expected {typ.__name__}).") from None
    if key == "hf_batch_size":
        for v in out:
            _check_hf_batch_size(v, f"--sweep {spec!r}: hf_batch_size")
    return key, out


def _check_hf_batch_size(value: int | None, flag: str = "--hf-batch-size") -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} {value}: must be >= 1 sequences (leave --hf-batch-size out to run the whole "
                         "workload as one batch).")


def _variants(workload: Workload, sweep: tuple[str, list[Any]] | None, engine: str) -> list[dict[str, Any]]:
    """Engine-argument overrides, one timed run each (workload variants x sweep values, deduplicated).

    For the HF baseline, max_num_seqs maps to the batch size and engine-only keys are dropped."""
    if engine == "hf" and workload.has_images:
        return [{"hf_batch_size": 1}]      # W8's baseline of record: generate at batch 1, once
    if engine == "hf" and workload.has_text:
        raise ValueError(f"{workload.name} has no HF baseline (it compares speculative decoding on and off); run "
                         "it with --engine hayabusa.")
    base = workload.variants
    if sweep:
        key, values = sweep
        base = [{**v, key: x} for x in values for v in base]
    out: list[dict[str, Any]] = []
    for v in base:
        if engine == "hf":
            v = {"hf_batch_size": v.get("hf_batch_size", v.get("max_num_seqs"))} \
                if ("hf_batch_size" in v or "max_num_seqs" in v) else {}
        else:
            v = {k: x for k, x in v.items() if k not in HF_ONLY_KEYS}
        if v not in out:
            out.append(v)
    return out or [{}]


def _engine_args(ns: argparse.Namespace, workload: Workload, variant: dict[str, Any]) -> dict[str, Any]:
    """The kwargs of LLM(...): the user's flags, the variant, skip_tokenizer_init, and on CPU a max_model_len
    that fits the workload (the CPU KV cache is sized for max_num_seqs x max_model_len)."""
    args = {**workload.engine_defaults, **EngineArgs.cli_kwargs(ns)}   # W8: max_model_len, limit_mm_per_prompt
    args.update(variant)
    # a grammar needs the tokenizer, and so do image prompts (the chat template)
    args["skip_tokenizer_init"] = not (getattr(ns, "structured_output", None) or workload.has_images
                                       or workload.has_text)
    device = args.get("device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and "max_model_len" not in args:
        args["max_model_len"] = -(-workload.max_seq_len // 16) * 16
    return args


# ------------------------------------------------------------------------------------------------ running
def _hint(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of GPU memory: lower --max-num-seqs / --hf-batch-size / --gpu-memory-utilization."
    if isinstance(e, (FileNotFoundError, OSError)) and "config.json" in str(e):
        return "no checkpoint there: make one with `hayabusa bench --make-model qwen2.5-0.5b-shape DIR`."
    return "see the traceback above; rerun this workload alone with --no-tqdm to see the full log."


def _run_one(ns: argparse.Namespace, engine: str, workload: Workload, variant: dict[str, Any]
             ) -> tuple[Any, dict[str, Any]]:
    from hayabusa.bench.runner import run_hayabusa, run_hf

    tqdm_on = not ns.no_tqdm
    if engine == "hf":
        bs = variant.get("hf_batch_size") or ns.hf_batch_size or (1 if workload.name == "W3" else None)
        hf_args = {"dtype": ns.dtype, "device": ns.device, "seed": ns.seed or 0, "hf_batch_size": bs,
                   "attn_implementation": "sdpa"}
        note = _hf_ignored_note(ns)
        if note:
            print(f"hayabusa bench: note: {note}", flush=True)
        if workload.has_images:    # W8: the VL model's generate, batch 1
            from hayabusa.bench.hf_vl import run_hf_images

            dev = torch.device(ns.device if ns.device not in (None, "auto") else
                               ("cuda" if torch.cuda.is_available() else "cpu"))
            return run_hf_images(ns.model, workload, ns.dtype, dev, seed=ns.seed or 0, warmup=not ns.no_warmup,
                                 use_tqdm=tqdm_on), {**hf_args, "hf_batch_size": 1}
        res = run_hf(ns.model, workload, batch_size=bs, dtype=ns.dtype, device=ns.device, seed=ns.seed or 0,
                     warmup=not ns.no_warmup, use_tqdm=tqdm_on)
        if note:
            res.notes.append(note)
        return res, hf_args
    args = _engine_args(ns, workload, variant)
    return run_hayabusa(ns.model, workload, args, warmup=not ns.no_warmup, use_tqdm=tqdm_on,
                        structured_output=getattr(ns, "structured_output", None),
                        repeats=getattr(ns, "repeats", 1)), args


HAYABUSA_ONLY_FLAGS = ("quantization", "kv_cache_dtype")


def _hf_ignored_note(ns: argparse.Namespace) -> str | None:
    """The note of an HF run given --quantization / --kv-cache-dtype (or a sweep of them): the HF baseline always
    runs the checkpoint unquantized with a model-dtype KV cache (with --engine both, it is the reference)."""
    given = [f"--{k.replace('_', '-')} {getattr(ns, k)}" for k in HAYABUSA_ONLY_FLAGS
             if getattr(ns, k, None) not in (None, "auto")]
    sweep_key = (ns.sweep or "").split("=", 1)[0].strip().replace("-", "_")
    if sweep_key in HAYABUSA_ONLY_FLAGS:
        given.append(f"--sweep {ns.sweep}")
    if not given:
        return None
    return f"{', '.join(given)} apply to hayabusa only; the HF baseline runs unquantized."


def _summary(rec: dict[str, Any]) -> str:
    if rec.get("error"):
        return f"[{rec['workload']} {rec['engine']} {rec['variant']}] FAILED: {rec['error']}"
    frac = rec["fraction_of_ceiling"]
    ttft = "-" if rec["ttft_ms"] is None else f"{rec['ttft_ms']:.1f} ms"
    tpot = "-" if rec["tpot_ms"] is None else f"{rec['tpot_ms']:.2f} ms"  # W3 and W11 (Workload.reports_tpot)
    if rec.get("tpot_mean_ms") is not None:
        tpot += f" (mean {rec['tpot_mean_ms']:.2f} ms)"
    return (f"[{rec['workload']} {rec['engine']} {rec['variant'] or ''}] {rec['output_throughput']:.1f} out tok/s, "
            f"{rec['total_throughput']:.1f} total tok/s, TTFT {ttft}, TPOT {tpot}, "
            f"{rec['elapsed_s']:.2f} s, startup {rec['startup_s']:.2f} s"
            + (f", {100 * frac:.1f}% of {rec['ceiling_kind']} ceiling" if frac is not None else "")
            + _repeats_summary(rec.get("extra") or {}) + _spec_summary(rec.get("extra") or {}) + _tier_summary(rec)
            + _host_summary(rec.get("extra") or {}, on_cpu=rec.get("gpu") == "cpu"))


def _repeats_summary(extra: dict[str, Any]) -> str:
    """', median of N runs (out tok/s A, B, C)' for a run timed --repeats N > 1 times (even N: ', faster middle run
    of N runs (...)', as it is), else ''."""
    tps = extra.get("repeat_output_throughput")
    if not tps:
        return ""
    which = "median" if len(tps) % 2 else "faster middle run"
    return f", {which} of {len(tps)} runs (out tok/s {', '.join(f'{t:.1f}' for t in tps)})"


def _spec_summary(extra: dict[str, Any]) -> str:
    """', speculative METHOD k=K, acceptance A/D (P%)' for a run with speculative decoding, else ''; with the
    measured turn-off rule (``disable_by_payoff``) also ', payoff rule at its end: batch<=B spec|off (S spec / P
    plain steps), ...' (``runner.payoff_state``), so a run whose rule turned speculation off says so."""
    spec = extra.get("speculative_config")
    if not spec:
        return ""
    drafted, rate = extra.get("spec_decode_num_draft_tokens"), extra.get("spec_decode_acceptance_rate")
    acc = "" if not drafted else (f", acceptance {extra.get('spec_decode_num_accepted_tokens')}/{drafted}"
                                  + ("" if rate is None else f" ({100 * rate:.1f}%)"))
    payoff = extra.get("spec_decode_payoff")
    rule = f", payoff rule at its end: {payoff_state(payoff)}" if payoff else ""
    return f", speculative {spec.get('method')} k={spec.get('num_speculative_tokens')}{acc}{rule}"


def _tier_summary(rec: dict[str, Any]) -> str:
    """A record that ``report.shows_tier`` (W1P, W10, any run that preempted or used the CPU tier): ', N preemptions
    (S by swap), O blocks swapped out / I in, H CPU prefix hit blocks' of the timed run, else ''."""
    extra = rec.get("extra") or {}
    if not report.shows_tier(rec) or "num_preemptions" not in extra:
        return ""
    return (f", {extra['num_preemptions']} preemptions ({extra.get('num_swap_preemptions', 0)} by swap), "
            f"{extra.get('num_blocks_swapped_out', 0)} blocks swapped out / {extra.get('num_blocks_swapped_in', 0)} "
            f"in, {extra.get('cpu_prefix_cache_hit_blocks', 0)} CPU prefix hit blocks")


def _secs(x: float) -> str:
    return f"{x:.3f}" if x < 0.1 else f"{x:.2f}"


def _host_summary(extra: dict[str, Any], on_cpu: bool = False) -> str:
    """', N steps, host s: wait X schedule Y launch Z collect W' from the timed run's step breakdown, if any.
    On CPU the forward runs synchronously inside launch (wait is ~0), and the line says so."""
    if "host_wait_s" not in extra:
        return ""
    where = "host s (CPU: the forward runs inside launch)" if on_cpu else "host s"
    return (f", {extra['timed_steps']} steps, {where}: wait {_secs(extra['host_wait_s'])} schedule "
            f"{_secs(extra['host_schedule_s'])} launch {_secs(extra['host_launch_s'])} "
            f"collect {_secs(extra['host_collect_s'])}")


def _run_workloads(ns: argparse.Namespace, ceilings: dict | None, records: list[dict[str, Any]]) -> int:
    """Run every (workload, engine, variant); append records (rewriting --json after each). Returns #failures."""
    env = report.environment(ns.device)
    sweep = _parse_sweep(ns.sweep)
    stats = model_stats(ns.model)
    name = model_name(ns.model)
    elem = 4 if str(ns.dtype) in ("float32", "float", "fp32") else 2
    engines = ("hayabusa", "hf") if ns.engine == "both" else (ns.engine,)
    failures = 0
    for wname in [w for w in ns.workload.split(",") if w.strip()]:
        workload = fit_to_vocab(get_workload(wname, ns.scale), (stats or {}).get("vocab_size"))
        for engine in engines:
            variants = _variants(workload, sweep, engine)
            for i, variant in enumerate(variants):
                print(f"hayabusa bench: {workload.name} on {engine} [{i + 1}/{len(variants)}] {variant or ''} "
                      f"({len(workload.requests)} requests, scale {ns.scale})", flush=True)
                try:
                    res, args = _run_one(ns, engine, workload, variant)
                    rec = report.make_record(workload, res, engine=engine, model=name, engine_args=args, env=env,
                                             variant=variant, stats=stats, ceilings=ceilings, elem_bytes=elem)
                except Exception as e:  # noqa: BLE001 -- one failed run must not lose the others
                    traceback.print_exc()
                    print(f"hayabusa bench: {workload.name} on {engine} failed: {e}\n  next: {_hint(e)}",
                          file=sys.stderr, flush=True)
                    rec = report.error_record(workload.name, engine=engine, model=name,
                                              engine_args=_failed_run_args(ns, engine, workload, variant), env=env,
                                              variant=variant, error=f"{type(e).__name__}: {e}")
                    failures += 1
                if workload.name == "W9" and not rec.get("error"):   # requests/s and ms per request
                    rec.setdefault("extra", {}).update(requests_per_s=round(res.num_requests / res.elapsed_s, 3),
                                                       ms_per_request=round(1e3 * res.elapsed_s / res.num_requests,
                                                                            3))
                records.append(rec)
                print(_summary(rec), flush=True)
                if ns.json:
                    report.write_json(ns.json, records)
        if workload.name == "W9":
            print(w9_summary(records), flush=True)
    return failures


def _failed_run_args(ns: argparse.Namespace, engine: str, workload: Workload, variant: dict[str, Any]
                     ) -> dict[str, Any]:
    """The engine arguments of a hayabusa run that failed, for its error row's config cell (`--quantization int8`
    given outside the sweep shows there as in the good rows); {} for HF runs or when they cannot be built."""
    if engine != "hayabusa":
        return {}
    try:
        return _engine_args(ns, workload, variant)
    except Exception:  # noqa: BLE001 -- the row's error already says what failed
        return {}


def w9_summary(records: list[dict[str, Any]]) -> str:
    """hayabusa's requests/s against HF batch 1 and HF's best batch (the W9 records of this run)."""
    def rps(r):
        return (r.get("extra") or {}).get("requests_per_s")

    w9 = [r for r in records if r.get("workload") == "W9" and rps(r)]
    ours = [r for r in w9 if r["engine"] == "hayabusa"]
    hf = [r for r in w9 if r["engine"] == "hf"]
    parts = [f"hayabusa {rps(r):.1f} req/s ({r['extra']['ms_per_request']:.2f} ms/request)" for r in ours]
    hf1 = [r for r in hf if (r.get("variant") or {}).get("hf_batch_size") == 1]
    best = max(hf, key=rps, default=None)
    if hf1:
        parts.append(f"HF batch 1 {rps(hf1[0]):.2f} req/s")
    if best is not None:
        parts.append(f"HF best (batch {(best.get('variant') or {}).get('hf_batch_size')}) {rps(best):.1f} req/s")
    if ours and hf1:
        parts.append(f"{rps(ours[0]) / rps(hf1[0]):.1f}x HF batch 1")
    if ours and best is not None:
        parts.append(f"{rps(ours[0]) / rps(best):.1f}x HF best")
    return "W9: " + ", ".join(parts)


def _load_ceilings(path: str) -> dict | None:
    """Ceilings from an earlier JSON (a record list, a ceilings record, or the bare dict); None if absent."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--ceilings-from {path!r}: cannot read it ({e}); give the JSON an earlier "
                         "`hayabusa bench --ceilings --json FILE` wrote.") from None
    items = data if isinstance(data, list) else [data]
    for item in items:
        if isinstance(item, dict) and "copy_bandwidth_gbs" in item:
            return item
        if isinstance(item, dict) and isinstance(item.get("ceilings"), dict):
            return item["ceilings"]
    return None


def _get_ceilings(ns: argparse.Namespace, records: list[dict[str, Any]]) -> dict | None:
    ceilings = None
    if ns.ceilings_from:
        ceilings = _load_ceilings(ns.ceilings_from)
        here = report.gpu_name(ns.device)
        if ceilings and ceilings.get("gpu") != here:
            print(f"hayabusa bench: ceilings in {ns.ceilings_from} are for {ceilings.get('gpu')}, not {here}; "
                  "ignored.", file=sys.stderr)
            ceilings = None
    if ns.ceilings and ceilings is None:
        ceilings = measure_ceilings(ns.device)
        if ceilings:
            print(f"hayabusa bench: ceilings on {ceilings['gpu']}: copy {ceilings['copy_bandwidth_gbs']} GB/s "
                  f"(read+write), bf16 matmul {ceilings['matmul_tflops']} TFLOP/s", flush=True)
            env = report.environment(ns.device)
            records.append({**{k: None for k in report.REQUIRED_KEYS}, **env, "workload": "ceilings",
                            "engine": None, "model": None, "ceilings": ceilings})
    return ceilings


def _list() -> None:
    print("workloads:")
    for k, v in DESCRIPTIONS.items():
        print(f"  {k:8s} {v}")
    print("model shapes (--make-model SHAPE DIR):")
    for k in list(SHAPES) + list(ARCH_SHAPE_NAMES) + list(VL_SHAPES):
        c = vl_shape_config(k) if k in VL_SHAPES else shape_config(k)
        arch = c.architectures[0]
        c = c.get_text_config() if k in VL_SHAPES else c
        h, heads = c.hidden_size, c.num_attention_heads
        inter = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or getattr(c, "d_ff", None) \
            or 4 * h   # GPT-2: 4 x hidden; T5: d_ff
        kv = getattr(c, "num_key_value_heads", None) or heads
        # T5 v1.1 (transformers 5.2x forces tie_word_embeddings and keeps the checkpoint's value as
        # scale_decoder_outputs)
        tied = getattr(c, "scale_decoder_outputs", getattr(c, "tie_word_embeddings", False))
        print(f"  {k:20s} {arch} hidden {h} intermediate {inter} layers {c.num_hidden_layers} "
              f"heads {heads}/{kv} vocab {c.vocab_size} tied {bool(tied)}")


def _workload_names(spec: str | None) -> list[str]:
    """--workload "W1,W3," -> ["W1", "W3"] (empty entries are ignored)."""
    return [w.strip() for w in (spec or "").split(",") if w.strip()]


def _check_args(ns: argparse.Namespace) -> None:
    """Flags that need no model: device, --hf-batch-size, --make-model's folder, one --sweep (left in ns.sweep as a
    string). Raises ValueError naming the flag."""
    sweeps = ns.sweep or []
    if len(sweeps) > 1:
        raise ValueError(f"--sweep given {len(sweeps)} times ({', '.join(sweeps)}): bench sweeps one engine argument "
                         "per run; run one bench per key, or set the others as flags (e.g. --quantization fp8).")
    ns.sweep = sweeps[0] if sweeps else None
    if ns.ceilings_from:
        _load_ceilings(ns.ceilings_from)   # a missing or broken file: ValueError naming --ceilings-from
    if ns.device not in (None, "auto"):
        from hayabusa.config import resolve_device

        resolve_device(ns.device)    # "device='cuda': CUDA is not available on this machine; use device='cpu'."
    _check_hf_batch_size(ns.hf_batch_size)
    if ns.make_model:
        shape, out_dir = ns.make_model
        if shape not in VL_SHAPES:
            shape_config(shape)      # an unknown shape: ValueError listing the known ones
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise ValueError(f"--make-model {shape} {out_dir!r}: that path is a file, not a folder; give a new or "
                             "existing folder.")


def _on_cpu(ns: argparse.Namespace) -> bool:
    return ns.device == "cpu" or (ns.device in (None, "auto") and not torch.cuda.is_available())


def _suggested_shape(ns: argparse.Namespace) -> str:
    """The --make-model shape to suggest: tiny-llama on the CPU (a real shape takes minutes there), else the 0.5b."""
    return "tiny-llama" if _on_cpu(ns) else "qwen2.5-0.5b-shape"


def _shape_hint(ns: argparse.Namespace) -> str:
    return (" (a tiny random-weight Llama for the CPU; qwen2.5-0.5b-shape and larger are for a GPU)" if _on_cpu(ns)
            else " (tiny-llama for a quick CPU run; see --list for the shapes)")


# Engine flags whose value is JSON on the command line -> the parser that checks it (HayabusaValidationError).
def _json_arg_checkers() -> dict[str, Any]:
    from hayabusa.multimodal.processor import check_limit_mm_per_prompt
    from hayabusa.spec_decode.config import parse_speculative_config

    return {"speculative_config": parse_speculative_config, "limit_mm_per_prompt": check_limit_mm_per_prompt}


SPEC_EXAMPLE = """ Write a JSON object, e.g. --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'."""


def check_engine_json_args(ns: argparse.Namespace) -> None:
    """Check the JSON-valued engine flags (--speculative-config, --limit-mm-per-prompt; also as the --sweep key)
    before any run starts, so that a bad value is one line naming the flag, not a traceback per run.

    Raises:
        ValueError: ``argument --speculative-config: <why>`` (the flag, then the parser's message: the key and value).
    """
    sweep = _parse_sweep(ns.sweep)
    for name, check in _json_arg_checkers().items():
        values = [getattr(ns, name, None)]
        if sweep and sweep[0] == name:
            values += sweep[1]
        for value in values:
            if value is None:
                continue
            try:
                check(value)
            except ValueError as e:
                # not JSON, or not an object: show the shape (a bad key or number is named by the parser)
                example = SPEC_EXAMPLE if getattr(e, "parameter", None) == "speculative_config" else ""
                raise ValueError(f"argument --{name.replace('_', '-')}: {e}{example}") from None


def _make_model(ns: argparse.Namespace) -> int:
    """--make-model SHAPE DIR. Returns 0, or 2 when the folder cannot be written."""
    shape, out_dir = ns.make_model
    try:
        make = make_vl_model if shape in VL_SHAPES else make_model
        info = make(shape, out_dir, device=ns.device if ns.device not in (None, "auto") else None)
    except OSError as e:
        print(f"hayabusa bench: --make-model {shape} {out_dir!r}: cannot write there ({e}).", file=sys.stderr)
        return 2
    except ValueError as e:   # a VL shape without the Qwen tokenizer at hand
        print(f"hayabusa bench: --make-model {shape}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info), flush=True)
    return 0


def run_bench(ns: argparse.Namespace) -> int:
    """Run what the ``bench`` flags ask for. Returns the exit code (0 ok, 1 a run failed, 2 bad arguments)."""
    if ns.list:
        _list()
        return 0
    try:
        _check_args(ns)
    except ValueError as e:
        print(f"hayabusa bench: {e}", file=sys.stderr)
        return 2
    workloads = _workload_names(ns.workload)
    ns.workload = ",".join(workloads) or None
    if ns.make_model:
        rc = _make_model(ns)
        if rc or not ns.workload:
            return rc
        ns.model = ns.model or ns.make_model[1]
    if "W6" in [w.upper() for w in workloads]:
        from hayabusa.bench.serve_bench import run_w6

        try:
            import httpx  # noqa: F401  (the client W6 drives the server with)
        except ImportError:
            print("hayabusa bench: W6 is an HTTP client of a running server and needs httpx: "
                  "pip install 'hayabusa[serve]' (the server needs it too).", file=sys.stderr)
            return 2
        return run_w6(ns)     # a client of a running server: --model is its served name, not a folder
    if not ns.workload and not ns.ceilings:
        print("hayabusa bench: give --workload W1|W2|W3|W4|W5|W7|W8|W9|W11|startup with --model DIR, --ceilings, or "
              "--make-model SHAPE DIR (see --list).", file=sys.stderr)
        return 2
    if ns.workload and not ns.model:
        print(f"hayabusa bench: --model DIR is required with --workload {ns.workload}: give a checkpoint folder; "
              f"make one with `hayabusa bench --make-model {_suggested_shape(ns)} DIR`{_shape_hint(ns)}.",
              file=sys.stderr)
        return 2
    if ns.workload and not os.path.isfile(os.path.join(ns.model, "config.json")):
        print(f"hayabusa bench: --model {ns.model!r} is not a checkpoint folder (no config.json); make one with "
              f"`hayabusa bench --make-model {_suggested_shape(ns)} DIR`{_shape_hint(ns)}.", file=sys.stderr)
        return 2
    try:
        if ns.workload:
            for w in workloads:
                get_workload(w, ns.scale)       # fail on a bad name before loading anything
            _parse_sweep(ns.sweep)
            check_engine_json_args(ns)      # --speculative-config / --limit-mm-per-prompt, before any run
            if ns.engine != "hf":           # the architecture hayabusa must run, checked before any run starts
                from hayabusa.config import load_hf_config
                from hayabusa.model.registry import resolve_architecture

                resolve_architecture(load_hf_config(ns.model, trust_remote_code=False))
    except ValueError as e:
        print(f"hayabusa bench: {e}", file=sys.stderr)
        return 2
    return _run(ns)


def _run(ns: argparse.Namespace) -> int:
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    failures = 0
    try:
        ceilings = _get_ceilings(ns, records)
        if ns.json and records:
            report.write_json(ns.json, records)
        if ns.workload:
            failures = _run_workloads(ns, ceilings, records)
    except KeyboardInterrupt:
        print("hayabusa bench: interrupted; the records so far follow.", file=sys.stderr)
        failures = 130
    rows = [r for r in records if r["workload"] != "ceilings"]
    if rows:
        print("\n" + report.format_table(rows))
    if ns.json:
        report.write_json(ns.json, records)
        print(f"hayabusa bench: {len(records)} record(s) -> {ns.json}")
    if ns.plot and rows:
        msg = report.plot_sweep(rows, ns.plot)
        print(f"hayabusa bench: {msg}" if msg else f"hayabusa bench: plot -> {ns.plot}", file=sys.stderr)
    print(f"hayabusa bench: done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 130 if failures == 130 else (1 if failures else 0)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m hayabusa.bench.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
