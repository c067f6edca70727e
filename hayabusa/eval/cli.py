"""``hayabusa eval`` (task accuracy over settings, fidelity of logits) and ``hayabusa plan`` (what fits on a GPU).

  hayabusa eval --model M --data FILE.jsonl --task extraction|choice|majority [--sweep key=v1,v2 ...]
                [--reference hf] [--tolerance 0.02] [--output results.jsonl] [--json summary.json]
                [--plot acc_vs_latency.png] [--wandb] [engine args] [sampling args]
  hayabusa eval --fidelity --model M --text FILE [--reference hf|hayabusa-bf16] [--reference-dtype D]
                [--reference-model UNQUANTIZED] [engine args]
  hayabusa plan --model M|HUB_ID|SHAPE [--gpu NAME | --gpu-memory GiB] [--max-model-len N] [--json] ...

Exit codes: 0 ok, 1 a setting failed (its row says why), 2 bad arguments or data.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

from hayabusa.config import EngineArgs
from hayabusa.errors import HayabusaValidationError

TASK_DEFAULTS = {"extraction": {"temperature": 0.0, "max_tokens": 256, "n": 1},
                 "choice": {"temperature": 0.0, "max_tokens": 32, "n": 1},
                 "majority": {"temperature": 0.8, "max_tokens": 512, "n": 8}}
SAMPLING_FLAGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int, "n": int,
                  "repetition_penalty": float}


# ------------------------------------------------------------------------------------------------ eval
def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand; dispatch to ``run_eval(ns)``."""
    p = subparsers.add_parser("eval", allow_abbrev=False, help="task accuracy across settings (and logit fidelity with --fidelity)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model folder or Hub id (default: the bundled demo model)")
    p.add_argument("--data", help="JSONL: prompt or messages + gold (see hayabusa/eval/data.py); 'receipts': the "
                   "bundled receipts-to-JSON set (5 items)")
    p.add_argument("--task", choices=("extraction", "choice", "majority"), default="extraction")
    p.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                   help="engine or sampling argument values (repeatable: the grid is the product); the table's "
                        "'differ' column counts the items whose output token ids differ from the same setting "
                        "at max_num_seqs=1 (e.g. --sweep max_num_seqs=1,14,16 shows batch effects; without that "
                        "run, from the first max_num_seqs=1 run, else the first run)")
    p.add_argument("--reference", default=None,
                   help="eval: 'hf' (Transformers greedy); fidelity: 'hf' (default) or 'hayabusa-bf16'")
    p.add_argument("--tolerance", type=float, default=0.02, help="flag settings this far below the reference")
    p.add_argument("--output", help="per-item results (JSONL: one line per setting and item)")
    p.add_argument("--json", dest="summary_json", metavar="FILE", help="the table rows + environment as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="accuracy vs latency per setting (needs matplotlib)")
    p.add_argument("--wandb", action="store_true", help="log the table to Weights & Biases (needs wandb)")
    p.add_argument("--limit", type=int, default=None, help="only the first N items")
    p.add_argument("--hf-batch-size", type=int, default=1, help="items per HF generate call (default 1)")
    p.add_argument("--sampling-seed", type=int, default=0,
                   help="sampled runs seed item i with this + i (reproducible, batch-invariant)")
    p.add_argument("--no-warmup", action="store_true", help="no 2-token warm-up before timing")
    p.add_argument("--schema", metavar="FILE|items", default=None,
                   help="extraction: run every setting twice, without and with the output constrained to this JSON "
                        "schema (a file), or to each item's own \"schema\" ('items'); the table's unparsable "
                        "column then counts parse failures with and without the constraint (needs xgrammar)")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    for name, typ in SAMPLING_FLAGS.items():
        defaults = ", ".join(f"{t}={d.get(name)}" for t, d in TASK_DEFAULTS.items())
        p.add_argument("--" + name.replace("_", "-"), dest="sp_" + name, type=typ, default=None,
                       help=f"sampling (default per task: {defaults})" if name in ("temperature", "max_tokens", "n")
                       else f"sampling {name}")
    f = p.add_argument_group("fidelity")
    f.add_argument("--fidelity", action="store_true", help="compare next-token distributions on --text")
    f.add_argument("--text", help="UTF-8 text file for --fidelity")
    f.add_argument("--reference-dtype", default=None, help="reference dtype (default bfloat16 on CUDA, float32 on CPU)")
    f.add_argument("--reference-model", default=None,
                   help="run the reference on this checkpoint instead of --model (e.g. the unquantized original)")
    f.add_argument("--chunk-len", type=int, default=None, help="tokens per chunk, >= 2 (default: max_model_len)")
    f.add_argument("--fidelity-tokens", type=int, default=None,
                   help="use only the first N tokens of the text, N >= 2 (default: all)")
    EngineArgs.add_cli_args(p)
    return p


def _model(ns: argparse.Namespace) -> str:
    if ns.model:
        return ns.model
    from hayabusa.assets import demo_model_dir

    model = demo_model_dir()
    print(f"hayabusa: no --model given; using the bundled demo model stories260K ({model}).", file=sys.stderr)
    return model


def run_eval(ns: argparse.Namespace) -> int:
    """Run ``hayabusa eval``. Returns the exit code."""
    try:
        if ns.fidelity:
            return _run_fidelity(ns)
        if not ns.data:
            raise HayabusaValidationError("give --data FILE.jsonl (or --fidelity --text FILE).", parameter="data")
        if ns.data == "receipts":   # the bundled receipts-to-JSON set
            from hayabusa.assets import receipts_data_path

            ns.data = receipts_data_path()
        _check_task_flags(ns)
        return _run_tasks(ns)
    except HayabusaValidationError as e:
        print(f"hayabusa eval: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError) as e:
        print(f"hayabusa eval: error: {e}", file=sys.stderr)
        return 2


def _check_task_flags(ns: argparse.Namespace) -> None:
    """Refuse bad --data / --limit / --hf-batch-size / --tolerance before any model loads (a negative --limit
    would otherwise slice items off the end, a negative --hf-batch-size turn every reference item into an error)."""
    if not os.path.isfile(ns.data):
        raise HayabusaValidationError(f"--data {ns.data!r}: no such file.", parameter="data", value=ns.data)
    if ns.limit is not None and ns.limit < 1:
        raise HayabusaValidationError(f"--limit {ns.limit}: must be at least 1.", parameter="limit", value=ns.limit)
    if ns.hf_batch_size < 1:
        raise HayabusaValidationError(f"--hf-batch-size {ns.hf_batch_size}: must be at least 1.",
                                      parameter="hf_batch_size", value=ns.hf_batch_size)
    if not (math.isfinite(ns.tolerance) and ns.tolerance >= 0):
        raise HayabusaValidationError(f"--tolerance {ns.tolerance}: must be a finite number >= 0.",
                                      parameter="tolerance", value=ns.tolerance)


def _schemas(ns: argparse.Namespace, items: list) -> list | None:
    """--schema: one JSON schema per item (the file's for all, or each item's "schema"), or None."""
    if not ns.schema:
        return None
    if ns.task != "extraction":
        raise HayabusaValidationError("--schema is for --task extraction.", parameter="schema", value=ns.schema)
    if ns.schema == "items":
        missing = [it.id for it in items if not isinstance(it.extra.get("schema"), dict)]
        if missing:
            raise HayabusaValidationError(f"--schema items: item(s) {missing[:5]} have no \"schema\" object.",
                                          parameter="schema", value=ns.schema)
        return [it.extra["schema"] for it in items]
    with open(ns.schema, encoding="utf-8") as f:
        try:
            schema = json.load(f)
        except ValueError as e:
            raise HayabusaValidationError(f"--schema {ns.schema}: not JSON ({e}).", parameter="schema",
                                          value=ns.schema) from None
    return [schema] * len(items)


def _run_tasks(ns: argparse.Namespace) -> int:
    from hayabusa.eval import data, report
    from hayabusa.eval.sweep import evaluate, parse_sweeps

    model = _model(ns)
    items = data.load_items(ns.data, ns.task)[: ns.limit]
    grid = parse_sweeps(ns.sweep)                       # bad sweep specs fail before anything loads
    engine_args = EngineArgs.cli_kwargs(ns)
    tok = data.load_tokenizer(model, engine_args.get("tokenizer"), bool(engine_args.get("trust_remote_code")))
    data.render_items(items, tok)
    schemas = _schemas(ns, items)
    sampling = {**TASK_DEFAULTS[ns.task],
                **{k[3:]: v for k, v in vars(ns).items() if k.startswith("sp_") and v is not None}}
    # a bad HAYABUSA_BATCH_INVARIANT fails before any run
    engine_line = report.engine_settings_line(engine_args, {k for g in grid for k in g})
    res = evaluate(model, items, ns.task, engine_args, sampling, ns.sweep, ns.reference, ns.tolerance, tok,
                   ns.hf_batch_size, ns.sampling_seed, warmup=not ns.no_warmup, use_tqdm=not ns.no_tqdm,
                   schemas=schemas)
    ref = f"reference: {res.reference} (accuracy {res.reference_accuracy:.3f})" if res.reference else "no reference"
    print(f"\nhayabusa eval: {ns.task} on {len(items)} items of {ns.data}; {ref}; tolerance {ns.tolerance}")
    print(engine_line)
    print(report.format_table(res.rows))
    _print_fields(res.rows)
    if ns.output:
        report.write_jsonl(ns.output, res.records)
        report.say(f"{len(res.records)} per-item results -> {ns.output}")
    if ns.summary_json:
        from hayabusa.batch_invariant import batch_invariant_requested
        from hayabusa.bench.report import environment

        env = environment(engine_args.get("device"))
        with open(ns.summary_json, "w", encoding="utf-8") as f:
            json.dump({"task": ns.task, "data": ns.data, "model": model, "engine_args": engine_args,
                       "batch_invariant": batch_invariant_requested(engine_args.get("batch_invariant")),
                       "sampling": sampling, "reference": res.reference, "tolerance": ns.tolerance, **env,
                       "rows": res.rows}, f, indent=1, ensure_ascii=False, default=str)
    if ns.plot:
        msg = report.plot_accuracy_vs_latency(res.rows, ns.plot, f"{ns.task}: {model} ({len(items)} items)")
        report.say(msg or f"plot -> {ns.plot}")
    if ns.wandb:
        msg = report.log_wandb(res.rows, {"task": ns.task, "model": model, "engine_args": engine_args,
                                          "sampling": sampling, "sweep": ns.sweep, "reference": ns.reference})
        report.say(msg or "logged to wandb")
    return 1 if any(r.get("error") for r in res.rows) else 0


def _print_fields(rows: list[dict[str, Any]]) -> None:
    """Per-field accuracy of each extraction setting (one line per setting)."""
    for r in rows:
        if r.get("per_field"):
            fields = ", ".join(f"{k} {v:.2f}" for k, v in r["per_field"].items())
            print(f"  per field [{r['setting']}]: {fields}")


def _run_fidelity(ns: argparse.Namespace) -> int:
    from hayabusa.eval.fidelity import format_result, run_fidelity

    if not ns.text:
        raise HayabusaValidationError("--fidelity needs --text FILE.", parameter="text")
    if ns.sweep:
        raise HayabusaValidationError(
            f"--sweep does not apply to --fidelity (given: {', '.join(ns.sweep)}); run one --fidelity per setting, "
            "e.g. --quantization int8.", parameter="sweep", value=ns.sweep)
    try:
        with open(ns.text, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise HayabusaValidationError(f"--text {ns.text!r}: cannot read it ({e.strerror}).", parameter="text",
                                      value=ns.text) from None
    res = run_fidelity(_model(ns), text, EngineArgs.cli_kwargs(ns), reference=ns.reference or "hf",
                       reference_dtype=ns.reference_dtype, chunk_len=ns.chunk_len,
                       max_text_tokens=ns.fidelity_tokens, reference_model=ns.reference_model,
                       use_tqdm=not ns.no_tqdm)
    print(format_result(res))
    if ns.summary_json:
        with open(ns.summary_json, "w", encoding="utf-8") as f:
            json.dump(res.as_dict(), f, indent=1)
    return 0


# ------------------------------------------------------------------------------------------------ plan
# The engine arguments that change what fits (unset ones take EngineArgs' defaults; tensor_parallel_size may be > 1
# here: the plan divides weights and KV heads by it).
PLAN_ENGINE_ARGS = ("dtype", "quantization", "kv_cache_dtype", "max_model_len", "gpu_memory_utilization",
                    "max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                    "pipeline_parallel_size",
                    "trust_remote_code", "cpu_offload_gb") + tuple(  # the image limit, once EngineArgs has it (the VL core)
    n for n in ("limit_mm_per_prompt",) if n in {f.name for f in dataclasses.fields(EngineArgs)})


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand; dispatch to ``run_plan(ns)``."""
    from hayabusa.eval.plan import GPUS

    p = subparsers.add_parser("plan", allow_abbrev=False, help="weights, KV bytes per token and what fits on a GPU (config.json only)",
                              description="Reads config.json only (a folder, a Hub id, or a bench shape name such "
                                          "as qwen2.5-7b-shape) and prints what fits. See hayabusa/eval/plan.py "
                                          "for every formula.")
    p.add_argument("--model", required=True, help="model folder, Hub id, or bench shape name")
    p.add_argument("--gpu", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB", help="total GPU memory in GiB")
    p.add_argument("--tp", dest="tensor_parallel_size", type=int, default=None, help="same as --tensor-parallel-size")
    EngineArgs.add_cli_args(p, only=PLAN_ENGINE_ARGS, helps={
        "tensor_parallel_size": "GPUs the weights and KV heads are split over (refused as the engine refuses it)",
        "pipeline_parallel_size": "stages the decoder layers are split into (the plan sizes the largest stage per "
                                  "GPU; refused as the engine refuses it)"})
    p.add_argument("--max-images", type=int, default=None, metavar="N",
                   help="vision-language models: images one prompt may hold (default: limit_mm_per_prompt's, else 1)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="vision-language models: pixels per image after the processor's resize (default: the "
                        "checkpoint's preprocessor_config.json, else 12845056)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _image_limits(ns: argparse.Namespace, args: EngineArgs) -> dict[str, int]:
    """max_images / max_pixels for the vision tower's activation estimate."""
    from hayabusa.eval.plan_vision import max_pixels_of

    limits = getattr(args, "limit_mm_per_prompt", None)
    if isinstance(limits, str):
        try:
            limits = json.loads(limits)
        except ValueError:
            raise HayabusaValidationError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 5}}', got "
                                          f"{limits!r}.", parameter="limit_mm_per_prompt", value=limits) from None
    images = ns.max_images or (limits.get("image") if isinstance(limits, dict) else None) or 1
    pixels = ns.max_pixels or max_pixels_of(ns.model)
    if images < 1 or pixels < 1:
        raise HayabusaValidationError("--max-images and --max-pixels must be positive.", parameter="max_images",
                                      value=(images, pixels))
    return {"max_images": int(images), "max_pixels": int(pixels)}


def run_plan(ns: argparse.Namespace) -> int:
    """Run ``hayabusa plan``. Returns 0, or 2 for bad arguments (the plan itself never fails on "does not fit")."""
    from hayabusa.eval.plan import PlanInputs, format_plan, load_config, make_plan, plan_json

    try:
        args = EngineArgs.from_cli_args(ns, model=ns.model)
        cfg = load_config(ns.model, args.trust_remote_code)
        inp = PlanInputs(dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                         max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         block_size=args.block_size, tp=args.tensor_parallel_size,
                         pp=args.pipeline_parallel_size,
                         cpu_offload_gb=args.cpu_offload_gb, **_image_limits(ns, args))
        plan = make_plan(cfg, inp, ns.gpu, ns.gpu_memory, model=ns.model)
    except HayabusaValidationError as e:
        print(f"hayabusa plan: error: {e}", file=sys.stderr)
        return 2
    print(plan_json(plan) if ns.json else format_plan(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hayabusa.eval.cli eval|plan ...`` (the same as ``hayabusa eval|plan``)."""
    parser = argparse.ArgumentParser(prog="python -m hayabusa.eval.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    add_plan_parser(sub)
    ns = parser.parse_args(argv)
    return run_eval(ns) if ns.command == "eval" else run_plan(ns)


if __name__ == "__main__":
    sys.exit(main())
