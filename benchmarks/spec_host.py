"""Host µs of an n-gram speculative step, phase by phase, at batch 1 / 4 / 16, speculation on and off (issue #21).

    python benchmarks/spec_host.py                                      # tiny random Llama, CPU (~1 min)
    python benchmarks/spec_host.py --batch 1 4 16 --repeats 3 --profile # + cProfile top functions per setting
    python benchmarks/spec_host.py --device cuda --model DIR            # your checkpoint on the GPU (~30 s)

``LLM.generate`` of B copy-heavy prompts (W11-like: a random 24-token phrase repeated ``--repeat`` times, so the
n-gram lookup proposes) -> ``--max-tokens`` tokens, greedy, ``ignore_eos``, max_num_seqs = B, tokenizer on and
the text detokenized as LLM.generate does; once without speculation, once with n-gram (k = ``--k``, lookup
``--min-n`` .. 4). Every step is timed phase by phase around the real methods (host_overhead.py's PhaseTimer,
plus the speculative pieces):

    propose   SpecDecodeScheduling.propose (the n-gram lookups; inside Scheduler.schedule)
    schedule  Scheduler.schedule less propose and the SchedulerOutput's building (sched_out)
    inputs    ModelRunner.update_states / prepare_inputs / copy_inputs (write_drafts and plan_verify inside)
    forward   the model (on CPU its compute, left out of host)
    sample    ModelRunner._sample: argmax, or for a verify step spec_verify.verify (the greedy plan and kernel)
    finish    ModelRunner.finish less the wait: the emitted tokens to per-request lists
    update    Scheduler.update_from_output (accepting verified runs, stop checks)
    output    OutputProcessor.process (detokenization)
    engine / llm  the rest of LLMEngine.step / LLM.generate's loop

Printed per (batch, setting): steps, output tokens per step, accepted proposals per drafted step, then host µs
per step by phase (all steps of the run but the first, prefill, one) and host µs per step in all; ``us/tok`` is
host µs per output token (what a synchronous verify step adds to the device time of each token). On the GPU
``host`` excludes only the wait; on the CPU also the forward. Token ids must be identical on and off (greedy).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))                  # PYTHONPATH first: another checkout of hayabusa can be measured
sys.path.append(str(REPO / "benchmarks"))

from host_overhead import PhaseTimer, clock, instrument, model_or_tiny  # noqa: E402

PHASES = ("propose", "schedule", "sched_out", "inputs", "forward", "sample", "finish", "update", "output",
          "engine", "llm")


def prompts_for(batch: int, repeat: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts, each a random 24-token phrase (ids 3 .. min(vocab, 500) - 1) repeated ``repeat`` times."""
    import random

    rng = random.Random(seed)
    hi = min(vocab, 500) - 1
    return [[rng.randint(3, hi) for _ in range(24)] * repeat for _ in range(batch)]


def copy_forward(runner, phrase_len: int, break_every: int) -> None:
    """``--fake-forward`` (CPU): the runner's forward becomes its input copies (``copy_inputs``, as the real one
    does first) and one-hot logits [R_s, V] fp32 of a model that copies: at position p of a row the next token is
    the prompt's token (p + 1) % phrase_len (the phrase repeats), except at every ``break_every``-th position,
    where it is a token that depends on p (so a proposal made by copying is rejected there, as in W11 a copy
    stops at a line's end). Deterministic in (row content, position): greedy output stays comparable."""
    import numpy as np
    import torch

    V = runner.vocab_size
    batch = runner.batch

    def run_model(inp):
        runner.copy_inputs(inp)
        tok_rows = np.repeat(inp.rows, inp.num_scheduled)[inp.logits_indices]
        nxt = inp.positions[inp.logits_indices] + 1
        ids = batch.token_ids[tok_rows, nxt % phrase_len].astype(np.int64)
        brk = nxt % break_every == 0
        ids[brk] = 3 + (nxt[brk] * 7) % (min(V, 500) - 3)
        logits = torch.zeros(len(ids), V)
        logits[torch.arange(len(ids)), torch.from_numpy(ids)] = 1.0
        return logits

    runner._run_model = run_model


def run_once(llm, prompts, params, profile: cProfile.Profile | None) -> dict:
    """One generate, instrumented; per phase host µs summed over all steps but the first."""
    engine = llm.llm_engine
    timer = PhaseTimer()
    instrument(llm, timer)
    spec = engine.scheduler.spec
    if spec is not None:
        timer.wrap(spec, "propose", "propose")
    sched = engine.scheduler
    drafts0, acc0 = sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens
    steps0 = sched.spec_num_drafts
    t0 = clock()
    try:
        if profile is not None:
            outs = profile.runcall(llm.generate, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        timer.unwrap()
    wall = clock() - t0
    recs = timer.records[1:]
    cpu = engine.runner.device.type == "cpu"
    row = {p: 1e6 * sum(r.get(p, 0.0) for r in recs) for p in PHASES}
    row["schedule"] -= row["propose"]        # propose runs inside schedule
    waits = 1e6 * sum(r.get("wait", 0.0) for r in recs)
    host = sum(row.values()) - (row["forward"] if cpu else 0.0)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    n = max(len(recs), 1)
    return {"ids": [list(o.outputs[0].token_ids) for o in outs], "steps": len(recs), "tokens": tokens,
            "per_step": {p: v / n for p, v in row.items()}, "host_per_step": host / n, "wait_per_step": waits / n,
            "host_per_token": host / max(tokens, 1), "wall_s": wall,
            "drafted_steps": sched.spec_num_drafts - steps0, "draft_tokens": sched.spec_num_draft_tokens - drafts0,
            "accepted": sched.spec_num_accepted_tokens - acc0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: a tiny random Llama)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min (max is 4)")
    p.add_argument("--repeat", type=int, default=8, help="times each prompt's phrase repeats")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="generate runs per setting (median by host us/step)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--fake-forward", default="auto", choices=("auto", "on", "off"),
                   help="a copying fake model instead of the forward (auto: on the CPU without --model), so the "
                        "proposals are accepted as in W11 and the step is host work only")
    p.add_argument("--break-every", type=int, default=7,
                   help="--fake-forward: the copy breaks at every this many positions (acceptance)")
    p.add_argument("--profile", action="store_true", help="cProfile of one more run per setting: top functions")
    p.add_argument("--top", type=int, default=25)
    ns = p.parse_args()
    ns.fake_forward = ns.fake_forward == "on" or (ns.fake_forward == "auto" and ns.device == "cpu"
                                                  and ns.model is None)

    import torch

    from hayabusa import LLM, SamplingParams

    torch.set_num_threads(ns.threads)
    model, tmp = model_or_tiny(ns.model)
    # (the measured turn-off rule off: this measures speculative steps, which it would turn off where they lose)
    spec = {"method": "ngram", "num_speculative_tokens": ns.k, "prompt_lookup_max": 4, "prompt_lookup_min": ns.min_n,
            "disable_by_payoff": False}
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    print(f"model {ns.model or 'tiny random llama'}{' (copying fake forward)' if ns.fake_forward else ''}  device {ns.device}  k {ns.k}  max_tokens {ns.max_tokens}  "
          f"hayabusa {Path(sys.modules['hayabusa'].__file__).parent}")
    head = " ".join(f"{c:>9}" for c in PHASES)
    print(f"{'batch':>5} {'spec':>5} {'steps':>6} {'tok/st':>6} {'acc/d':>5} {head} {'host':>9} {'us/tok':>7}")
    for batch in ns.batch:
        ids = {}
        for setting in (None, spec):
            llm = LLM(model, device=ns.device, max_num_seqs=batch, speculative_config=setting, seed=0)
            if ns.fake_forward:
                copy_forward(llm.llm_engine.runner, 24, ns.break_every)
            vocab = llm.llm_engine.runner.vocab_size
            prompts = prompts_for(batch, ns.repeat, vocab, seed=batch)
            run_once(llm, prompts, params, None)     # warm-up (CUDA: compile, graphs)
            recs = sorted((run_once(llm, prompts, params, None) for _ in range(ns.repeats)),
                          key=lambda r: r["host_per_step"])
            r = recs[len(recs) // 2]
            ids[setting is not None] = r["ids"]
            acc = r["accepted"] / r["drafted_steps"] if r["drafted_steps"] else 0.0
            print(f"{batch:>5} {'ngram' if setting else 'off':>5} {r['steps']:>6} {r['tokens'] / r['steps']:>6.2f} "
                  f"{acc:>5.2f} " + " ".join(f"{r['per_step'][c]:>9.1f}" for c in PHASES)
                  + f" {r['host_per_step']:>9.1f} {r['host_per_token']:>7.1f}", flush=True)
            if ns.profile:
                prof = cProfile.Profile()
                run_once(llm, prompts, params, prof)
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(ns.top)
                print(s.getvalue())
            del llm
        if ids[True] != ids[False]:
            raise SystemExit(f"batch {batch}: n-gram speculation changed the greedy output")
        print(f"{batch:>5} token ids identical off / ngram: True")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
