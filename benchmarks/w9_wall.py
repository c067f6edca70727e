"""W9's bench wall split into the engine's steps and everything outside them (issue #17).

    python benchmarks/w9_wall.py --fake-forward                       # CPU: a tiny random T5, model faked
    python benchmarks/w9_wall.py --device cuda --model /tmp/hayabusa_models/t5-small-shape   # the GPU run
    python benchmarks/w9_wall.py --device cuda --model DIR --repeats 3 --json w9_wall.json

Runs ``hayabusa bench --workload W9``'s hayabusa path exactly as ``hayabusa/bench/runner.py`` does (the same engine
arguments: no tokenizer, max_num_seqs 256, max_model_len the model's on CUDA; the same warm-up: 4 requests of 2
tokens; the same prompts; one SamplingParams per request built inside the timer; the progress bar on unless
``--no-tqdm``) and times the bench's timed region ``--repeats`` times in one process, the first one being what
the bench reports (the engine has seen only the warm-up), the others the same requests on a warm engine. Each
timed region is split into (seconds and % of the wall):

    params        the bench's own work before LLM.generate: a SamplingParams per request
    add           LLM.generate queueing the requests (prompt checks, Request and output state per request)
    pre_step      the rest of LLM.generate before its first step (argument checks, the heap frozen)
    steps         inside LLMEngine.step (the engine's own per-phase seconds beside it: schedule, launch (on CPU
                  the model's compute too), wait (the host idle on the device), collect; and output: the
                  OutputProcessor)
    between       between the steps: LLM.generate's loop (finished outputs collected, the progress bar)
    post_step     after the last step until LLM.generate returns (the outputs in input order, the heap unfrozen)
    sync          after LLM.generate until the bench's timer stops (its device synchronize)
    gc            of all that, time in Python's cyclic garbage collector (inside the rows above)

and, on CUDA, what the timed region did for the first time: Triton kernels compiled (by name) and new CUDA
memory segments (cudaMalloc) taken by PyTorch's allocator, and its retries (the cache freed to retry a failed
cudaMalloc: a device sync each). A first repeat much slower than the second with
compiles or new segments in it is warm-up cost inside the bench's timer, not steady throughput.

For a before / after comparison run the same command with ``PYTHONPATH`` at the other checkout (this script
measures the ``hayabusa`` that Python imports first).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))   # PYTHONPATH first: another checkout of hayabusa can be measured
sys.path.append(str(REPO / "benchmarks"))

ROWS = ("params", "add", "pre_step", "steps", "between", "post_step", "sync")
ENGINE_PHASES = ("schedule_s", "launch_s", "wait_s", "collect_s")


class _Compiles:
    """Counts Triton JIT compiles (by kernel name) while active; a no-op where Triton has no such hook."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._knobs = None

    def __enter__(self) -> "_Compiles":
        try:
            from triton import knobs

            self._knobs = knobs
            self._old = knobs.runtime.jit_post_compile_hook

            def hook(*a, **kw):
                fn = kw.get("fn")
                self.names.append(str(getattr(fn, "name", fn)))
                return False

            knobs.runtime.jit_post_compile_hook = hook
        except Exception:   # no Triton, or an older one without knobs
            self._knobs = None
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._old


def _allocator(cuda: bool) -> tuple[int, int]:
    """(CUDA memory segments PyTorch's allocator has taken so far, times it freed its cache to retry a failed
    cudaMalloc: each retry synchronizes the device); (0, 0) off CUDA."""
    if not cuda:
        return 0, 0
    import torch

    stats = torch.cuda.memory_stats()
    return int(stats.get("segment.all.allocated", 0)), int(stats.get("num_alloc_retries", 0))


def timed_region(llm, reqs, prompts, use_tqdm: bool, cuda: bool) -> dict:
    """The bench's timed region (run_hayabusa: synchronize, clock, ``_generate``, synchronize, clock) with the
    engine's step, add_request and generate wrapped to split it; see the module docstring."""
    from hayabusa.bench import runner as br
    from hayabusa.bench.common import GCTimer, synchronize

    engine = llm.llm_engine
    clock = time.perf_counter
    t: dict = {"add": 0.0, "steps": 0.0, "output": 0.0, "n_steps": 0, "first": None, "last": None,
               "gen0": None, "gen1": None}
    step, add, process, generate = engine.step, engine.add_request, engine.output_processor.process, llm.generate

    def timed_step():
        t0 = clock()
        if t["first"] is None:
            t["first"] = t0
        try:
            return step()
        finally:
            t["last"] = clock()
            t["steps"] += t["last"] - t0
            t["n_steps"] += 1

    def accumulated(fn, key: str):
        """fn, its wall time added to t[key] (add_request -> "add", the output processor -> "output")."""
        def timed(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                t[key] += clock() - t0
        return timed

    def timed_generate(*a, **kw):
        t["gen0"] = clock()
        try:
            return generate(*a, **kw)
        finally:
            t["gen1"] = clock()

    engine.step, engine.add_request, llm.generate = timed_step, accumulated(add, "add"), timed_generate
    engine.output_processor.process = accumulated(process, "output")
    stats0 = dict(engine.stats)
    gc_timer = GCTimer(clock).install()
    seg0, retries0 = _allocator(cuda)
    try:
        with _Compiles() as compiles:
            synchronize(cuda)
            t1 = clock()
            outs = br._generate(llm, reqs, use_tqdm, None, prompts)
            synchronize(cuda)
            elapsed = clock() - t1
    finally:
        gc_timer.remove()
        del engine.step, engine.add_request, llm.generate, engine.output_processor.process
    assert len(outs) == len(reqs) and all(len(o.outputs[0].token_ids) == r.max_tokens for o, r in zip(outs, reqs))
    rows = {"params": t["gen0"] - t1, "add": t["add"], "pre_step": t["first"] - t["gen0"] - t["add"],
            "steps": t["steps"], "between": t["last"] - t["first"] - t["steps"], "post_step": t["gen1"] - t["last"],
            "sync": t1 + elapsed - t["gen1"]}
    engine_phases = {k: engine.stats.get(k, 0.0) - stats0.get(k, 0.0) for k in ENGINE_PHASES}
    seg1, retries1 = _allocator(cuda)
    return {"wall_s": elapsed, "rows": rows, "engine": engine_phases, "output_s": t["output"], "gc_s": gc_timer.seconds,
            "n_steps": t["n_steps"], "requests_per_s": len(reqs) / elapsed, "triton_compiles": compiles.names,
            "new_cuda_segments": seg1 - seg0, "alloc_retries": retries1 - retries0}


def _fake_forward(runner) -> None:
    """``--fake-forward``: host_overhead.py's fixed logits for the decoder, and an encoder that returns zeros of
    its output's shape (its cross K/V are still written): a step is then the engine's host work alone."""
    import torch

    from host_overhead import fake_forward

    fake_forward(runner, runner.max_num_reqs)
    model = runner.model
    d = model.config.d_model
    dtype = model.shared.weight.dtype

    def encode(input_ids, seq_lens):
        return torch.zeros(input_ids.shape[0], d, dtype=dtype, device=input_ids.device)

    model.encode = encode


def _fold(reqs, vocab: int) -> None:
    """A tiny model (vocab below W9's ids): each id folded into [3, vocab)."""
    if any(max(r.prompt_token_ids) >= vocab for r in reqs):
        for r in reqs:
            r.prompt_token_ids = [3 + t % (vocab - 3) for t in r.prompt_token_ids]


def run(model: str, ns) -> dict:
    from hayabusa import LLM
    from hayabusa.bench import runner as br
    from hayabusa.bench import workloads

    wl = workloads.w9()
    reqs = wl.requests[:ns.requests]
    args = {"device": ns.device, "skip_tokenizer_init": True, "enforce_eager": ns.enforce_eager}
    if ns.device == "cpu":       # as the bench's _engine_args: the CPU KV cache is sized by max_model_len
        args["max_model_len"] = -(-wl.max_seq_len // 16) * 16
    if ns.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = ns.gpu_memory_utilization
    llm = LLM(model, **args)
    runner = llm.llm_engine.runner
    cuda = runner.device.type == "cuda"
    _fold(reqs, runner.vocab_size)
    if ns.fake_forward:
        _fake_forward(runner)
    warm = br.warmup_requests(wl)
    _fold(warm, runner.vocab_size)
    for part in (warm[:1], warm[1:]):     # run_hayabusa's warm-up
        br._generate(llm, part, use_tqdm=False)
    prompts = br.bench_prompts(llm.get_tokenizer(), reqs)
    repeats = [timed_region(llm, reqs, prompts, not ns.no_tqdm, cuda) for _ in range(ns.repeats)]
    return {"model": model, "device": str(runner.device), "fake_forward": ns.fake_forward, "requests": len(reqs),
            "tqdm": not ns.no_tqdm, "hayabusa": str(Path(sys.modules["hayabusa"].__file__).parent),
            "repeats": repeats}


def print_table(rec: dict) -> None:
    reps = rec["repeats"]
    fake = " (forward faked)" if rec["fake_forward"] else ""
    print(f"\nW9's bench wall on {rec['model']}, {rec['device']}{fake}: {rec['requests']} requests, progress bar "
          f"{'on' if rec['tqdm'] else 'off'}; repeat 1 is what the bench times (engine warmed by 4 x 2 tokens)")
    head = "".join(f"{f'repeat {i + 1}':>20}" for i in range(len(reps)))
    print(f"{'':>12}{head}")
    for row in ROWS:
        cells = "".join(f"{r['rows'][row]:>10.3f} s{100 * r['rows'][row] / r['wall_s']:>6.1f} %" for r in reps)
        print(f"{row:>12}{cells}")
    print(f"{'wall':>12}" + "".join(f"{r['wall_s']:>10.3f} s{'':>8}" for r in reps))
    print(f"{'req/s':>12}" + "".join(f"{r['requests_per_s']:>12.1f}{'':>8}" for r in reps))
    print("inside the steps (engine stats) and beside the rows:")
    for k in ENGINE_PHASES:
        print(f"{k[:-2]:>12}" + "".join(f"{r['engine'][k]:>10.3f} s{'':>8}" for r in reps))
    for k, name in (("output_s", "output"), ("gc_s", "gc")):
        print(f"{name:>12}" + "".join(f"{r[k]:>10.3f} s{'':>8}" for r in reps))
    print(f"{'steps':>12}" + "".join(f"{r['n_steps']:>12}{'':>8}" for r in reps))
    print(f"{'compiles':>12}" + "".join(f"{len(r['triton_compiles']):>12}{'':>8}" for r in reps))
    print(f"{'segments':>12}" + "".join(f"{r['new_cuda_segments']:>12}{'':>8}" for r in reps))
    print(f"{'retries':>12}" + "".join(f"{r['alloc_retries']:>12}{'':>8}" for r in reps))
    for i, r in enumerate(reps):
        if r["triton_compiles"]:
            print(f"repeat {i + 1} compiled: {', '.join(sorted(set(r['triton_compiles'])))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a T5 checkpoint (default: a tiny random T5 built in a temp dir)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=2000, help="the first N of W9's 2,000 requests")
    p.add_argument("--repeats", type=int, default=2, help="timed regions in one process (the first = the bench's)")
    p.add_argument("--fake-forward", action="store_true",
                   help="fixed logits instead of the decoder, zeros instead of the encoder's output (CPU)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--no-tqdm", action="store_true", help="as the bench's --no-tqdm: no progress bar")
    p.add_argument("--json", default=None, help="write the record here too")
    ns = p.parse_args()
    if ns.repeats < 1 or ns.requests < 1:
        p.error("--repeats and --requests must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            from host_overhead import build_tiny

            model = build_tiny("t5", Path(tmp) / "t5")
        rec = run(model, ns)
    print_table(rec)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
