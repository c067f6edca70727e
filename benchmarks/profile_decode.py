"""Where the time of one decode step goes: torch.profiler over a W3-style stream (batch 1) and a batch-256 decode.

    python benchmarks/profile_decode.py --model /tmp/hayabusa_models/qwen2.5-7b-shape [--batch 1,256] [--json F]

For each batch size it runs the same greedy requests twice: once with CUDA graphs (what W1/W3 measure; the
profiler still records every kernel inside a replayed graph) and once with ``enforce_eager=True``. It prints, per
run, the wall time per decode step, the summed GPU kernel time per step, and the top kernels by GPU time grouped
into families (GEMM, attention, norm, rotary, store_kv, activation, sampling, copies, other), so the gap between
kernel time and wall time (launch overhead, host work) and the share of each kernel family are visible.
Needs CUDA. Numbers go to BENCHMARKS.md with the date, commit and GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

FAMILIES = [  # (family, substrings of the kernel name, lower case); first match wins
    ("attention", ("paged_attn", "merge_splits", "flash", "attention", "fmha")),
    ("store_kv", ("store_kv",)),
    ("norm", ("rms", "norm")),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "sm90_xmma", "matmul", "splitk", "nvjet", "_mm_")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "exponential", "argmax")),
    ("copy/index", ("copy", "index", "gather", "scatter", "fill", "cat", "memcpy", "memset", "embedding")),
]


def family(name: str) -> str:
    n = name.lower()
    for fam, keys in FAMILIES:
        if any(k in n for k in keys):
            return fam
    return "other"


def kernel_table(prof) -> tuple[float, dict[str, float], list[tuple[str, float, int]]]:
    """(total GPU kernel µs, µs per family, top 25 kernels as (name, µs, calls)) from a finished torch.profiler."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            k[1] += 1
    fams: dict[str, float] = defaultdict(float)
    for name, (us, _) in kernels.items():
        fams[family(name)] += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    return (sum(v[0] for v in kernels.values()), dict(sorted(fams.items(), key=lambda x: -x[1])),
            [(n, us, int(c)) for n, (us, c) in top])


def print_table(families: dict[str, float], top: list[dict], unit: str, key: str, calls: str, n: int) -> None:
    for f, v in families.items():
        print(f"  {f:<12} {v:8.4f} {unit}")
    for k in top[:n]:
        print(f"  {k[key]:8.4f} {unit}  x{k[calls]:<6} {k['family']:<10} {k['name']}")


def profile_run(model: str, batch: int, prompt_len: int, decode_steps: int, eager: bool,
                engine_args: dict | None = None) -> dict:
    from hayabusa import LLM, SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, enforce_eager=eager, max_num_seqs=max(batch, 1),
              max_model_len=prompt_len + decode_steps + 16, gpu_memory_utilization=0.85, **(engine_args or {}))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 10000, size=prompt_len).tolist()} for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    # The warm-up leaves the prompts in the prefix cache, so the measured runs prefill one token per request
    # and the profile is (almost) decode only. Wall time of decode: the full run minus a max_tokens=1 run.
    llm.generate(prompts, warm, use_tqdm=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate(prompts, one, use_tqdm=False)  # the 1-token path warm too (its first run compiles)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t0
    step_ms = (total_s - prefill_s) / max(decode_steps - 1, 1) * 1e3

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
    total_us, fams, top = kernel_table(prof)
    steps = decode_steps  # one prefill step + (decode_steps - 1) decode steps, all in the profile
    del llm
    torch.cuda.empty_cache()
    return {
        "batch": batch, "eager": eager, "prompt_len": prompt_len, "decode_steps": decode_steps,
        "engine_args": engine_args or {},
        "wall_ms_per_decode_step": round(step_ms, 4),
        "kernel_ms_per_step": round(total_us / steps / 1e3, 4),
        "families_ms_per_step": {f: round(us / steps / 1e3, 4) for f, us in fams.items()},
        "top_kernels": [{"name": n[:120], "ms_per_step": round(us / steps / 1e3, 4), "calls_per_step":
                         round(c / steps, 2), "family": family(n)} for n, us, c in top],
    }


def host_functions(stats: pstats.Stats, top: int) -> list[dict]:
    """The ``top`` Python functions of a cProfile run by own time (tottime): where the engine's host time goes."""
    rows = []
    for (file, line, fn), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{file.split('site-packages/')[-1].split('hayabusa/')[-1]}:{line}:{fn}",
                     "calls": ncalls, "tottime_s": round(tottime, 4), "cumtime_s": round(cumtime, 4)})
    return sorted(rows, key=lambda r: -r["tottime_s"])[:top]


def profile_workload(model: str, workload: str, scale: float, engine_args: dict, host_top: int = 0) -> dict:
    """Profile one timed ``hayabusa bench`` workload run (after the bench's own warm-up): kernel families, top
    kernels, wall time and engine steps, to see where e.g. W5's prefix-hit prefill spends its time. With
    ``host_top`` > 0 a further run goes under cProfile and its top Python functions by own time are returned."""
    from hayabusa import LLM
    from hayabusa.bench.runner import _generate, warmup_requests
    from hayabusa.bench.workloads import fit_to_vocab, get_workload

    wl = get_workload(workload, scale)
    llm = LLM(model, skip_tokenizer_init=not wl.has_text, **engine_args)
    wl = fit_to_vocab(wl, llm.llm_engine.config.model_config.vocab_size)
    warm = warmup_requests(wl)
    _generate(llm, warm[:1], use_tqdm=False)
    _generate(llm, warm[1:], use_tqdm=False)
    from hayabusa.bench.runner import step_time_breakdown

    # First without the profiler (its per-kernel bookkeeping slows the host): wall time and where the host's
    # time went, so a GPU starved by the host shows as little wait time.
    stats0 = dict(llm.llm_engine.stats)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _generate(llm, wl.requests, use_tqdm=False)
    torch.cuda.synchronize()
    plain_wall = time.perf_counter() - t0
    host = step_time_breakdown(stats0, llm.llm_engine.stats)
    steps0 = llm.llm_engine.stats.get("num_steps", 0) if hasattr(llm.llm_engine, "stats") else 0
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = _generate(llm, wl.requests, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = (llm.llm_engine.stats.get("num_steps", 0) if hasattr(llm.llm_engine, "stats") else 0) - steps0
    total_us, fams, top = kernel_table(prof)
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    host_fns: list[dict] = []
    if host_top > 0:
        prof_host = cProfile.Profile()
        prof_host.enable()
        _generate(llm, wl.requests, use_tqdm=False)
        torch.cuda.synchronize()
        prof_host.disable()
        host_fns = host_functions(pstats.Stats(prof_host), host_top)
    return {"workload": workload, "host_functions": host_fns, "scale": scale, "engine_args": engine_args, "wall_s": round(wall, 4),
            "unprofiled_wall_s": round(plain_wall, 4), "unprofiled_host": host,
            "engine_steps": steps, "output_tokens": out_tokens,
            "kernel_s": round(total_us / 1e6, 4),
            "families_s": {f: round(us / 1e6, 4) for f, us in fams.items()},
            "top_kernels": [{"name": n[:120], "s": round(us / 1e6, 4), "calls": c, "family": family(n)}
                            for n, us, c in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--eager", default="false,true", help="which modes: false (CUDA graphs), true (eager)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: one run, JSON to this file
    ap.add_argument("--workload", default=None, help="profile one bench workload run instead (e.g. W5)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--no-enable-prefix-caching", action="store_true")
    ap.add_argument("--engine-args", default="{}", help='further engine arguments as JSON, e.g. '
                    '\'{"quantization": "fp8"}\' or \'{"speculative_config": {"method": "ngram"}}\'')
    ap.add_argument("--host-top", type=int, default=0,
                    help="--workload: one more run under cProfile; print its top N Python functions by own time")
    ns = ap.parse_args()
    extra = json.loads(ns.engine_args)
    if ns.workload:
        args = {"enable_prefix_caching": False} if ns.no_enable_prefix_caching else {}
        args.update(extra)
        r = profile_workload(ns.model, ns.workload, ns.scale, args, ns.host_top)
        print(f"=== {ns.workload} x{ns.scale} {args}: wall {r['wall_s']:.3f} s, GPU kernels {r['kernel_s']:.3f} s, "
              f"{r['engine_steps']} engine steps, {r['output_tokens']} output tokens")
        print(f"=== without the profiler: wall {r['unprofiled_wall_s']:.3f} s, host {r['unprofiled_host']}")
        print_table(r["families_s"], r["top_kernels"], "s", "s", "calls", 20)
        for h in r["host_functions"]:
            print(f"  host {h['tottime_s']:8.4f} s own  {h['cumtime_s']:8.4f} s cum  x{h['calls']:<8} {h['function']}")
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(r, f, indent=1)
        return
    if ns.single:  # a child process: one engine per process, so each run gets the whole GPU
        r = profile_run(ns.model, int(ns.batch), ns.prompt_len, ns.decode_steps, ns.eager == "true", extra)
        with open(ns.single, "w") as f:
            json.dump(r, f)
        return
    results = []
    for b in (int(x) for x in ns.batch.split(",")):
        for eager in (x.strip() for x in ns.eager.split(",")):
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                rc = subprocess.run([sys.executable, __file__, "--model", ns.model, "--batch", str(b), "--eager",
                                     eager, "--prompt-len", str(ns.prompt_len), "--decode-steps",
                                     str(ns.decode_steps), "--engine-args", ns.engine_args,
                                     "--single", tmp.name]).returncode
                if rc != 0:
                    print(f"=== batch {b} eager={eager}: failed (exit {rc})")
                    continue
                with open(tmp.name) as f:
                    r = json.load(f)
            results.append(r)
            eager = r["eager"]
            print(f"\n=== batch {b} {'eager' if eager else 'cuda graphs'}: wall {r['wall_ms_per_decode_step']:.3f} "
                  f"ms/step, GPU kernels {r['kernel_ms_per_step']:.3f} ms/step")
            print_table(r["families_ms_per_step"], r["top_kernels"], "ms", "ms_per_step", "calls_per_step", 15)
            if ns.json:
                with open(ns.json, "w") as f:
                    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "model": ns.model, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
