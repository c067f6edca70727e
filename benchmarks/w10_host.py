"""W10's host time with the KV cache's CPU tier on vs off, the forward faked (issue #20).

    python benchmarks/w10_host.py                                   # a tiny random Llama, built in a temp dir
    python benchmarks/w10_host.py --model DIR --swap-space 0.5      # a `hayabusa bench --make-model` checkpoint
    python benchmarks/w10_host.py --scale 0.25 --json w10_host.json

W10's requests (``hayabusa.bench.workloads.w10``: 8 prompts of 1,024 shared + 128 own token ids, rounds of 16
per prompt, the 8 cycled 4 times, 64 output tokens, greedy, EOS ignored) and its engine arguments
(``num_gpu_blocks_override``, prefix caching), once with ``--swap-space`` GiB of CPU tier and once with 0, on the
CPU with the forward replaced by fixed logits: what is left is the engine's host work (scheduling, block
bookkeeping, the runner's inputs, the copies between the tiers on the CPU). Per variant: wall s of the
``generate``, s inside ``KVSwapper.execute`` (the copies), steps, the tier's counters and the prefix hit rate.
On a GPU the copies run on a side stream instead: this measures the host's share only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

try:
    import hayabusa  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import torch  # noqa: E402

from hayabusa import LLM, SamplingParams  # noqa: E402
from hayabusa.bench.workloads import get_workload  # noqa: E402


def fake_forward(runner) -> None:
    """The forward becomes its input copies and a slice of fixed logits (tests/bench/test_w10.py uses it too)."""
    logits = torch.zeros(runner.max_num_reqs, runner.vocab_size)
    logits[:, runner.vocab_size // 2] = 1.0

    def run_model(inp):
        runner.copy_inputs(inp)
        return logits[:len(inp.logits_indices)]

    runner._run_model = run_model


def run_variant(model: str, swap_space: float, scale: float) -> dict:
    w = get_workload("W10", scale)
    llm = LLM(model, device="cpu", skip_tokenizer_init=True, **{**w.engine_defaults, "swap_space": swap_space})
    engine = llm.llm_engine
    runner = engine.runner
    fake_forward(runner)
    swap_s = [0.0]
    if runner.kv_swapper is not None:
        execute = runner.kv_swapper.execute

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            execute(*args, **kwargs)
            swap_s[0] += time.perf_counter() - t0

        runner.kv_swapper.execute = timed
    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in w.requests]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    kv = engine.kv_cache_manager
    rec = {"swap_space": swap_space, "wall_s": round(wall, 3), "swap_s": round(swap_s[0], 3), "steps": steps[0],
           "prefix_hit_rate": round(kv.prefix_hit_rate, 4), "requests": len(w.requests)}
    if kv.cpu is not None:
        rec.update(kv.swap_stats())
        rec["num_copies"] = runner.kv_swapper.num_copies
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: a tiny random Llama, built here)")
    p.add_argument("--swap-space", type=float, default=0.25, help="GiB of CPU tier for the 'on' run")
    p.add_argument("--scale", type=float, default=1.0, help="W10's scale (1.0: the scale of record)")
    p.add_argument("--repeats", type=int, default=1, help="runs per variant (the best wall is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", default=None, help="write the records to this file")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    model = ns.model
    if model is None:
        from hayabusa.bench.models import make_model

        model = str(Path(tempfile.mkdtemp()) / "tiny-llama")
        make_model("tiny-llama", model, device="cpu")
    recs = []
    for swap_space in (ns.swap_space, 0.0):
        runs = [run_variant(model, swap_space, ns.scale) for _ in range(ns.repeats)]
        recs.append(min(runs, key=lambda r: r["wall_s"]))
    on, off = recs
    for r in recs:
        print(json.dumps(r))
    print(f"W10 host (forward faked): tier on {on['wall_s']:.3f} s (copies {on['swap_s']:.3f} s), "
          f"off {off['wall_s']:.3f} s: on / off = {on['wall_s'] / off['wall_s']:.2f}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
