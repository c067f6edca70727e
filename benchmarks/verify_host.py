"""Host time of a speculative verify step's token choice (``worker/spec_verify.verify``), greedy path on and off
(issue #21).

    python benchmarks/verify_host.py                                   # tiny random Llama, CPU, n-gram k = 4
    python benchmarks/verify_host.py --device cuda --model DIR         # your checkpoint on the GPU (~20 s)
    python benchmarks/verify_host.py --batch 1 4 16 --k 4 --max-tokens 128

``LLM.generate`` of B copy-heavy prompts (a random 24-token phrase repeated ``--repeat`` times, so n-gram lookup
proposes) -> ``--max-tokens`` tokens, greedy, ``ignore_eos``, n-gram speculation (k = ``--k``), run twice per
setting: the greedy verify path on (``ModelRunner.greedy_verify_fast_path``, kernels/greedy_verify.py) and off
(rejection_sample). Each ``verify`` call is timed on the host with perf_counter (on CUDA that is launch time: the
call queues its ops without a sync); then one more run counts its aten ops (a TorchDispatchMode). Prints per
setting: verify calls, µs per call (median, mean), aten ops per call (max), the greedy steps taken, the whole
generate's wall ms per output token, and whether the token ids are the same on and off (they must be).
Without ``--model`` a random Llama (hidden 64, 2 layers, vocab 512, stories260K's tokenizer) is built in a temp
dir, so the host work is what is measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def prompts_for(batch: int, repeat: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts, each a random 24-token phrase (ids 3 .. min(vocab, 500)) repeated ``repeat`` times."""
    import random

    rng = random.Random(seed)
    hi = min(vocab, 500) - 1
    return [[rng.randint(3, hi) for _ in range(24)] * repeat for _ in range(batch)]


def run(llm, prompts, params, fast: bool, count_ops: bool) -> dict:
    """One generate with the greedy path on or off; the verify calls timed (and their ops counted)."""
    import torch

    import hayabusa.worker.model_runner as model_runner
    import hayabusa.worker.spec_verify as spec_verify
    from hayabusa.bench.common import AtenOpCounter

    runner = llm.llm_engine.runner
    runner.greedy_verify_fast_path = fast
    runner.num_greedy_verify_steps = 0
    times, ops = [], []
    original = spec_verify.verify

    def timed(*args, **kwargs):
        if count_ops:
            with AtenOpCounter() as mode:
                out = original(*args, **kwargs)
            ops.append(mode.n)
            return out
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out

    model_runner.verify = timed
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        model_runner.verify = original
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"ids": [o.outputs[0].token_ids for o in outs], "times": times, "ops": ops, "wall_s": wall,
            "tokens": n_tokens, "greedy_steps": runner.num_greedy_verify_steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: a tiny random Llama)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeat", type=int, default=8, help="times each prompt's phrase repeats")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="generate runs per setting (timings pooled)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ns = p.parse_args()

    import torch

    from hayabusa import LLM, SamplingParams

    torch.set_num_threads(ns.threads)
    from host_overhead import model_or_tiny

    model, tmp = model_or_tiny(ns.model)
    spec = {"method": "ngram", "num_speculative_tokens": ns.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    print(f"model {ns.model or 'tiny random llama'}  device {ns.device}  k {ns.k}  max_tokens {ns.max_tokens}")
    print(f"{'batch':>5} {'path':>8} {'calls':>6} {'us/call med':>12} {'us/call mean':>13} {'ops/call':>9} "
          f"{'greedy':>7} {'ms/token':>9}")
    for batch in ns.batch:
        llm = LLM(model, device=ns.device, max_num_seqs=batch, speculative_config=spec, seed=0)
        vocab = llm.llm_engine.runner.vocab_size
        prompts = prompts_for(batch, ns.repeat, vocab, seed=batch)
        run(llm, prompts, params, True, False)   # warm-up (CUDA: Triton compile, graphs)
        run(llm, prompts, params, False, False)
        ids = {}
        for fast in (True, False):
            recs = [run(llm, prompts, params, fast, False) for _ in range(ns.repeats)]
            ops = run(llm, prompts, params, fast, True)["ops"]
            times = [t for r in recs for t in r["times"]]
            ids[fast] = recs[0]["ids"]
            us = [t * 1e6 for t in times] or [float("nan")]
            ms_tok = statistics.median(r["wall_s"] / max(r["tokens"], 1) * 1e3 for r in recs)
            print(f"{batch:>5} {'greedy' if fast else 'general':>8} {len(times) // ns.repeats:>6} "
                  f"{statistics.median(us):>12.1f} {statistics.fmean(us):>13.1f} {max(ops, default=0):>9} "
                  f"{recs[0]['greedy_steps']:>7} {ms_tok:>9.3f}")
        same = ids[True] == ids[False]
        print(f"{batch:>5} token ids identical on/off: {same}")
        if not same:
            raise SystemExit("greedy verify path changed the output")
        del llm
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
