"""Host cost of one step of the offline engine, measured on CPU (no GPU claim).

    python benchmarks/engine_overhead.py                         # batches 256 and 64, 64 -> 128 tokens, 5 repeats
    python benchmarks/engine_overhead.py --batch 256 --repeats 5
    python benchmarks/engine_overhead.py --batch 256 --profile   # cProfile of one run: the top functions
    python benchmarks/engine_overhead.py --no-async-scheduling   # synchronous steps (the CPU default)
    python benchmarks/engine_overhead.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}'      # speculation configured (issue #21)

``LLM.generate`` on stories260K with ``skip_tokenizer_init`` (as ``hayabusa bench --workload W1`` runs the
0.5b shape, but on the CPU): B requests of P random prompt tokens -> M output tokens, greedy, ``ignore_eos``, all
decoding together at batch B, async scheduling on (as on CUDA) unless ``--no-async-scheduling``. Everything of a
step is real (scheduler, KV blocks, persistent batch, positions / slot_mapping / block tables, the host -> device
buffer copies of the CPU path, greedy argmax, placeholders, output processing) except the model forward, which is
replaced by a constant: a logits tensor [B, 16] fp32 preallocated once, with one 1.0 per row (row i picks token
3 + i % 13), of which the fake returns the first R_s rows. Only 16 columns, not the vocabulary's 512: the greedy
fast path only takes their argmax (which then costs ~7 µs at B = 256 on one core, about a GPU launch, instead of
~140 µs for [256, 512] fp32, a cost that a GPU does not put on the host), so this fake suits greedy runs only.
The fake forward itself costs a slice. The CPU path's input copies (``ModelRunner.copy_inputs``: plain
``copy_`` into the device buffers, and the placeholder gather) run inside the fake, so they count in launch;
on CUDA they go through pinned staging buffers instead, and the forward / sampling are kernel launches (a CUDA
graph replay for decode).

Reported per repeat and as the median of the repeats, over the steady decode steps only (decode-only steps with
all B requests in the batch; prefill steps and the ramp-down at the end are left out):
    steps        such steps in the run
    sched_us     host µs per step in Scheduler.schedule()                    (engine.stats["schedule_s"])
    launch_us    host µs per step in ModelRunner.launch(): batch update, input preparation, copies, sampling
    collect_us   host µs per step turning the step's tokens into outputs: update_from_output + OutputProcessor
    total_us     the three together (wait for the device is ~0 here: the fake forward returns at once)
    cpu_us       thread CPU µs per step of the whole step() (steadier than wall time on a shared machine)
    gc_us        wall µs per step in Python's cyclic garbage collector (part of the phases above)
    us/req       total_us / B

torch runs on one thread, so the CPU time is all of the step's own work.

``--speculative-config JSON``: the engine's ``speculative_config`` (vLLM's dict). With the n-gram method and the
default ``disable_by_batch_size`` (32), batches above it never propose: their steady steps should cost what
they cost without speculation (issue #21); ``--compare-spec`` runs each batch both ways (spec off first, then
on, alternating per repeat) and prints the medians side by side with the ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(Path(os.environ.get("HAYABUSA_ASSETS", REPO.parent / "shared" / "assets")) / "models" / "stories260K")
PHASES = ("schedule_s", "launch_s", "wait_s", "collect_s")


def fake_forward(runner, max_rows: int) -> None:
    """Replace the runner's forward by a slice of preallocated logits (see the module docstring)."""
    import torch

    logits = torch.zeros(max_rows, 16)                                   # [B, 16] fp32: argmax -> ids 3..15
    logits[torch.arange(max_rows), 3 + torch.arange(max_rows) % 13] = 1.0

    def run_model(inp):
        runner.copy_inputs(inp)                # the CPU path's host -> device buffer copies (and placeholders)
        return logits[:len(inp.logits_indices)]

    runner._run_model = run_model


def instrument(engine, records: list[dict]):
    """Record, for every step(), the deltas of engine.stats, its thread CPU time, its time in the garbage
    collector, and what was scheduled. Returns the installed GCTimer (to remove)."""
    from hayabusa.bench.common import GCTimer

    schedule, step = engine.scheduler.schedule, engine.step
    last = {}
    gc_timer = GCTimer().install()

    def recording_schedule():
        out = schedule()
        last["R"], last["T"] = out.num_reqs, out.total_num_scheduled_tokens
        return out

    def recording_step():
        before = {k: engine.stats[k] for k in PHASES}
        last.clear()
        c0, gc0 = time.thread_time(), gc_timer.seconds
        outs = step()
        cpu = time.thread_time() - c0
        records.append(dict({k: engine.stats[k] - before[k] for k in PHASES}, cpu_s=cpu, gc_s=gc_timer.seconds - gc0,
                            R=last.get("R", 0), T=last.get("T", 0)))
        return outs

    engine.scheduler.schedule = recording_schedule
    engine.step = recording_step
    return gc_timer


def run_once(llm, ns: argparse.Namespace, batch: int, seed: int, profile: cProfile.Profile | None) -> dict:
    from hayabusa import SamplingParams

    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(ns.prompt_len)]} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    records: list[dict] = []
    engine = llm.llm_engine
    gc_timer = instrument(engine, records)
    try:
        if profile is not None:
            outs = profile.runcall(llm.generate, prompts, params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step, engine.scheduler.schedule           # back to the class's methods
        gc_timer.remove()
    assert all(len(o.outputs[0].token_ids) == ns.max_tokens for o in outs)
    # Steady decode: every request decodes one token. With async scheduling a step collects the previous
    # step's tokens; the previous step is then a steady step as well, except for the first one.
    steady = [r for r in records if r["R"] == batch and r["T"] == batch]
    n = len(steady)

    def per_step(key: str) -> float:
        return 1e6 * sum(r[key] for r in steady) / max(n, 1)

    row = {"steps": n, "sched_us": per_step("schedule_s"), "launch_us": per_step("launch_s"),
           "collect_us": per_step("collect_s"), "wait_us": per_step("wait_s"), "cpu_us": per_step("cpu_s"),
           "gc_us": per_step("gc_s")}
    row["total_us"] = row["sched_us"] + row["launch_us"] + row["collect_us"]
    row["us_per_req"] = row["total_us"] / batch
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batch", type=int, nargs="+", default=[256, 64], help="requests per run (all decode together)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (stories260K's context is 512)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--speculative-config", default=None, help="speculative_config as JSON (vLLM's dict)")
    p.add_argument("--compare-spec", action="store_true",
                   help="with --speculative-config: each batch with speculation off and on, repeats alternating")
    p.add_argument("--profile", action="store_true", help="cProfile the last repeat of each batch; print the top")
    p.add_argument("--top", type=int, default=30, help="functions listed by --profile")
    ns = p.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from hayabusa import LLM

    torch.set_num_threads(1)
    cols = ("steps", "sched_us", "launch_us", "collect_us", "total_us", "cpu_us", "gc_us", "us_per_req")
    spec = json.loads(ns.speculative_config) if ns.speculative_config else None
    if ns.compare_spec and spec is None:
        p.error("--compare-spec needs --speculative-config")
    settings = [("off", None), ("spec", spec)] if ns.compare_spec else [("spec" if spec else "off", spec)]
    for batch in ns.batch:
        llms = {}
        for label, sc in settings:
            llm = LLM(ns.model, skip_tokenizer_init=True, device="cpu", max_num_seqs=batch,
                      max_model_len=ns.prompt_len + ns.max_tokens + 8, async_scheduling=ns.async_scheduling,
                      enable_prefix_caching=ns.prefix_caching, speculative_config=sc)
            fake_forward(llm.llm_engine.runner, batch)
            run_once(llm, ns, batch, seed=1000, profile=None)        # warm-up
            llms[label] = llm
        print(f"\nbatch {batch}: {batch} requests x {ns.prompt_len} prompt tokens -> {ns.max_tokens} tokens, "
              f"greedy, async scheduling {'on' if ns.async_scheduling else 'off'}, forward faked "
              f"(host µs per steady decode step); speculative_config {spec}")
        print(f"{'':>5} " + " ".join(f"{c:>11}" for c in cols))
        rows: dict[str, list[dict]] = {label: [] for label in llms}
        profs = {}
        for r in range(ns.repeats):
            for label, llm in llms.items():
                prof = cProfile.Profile() if ns.profile and r == ns.repeats - 1 else None
                rows[label].append(run_once(llm, ns, batch, seed=r, profile=prof))
                profs[label] = prof
                print(f"{label:>5} " + " ".join(f"{rows[label][-1][c]:>11.1f}" for c in cols), flush=True)
        med = {label: {c: statistics.median(x[c] for x in rs) for c in cols} for label, rs in rows.items()}
        for label, m in med.items():
            print(f"{label:>5} " + " ".join(f"{m[c]:>11.1f}" for c in cols), " (median)")
        if len(med) == 2:
            print(f"spec / off, median per step: total_us {med['spec']['total_us'] / med['off']['total_us']:.3f}x, "
                  f"cpu_us {med['spec']['cpu_us'] / med['off']['cpu_us']:.3f}x, "
                  f"launch_us {med['spec']['launch_us'] / med['off']['launch_us']:.3f}x")
        for label, prof in profs.items():
            if prof is None:
                continue
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(ns.top)
            print(f"\ncProfile ({label}) of the last repeat (whole generate(), all steps), top {ns.top} by own time:")
            print(s.getvalue())

if __name__ == "__main__":
    main()
