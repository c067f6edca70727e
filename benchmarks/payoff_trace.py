"""Every sample the measured turn-off rule of speculative decoding (``disable_by_payoff``, issue #21) takes, on W11.

    python benchmarks/payoff_trace.py --model DIR                          # W11 at max_num_seqs 16, 4, 1
    python benchmarks/payoff_trace.py --model DIR --max-num-seqs 16 --num-requests 32 --json out.json

W11's first ``--num-requests`` requests (bench/workloads.py: copy-heavy extraction, greedy, 128 tokens, EOS
ignored) through ``LLM.generate`` with n-gram speculation (k = 4, lookup 2..4) and the rule on, once per
max_num_seqs; then the same requests with speculation off, timed, for the rates the rule should have compared.
Each sample ``PayoffRule.record`` received is kept: running requests, bucket, mode (spec / plain), tokens per
request and seconds. Printed per setting: the
rule's final per-bucket snapshot, per bucket and mode the samples' count, their mean and median ms and tokens per
request, and the end-to-end output tok/s with the rule and with speculation off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))                  # PYTHONPATH first: another checkout of hayabusa can be measured


def _prompts(tokenizer, reqs) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": r.text}], tokenize=False,
                                          add_generation_prompt=True) + r.answer_prefix for r in reqs]


def run(model: str, max_num_seqs: int, num_requests: int, spec: dict | None, dtype: str = "auto",
        cprofile: bool = False) -> dict:
    from hayabusa import LLM, SamplingParams
    from hayabusa.bench.workloads import get_workload
    from hayabusa.core.scheduler import Scheduler
    from hayabusa.spec_decode import payoff

    samples: list[dict] = []
    steps: dict[int, dict] = {}
    real_record = payoff.PayoffRule.record
    real_schedule, real_step_time = Scheduler.schedule, Scheduler.record_step_time

    def schedule(sched):
        out = real_schedule(sched)
        spec_tokens = out.scheduled_spec_decode_tokens
        steps[out.step_id] = {"tokens": out.total_num_scheduled_tokens, "reqs": len(out.num_scheduled_tokens),
                              "prompt_chunk": any(n > 1 + len(spec_tokens.get(r, ())) for r, n in
                                                  out.num_scheduled_tokens.items())}
        return out

    def record_step_time(sched, step_id, seconds):
        if step_id in steps:
            steps[step_id]["ms"] = round(seconds * 1e3, 3)
        return real_step_time(sched, step_id, seconds)

    def record(rule, num_running, speculative, tokens_per_request, seconds):
        samples.append({"n": num_running, "bucket": payoff.bucket_of(num_running), "spec": speculative,
                        "tokens": round(tokens_per_request, 3), "ms": round(seconds * 1e3, 3)})
        return real_record(rule, num_running, speculative, tokens_per_request, seconds)

    payoff.PayoffRule.record = record
    Scheduler.schedule, Scheduler.record_step_time = schedule, record_step_time
    try:
        reqs = get_workload("W11", 1.0).requests[:num_requests]
        llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=2048, speculative_config=spec, dtype=dtype)
        calls = _time_phases(llm.llm_engine)
        prompts = _prompts(llm.get_tokenizer(), reqs)
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)                 # warm-up (graphs, allocator)
        samples.clear()
        steps.clear()
        calls.clear()
        prof = None
        if cprofile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        if prof is not None:
            import io
            import pstats
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            print(f"cProfile, max_num_seqs={max_num_seqs} spec={spec is not None} (by own time):\n{text.getvalue()}")
        eng = llm.llm_engine
        rule = eng.scheduler.spec.payoff if eng.scheduler.spec is not None else None
        res = {"max_num_seqs": max_num_seqs, "speculative": spec is not None, "seconds": elapsed,
               "out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
               "num_steps": eng.stats.get("num_steps"), "overlapped_steps": eng.stats.get("num_overlapped_steps"),
               "snapshot": rule.snapshot() if rule is not None else None, "samples": samples[:],
               "steps": [v for _, v in sorted(steps.items()) if "ms" in v],
               "token_ids": [list(o.outputs[0].token_ids) for o in outs], "engine_steps": calls[:]}
        del llm, eng
        return res
    finally:
        payoff.PayoffRule.record = real_record
        Scheduler.schedule, Scheduler.record_step_time = real_schedule, real_step_time


def _time_phases(eng) -> list[dict]:
    """Per ``LLMEngine._step`` call: its wall ms and the ms it spent scheduling, launching, waiting for the device
    (``finish``), collecting outputs and in the garbage collector, with the step ids it scheduled and collected
    (instance attributes wrap the engine's own methods; nothing else changes)."""
    import gc

    calls: list[dict] = []
    cur: dict = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                cur[name] = cur.get(name, 0.0) + (time.perf_counter() - t) * 1e3
        return wrapper

    def gc_cb(phase, info):
        if phase == "start":
            cur["_gc0"] = time.perf_counter()
        elif "_gc0" in cur:
            cur["gc"] = cur.get("gc", 0.0) + (time.perf_counter() - cur.pop("_gc0")) * 1e3

    real_step, real_collect, real_schedule = eng._step, eng._collect_outputs, eng.scheduler.schedule

    def schedule():
        out = real_schedule()
        cur["scheduled"] = out.step_id
        return out

    def collect(sched, result):
        cur["collected"] = sched.step_id
        return real_collect(sched, result)

    def step():
        cur.clear()
        t = time.perf_counter()
        try:
            return real_step()
        finally:
            rec = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in cur.items() if not k.startswith("_")}
            rec["ms"] = round((time.perf_counter() - t) * 1e3, 3)
            calls.append(rec)

    eng._step = step
    eng.scheduler.schedule = timed("schedule", schedule)
    eng.runner.launch = timed("launch", eng.runner.launch)
    eng.runner.finish = timed("finish", eng.runner.finish)
    eng._collect_outputs = timed("collect", collect)
    gc.callbacks.append(gc_cb)
    return calls


def summarize(res: dict) -> list[str]:
    lines = [f"max_num_seqs={res['max_num_seqs']} spec={res['speculative']}: {res['out_tok_s']:.1f} out tok/s, "
             f"{res['num_steps']} steps ({res['overlapped_steps']} overlapped)"]
    for b, st in (res["snapshot"] or {}).items():
        lines.append(f"  bucket {b}: {st}")
    timed = res["steps"]
    if timed:
        chunk = sum(s["ms"] for s in timed if s["prompt_chunk"]) / 1e3
        decode = [s["ms"] for s in timed if not s["prompt_chunk"]]
        lines.append(f"  steps timed: {len(timed)}; with prompt chunks {chunk:.3f} s; decode-only {sum(decode) / 1e3:.3f} s"
                     f" ({sum(m for m in decode if m > 10) / 1e3:.3f} s in {sum(m > 10 for m in decode)} steps over 10 ms)")
    calls = res.get("engine_steps") or []
    if calls:
        tot = {k: sum(c.get(k, 0.0) for c in calls) for k in ("ms", "schedule", "launch", "finish", "collect", "gc")}
        lines.append(f"  engine steps: {len(calls)}; ms in total " + ", ".join(f"{k} {v:.1f}" for k, v in tot.items()))
        slow = [c for c in calls if c["ms"] > 5]
        lines.append(f"  engine steps over 5 ms: {len(slow)} ({sum(c['ms'] for c in slow):.1f} ms); the first 12: "
                     f"{slow[:12]}")
    groups: dict[tuple, list] = {}
    for s in res["samples"]:
        groups.setdefault((s["bucket"], s["spec"]), []).append(s)
    for (b, sp), ss in sorted(groups.items()):
        ms = [s["ms"] for s in ss]
        tok = [s["tokens"] for s in ss]
        lines.append(f"  bucket {b:>3} {'spec ' if sp else 'plain'}: {len(ss):4d} samples, ms mean {statistics.mean(ms):8.3f}"
                     f" median {statistics.median(ms):8.3f} max {max(ms):8.3f}; tokens/request mean "
                     f"{statistics.mean(tok):.2f}; rate {sum(tok) / (sum(ms) / 1e3):9.1f} tok/req/s")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a trained chat model's folder (SmolLM2-135M-Instruct)")
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[16, 4, 1])
    ap.add_argument("--num-requests", type=int, default=32, help="W11's first N requests (of 64)")
    ap.add_argument("--payoff-window", type=int, default=None, help="speculative_config payoff_window")
    ap.add_argument("--dtype", default="auto", help="the engines' dtype (float32: is a greedy difference rounding?)")
    ap.add_argument("--cprofile", action="store_true", help="print cProfile's top functions of each timed run")
    ap.add_argument("--json", help="write every sample and summary here")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
            "disable_by_payoff": True}
    if args.payoff_window is not None:
        spec["payoff_window"] = args.payoff_window
    results = []
    for m in args.max_num_seqs:
        for sp in (spec, None):
            res = run(args.model, m, args.num_requests, sp, args.dtype, args.cprofile)
            print("\n".join(summarize(res)), flush=True)
            results.append(res)
        on, off = results[-2], results[-1]
        differ = [i for i, (a, b) in enumerate(zip(on["token_ids"], off["token_ids"])) if a != b]
        first = [next(j for j, (x, y) in enumerate(zip(on["token_ids"][i], off["token_ids"][i])) if x != y)
                 for i in differ]
        on["greedy_differs"], on["first_difference"] = differ, first
        print(f"max_num_seqs={m}: rule {on['out_tok_s']:.1f} vs off {off['out_tok_s']:.1f} tok/s "
              f"({on['out_tok_s'] / off['out_tok_s']:.2f}x); greedy ids differ from off in {len(differ)} of "
              f"{len(on['token_ids'])} requests (first differing position: {first})", flush=True)
    if args.json:
        for r in results:
            r.pop("token_ids")
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
