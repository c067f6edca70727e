"""Host time of one engine step, phase by phase, for a decoder-only model and T5 (issues #17 / #25).

    python benchmarks/host_overhead.py                                 # tiny Llama and tiny T5, batch 256, CPU
    python benchmarks/host_overhead.py --arch llama --batch 256 64 --repeats 3
    python benchmarks/host_overhead.py --device cuda --model /tmp/q05 --skip-tokenizer-init   # your checkpoint
    python benchmarks/host_overhead.py --json host.json                # the records as JSON too
    python benchmarks/host_overhead.py --profile                       # cProfile of the last repeat: the top
    python benchmarks/host_overhead.py --fake-forward                  # CPU: fixed logits instead of the model
    python benchmarks/host_overhead.py --w9 --arch t5 --fake-forward   # W9's requests, host time per step kind
    python benchmarks/host_overhead.py --w9 --arch t5 --fake-forward --padded-encoder on   # T5's padded encoders
    python benchmarks/host_overhead.py --w9 --device cuda --model DIR --skip-tokenizer-init   # W9 on the GPU
    python benchmarks/host_overhead.py --arch llama --batch 64 256 --compare-spec \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

``LLM.generate`` (the offline path, tokenizer on, outputs detokenized as LLM.generate does) of B prompts of
``--prompt-len`` random token ids -> ``--max-tokens`` tokens, greedy, ``ignore_eos``, max_num_seqs = B. Without
``--model`` the models are built in a temp dir: a random Llama (hidden 64, 2 layers) and a random T5 (d_model 64,
2 + 2 layers), both on stories260K's SentencePiece tokenizer (vocab 512), so the forward and the argmax are
small and the step is the engine's host work. Every phase is timed around the real methods (nothing is faked):

    schedule      Scheduler.schedule() less its SchedulerOutput building
    sched_out     Scheduler._make_output(): the SchedulerOutput (plain data) and the tokens counted as computed
    inputs        ModelRunner.update_states + prepare_inputs + copy_inputs (host arrays, copies to the buffers;
                  T5: the cross-attention metadata, EncoderDecoderRunner.prepare)
    encoders      T5: EncoderDecoderRunner.run_encoders less the model's encode / store_cross_kv (the encoder
                  inputs' ids and cross-KV slots built on the host, copied to the device)
    forward       ModelRunner._run_model less copy_inputs (on CUDA: queueing the kernels / graph replay;
                  on CPU: the model's compute, left out of host_us), plus T5's encoder runs (encode and
                  store_cross_kv, or a padded bucket's run: its CUDA graph's replay)
    swap          KVSwapper.execute: KV blocks copied between the GPU and its CPU tier (swap_space: prefix-cache
                  blocks evicted from the GPU when decoding takes new blocks)
    sample        ModelRunner._sample: argmax (or the Sampler) and queueing the device -> host copy
    wait          waiting for the step's device work (the event; 0 on CPU)
    finish        ModelRunner.finish less the wait: tokens into the rows, the per-request result dict
    update        Scheduler.update_from_output: tokens appended, stop checks, blocks freed
    output        OutputProcessor.process: detokenization / stop strings / RequestOutputs
    engine        the rest of LLMEngine.step (the loop's own code)
    llm           the rest of LLM.generate's step loop (finished outputs collected), per step
    total         wall per step; host_us = total - wait (- forward on CPU)
    gc            of all that, the time in Python's cyclic garbage collector

Numbers are µs per steady decode step (every one of the B requests decodes one token and none finishes; prefill
steps and the last step are left out) and, in the per_req row, µs per request per step. The last step (where
every request finishes, with ``ignore_eos``) is reported apart, per request: ``end_step`` (its host time) and
``end_output`` (its OutputProcessor time: the whole text detokenized at once, as LLM.generate asks for the final
output only). Median over ``--repeats``.

``--speculative-config JSON`` (issue #21): the engine's speculative_config; ``--compare-spec`` measures each batch
without it and then with it (an engine each, one after the other) and prints host µs per step side by side: with
the n-gram method and a batch above ``disable_by_batch_size`` (default 32) no step may propose, so both should
cost the same.

``--w9`` (T5, issue #17): W9's requests instead (``--w9-requests``, default 2,000, of 256 random encoder ids ->
64 tokens, greedy, ``ignore_eos``, max_num_seqs 256 and the engine's default max_num_batched_tokens, as ``hayabusa
bench --workload W9`` runs them). Every step of one ``generate`` is timed and put in one kind: ``admit`` (encoders
of newly admitted requests ran in it), ``finish`` (requests finished in it, none admitted), ``decode`` (the rest);
the table gives per kind the steps, µs per step by phase, and host µs per step; then host ms in all and host µs
per request (the whole run's host time over its requests).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))   # PYTHONPATH first: another checkout of hayabusa can be measured

clock = time.perf_counter   # --clock cpu: time.thread_time (steadier on a shared machine; the wait is then ~0)

PHASES = ("schedule", "sched_out", "inputs", "encoders", "swap", "forward", "sample", "wait", "finish", "update",
          "output", "engine", "llm", "total")
EXTRA = ("host", "gc")   # host: see the docstring; gc: wall in Python's cyclic garbage collector (inside the phases)


def model_or_tiny(model: str | None, arch: str = "llama") -> tuple[str, "tempfile.TemporaryDirectory | None"]:
    """``(model, None)`` when a model folder is given; otherwise ``build_tiny(arch)`` in a new temporary folder and
    that folder (the caller's to ``cleanup()``)."""
    if model is not None:
        return model, None
    import tempfile

    tmp = tempfile.TemporaryDirectory()
    return build_tiny(arch, Path(tmp.name)), tmp


def build_tiny(arch: str, out: Path) -> str:
    """A random tiny checkpoint of ``arch`` ("llama" or "t5") on stories260K's tokenizer (vocab 512) in ``out``."""
    import os

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

    assets = Path(os.environ.get("HAYABUSA_ASSETS", REPO.parent / "shared" / "assets"))
    tok = AutoTokenizer.from_pretrained(str(assets / "models" / "stories260K"))
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                       num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                       eos_token_id=2, pad_token_id=0, decoder_start_token_id=0, initializer_factor=4.0)
        model = T5ForConditionalGeneration(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


class PhaseTimer:
    """Wraps the engine's methods to add each call's wall time to the current step's record."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.records: list[dict] = []
        self._patched: list[tuple[object, str]] = []

    def add(self, key: str, dt: float) -> None:
        self.cur[key] = self.cur.get(key, 0.0) + dt

    def wrap(self, obj: object, name: str, key: str, sub: tuple[str, ...] = ()) -> None:
        """Time ``obj.name`` into ``key``; the time of the phases in ``sub`` (timed inside it) is taken out."""
        fn = getattr(obj, name)
        timer = self

        @functools.wraps(fn)
        def timed(*a, **kw):
            before = sum(timer.cur.get(s, 0.0) for s in sub)
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                inner = sum(timer.cur.get(s, 0.0) for s in sub) - before
                timer.add(key, clock() - t0 - inner)

        self.patch(obj, name, timed)

    def unwrap(self) -> None:
        for obj, name, old in reversed(self._patched):
            if old is None:
                delattr(obj, name)      # back to the class's method
            else:
                setattr(obj, name, old)  # back to what the instance had (a fake forward)
        self._patched.clear()

    def patch(self, obj: object, name: str, new) -> None:
        self._patched.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, new)


def instrument(llm, timer: PhaseTimer) -> None:
    engine = llm.llm_engine
    runner = engine.runner
    sched = engine.scheduler
    timer.wrap(sched, "_make_output", "sched_out")
    timer.wrap(sched, "schedule", "schedule", sub=("sched_out",))
    timer.wrap(runner, "copy_inputs", "inputs")
    timer.wrap(runner, "update_states", "inputs")
    timer.wrap(runner, "prepare_inputs", "inputs")
    timer.wrap(runner, "_run_model", "forward", sub=("inputs",))
    if runner.encdec is not None:
        timer.wrap(runner.encdec, "prepare", "inputs")
        timer.wrap(runner.model, "encode", "forward")
        timer.wrap(runner.model, "store_cross_kv", "forward")
        timer.wrap(runner.encdec, "run_padded_forward", "forward", sub=("forward",))   # a bucket's replay
        timer.wrap(runner.encdec, "run_encoders", "encoders", sub=("forward",))
    timer.wrap(runner, "_sample", "sample")
    if getattr(runner, "kv_swapper", None) is not None:
        timer.wrap(runner.kv_swapper, "execute", "swap")
    finish = runner.finish

    def finish_with_wait(handle):
        t0 = clock()
        if getattr(handle, "event", None) is not None:
            handle.event.synchronize()
        timer.add("wait", clock() - t0)
        return finish(handle)

    timer.patch(runner, "finish", finish_with_wait)
    timer.wrap(runner, "finish", "finish", sub=("wait",))
    timer.wrap(sched, "update_from_output", "update")
    timer.wrap(engine.output_processor, "process", "output")
    step = engine.step
    inner = tuple(p for p in PHASES if p not in ("engine", "llm", "total"))

    def timed_step():
        nonlocal runs_before
        swapper = getattr(runner, "kv_swapper", None)
        runs_before = swapper.num_runs if swapper is not None else 0
        timer.cur = {}
        t0 = clock()
        outs = step()
        total = clock() - t0
        rec = dict(timer.cur)
        rec["engine"] = total - sum(rec.get(p, 0.0) for p in inner)   # (gc is inside the phases)
        rec["step_wall"] = total
        rec["t_end"] = clock()
        rec["R"], rec["T"] = last_sched.get("R", 0), last_sched.get("T", 0)
        rec["F"] = sum(1 for o in outs if o.finished)
        rec["E"] = last_sched.get("E", 0)
        swapper = getattr(runner, "kv_swapper", None)
        rec["swap_runs"] = swapper.num_runs - runs_before if swapper is not None else 0
        timer.records.append(rec)
        return outs

    last_sched: dict = {}
    runs_before = 0
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        last_sched["R"], last_sched["T"] = out.num_reqs, out.total_num_scheduled_tokens
        last_sched["E"] = len(out.scheduled_encoder_prompt_req_ids)
        return out

    timer.patch(sched, "schedule", recording_schedule)
    timer.patch(engine, "step", timed_step)


def fake_forward(runner, max_rows: int) -> None:
    """``--fake-forward``: the runner's forward becomes its input copies (``copy_inputs``, as the real one does
    first) and a slice of a preallocated logits tensor [B, V] fp32 whose row i peaks at token V // 2 + 13 + i % 13
    (plain pieces of stories260K's vocabulary, not its byte tokens 3..258); the encoders of T5 still run (they
    are part of admission, not of the decode steps measured)."""
    import torch

    V = runner.vocab_size
    logits = torch.zeros(max_rows, V, device=runner.device)
    logits[torch.arange(max_rows), V // 2 + 13 + torch.arange(max_rows) % 13] = 1.0

    def run_model(inp):
        runner.copy_inputs(inp)
        return logits[:len(inp.logits_indices)]

    runner._run_model = run_model


def timed_generate(llm, timer: PhaseTimer, prompts, params, profile: cProfile.Profile | None):
    """``llm.generate`` under the instrumented ``timer`` (unwrapped after), the cyclic GC's pauses recorded as
    the phase "gc", each step's "llm" phase set (the LLM's own loop: the gap between one step's end and the next
    step's start). Returns (outputs, wall seconds, GC seconds)."""
    from hayabusa.bench.common import GCTimer

    gc_timer = GCTimer(clock, on_pause=lambda dt: timer.add("gc", dt)).install()
    try:
        t0 = clock()
        if profile is not None:
            outs = profile.runcall(llm.generate, prompts, params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        wall = clock() - t0
    finally:
        timer.unwrap()
        gc_timer.remove()
    recs = timer.records
    for prev, rec in zip(recs, recs[1:]):
        rec["llm"] = max(rec["t_end"] - rec["step_wall"] - prev["t_end"], 0.0)
    if recs:
        recs[0]["llm"] = 0.0
    return outs, wall, gc_timer.seconds


def run_once(llm, ns, batch: int, seed: int, device_is_cpu: bool, profile: cProfile.Profile | None) -> dict:
    from hayabusa import SamplingParams

    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(ns.prompt_len)]} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    timer = PhaseTimer()
    instrument(llm, timer)
    outs, wall, _ = timed_generate(llm, timer, prompts, params, profile)
    assert all(len(o.outputs[0].token_ids) == ns.max_tokens for o in outs)
    recs = timer.records
    steady = [r for r in recs[1:] if r["R"] == batch and r["T"] == batch and not r["F"]]
    n = max(len(steady), 1)
    # the steps that finish requests (all of them at once with ignore_eos): their text is detokenized there
    ends = [r for r in recs if r["F"]]
    row = {p: 1e6 * sum(r.get(p, 0.0) for r in steady) / n for p in PHASES if p != "total"}
    row["total"] = sum(row.values())
    row["gc"] = 1e6 * sum(r.get("gc", 0.0) for r in steady) / n
    row["host"] = row["total"] - row["wait"] - (row["forward"] if device_is_cpu else 0.0)
    row["steps"] = len(steady)
    # block runs copied between the KV tiers per step (each is one copy per layer, K and V, on the device)
    row["swap_runs"] = sum(r["swap_runs"] for r in steady) / n
    row["end_output_us_per_req"] = 1e6 * sum(r.get("output", 0.0) for r in ends) / batch
    row["end_step_us_per_req"] = 1e6 * sum(r["step_wall"] - r.get("wait", 0.0) for r in ends) / batch
    row["generate_s"] = wall
    return row


W9_KINDS = ("admit", "finish", "decode")


def w9_step_kind(rec: dict) -> str:
    """admit: encoders ran in the step; finish: requests finished in it (none admitted); decode: the rest."""
    return "admit" if rec["E"] else "finish" if rec["F"] else "decode"


def run_w9(llm, ns, device_is_cpu: bool, profile: cProfile.Profile | None) -> dict:
    """One ``generate`` of W9's requests; host µs per step by kind and phase (see the module docstring)."""
    from hayabusa import SamplingParams

    rng = random.Random(0)
    hi = min(llm.llm_engine.runner.vocab_size, 32000)
    prompts = [{"prompt_token_ids": [rng.randrange(3, hi) for _ in range(ns.prompt_len)]}
               for _ in range(ns.w9_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    timer = PhaseTimer()
    instrument(llm, timer)
    engine = llm.llm_engine
    add = engine.add_request
    added = [0.0]

    def timed_add(*a, **kw):     # LLM.generate queues every request before its first step: W9's wall has it
        t0 = clock()
        try:
            return add(*a, **kw)
        finally:
            added[0] += clock() - t0

    timer.patch(engine, "add_request", timed_add)
    outs, wall, gc_s = timed_generate(llm, timer, prompts, params, profile)
    assert all(len(o.outputs[0].token_ids) == ns.max_tokens for o in outs)
    recs = timer.records
    for rec in recs:
        rec["total"] = sum(rec.get(p, 0.0) for p in PHASES if p != "total")
        rec["host"] = rec["total"] - rec.get("wait", 0.0) - (rec.get("forward", 0.0) if device_is_cpu else 0.0)
    kinds = {}
    for kind in W9_KINDS:
        sel = [r for r in recs if w9_step_kind(r) == kind]
        n = max(len(sel), 1)
        row = {p: 1e6 * sum(r.get(p, 0.0) for r in sel) / n for p in PHASES + EXTRA}
        row["steps"] = len(sel)
        row["reqs"] = sum(r["R"] for r in sel) / n
        row["admitted"] = sum(r["E"] for r in sel) / n
        row["host_ms_all"] = 1e3 * sum(r["host"] for r in sel)
        kinds[kind] = row
    host_s = sum(r["host"] for r in recs) + added[0]
    return {"kinds": kinds, "steps": len(recs), "generate_s": wall, "host_ms": 1e3 * host_s,
            "host_us_per_req": 1e6 * host_s / len(outs), "requests": len(outs),
            "add_request_us_per_req": 1e6 * added[0] / len(outs), "gc_ms": 1e3 * gc_s}


def bench_w9(model: str, label: str, ns) -> list[dict]:
    from hayabusa import LLM

    llm = LLM(model, device=ns.device, max_num_seqs=256, max_model_len=ns.prompt_len + ns.max_tokens + 16,
              enforce_eager=ns.enforce_eager, gpu_memory_utilization=ns.gpu_memory_utilization,
              skip_tokenizer_init=ns.skip_tokenizer_init)
    runner = llm.llm_engine.runner
    dev_cpu = runner.device.type == "cpu"
    if ns.padded_encoder is not None:   # T5's encoder path (worker/encoder_decoder.py; default: padded on CUDA)
        runner.encdec.padded_encoder = ns.padded_encoder == "on"
    if ns.fake_forward:
        fake_forward(runner, 256)
    warm = ns.w9_requests
    ns.w9_requests = min(warm, 64)
    run_w9(llm, ns, dev_cpu, None)     # warm-up (compiles, first allocations)
    ns.w9_requests = warm
    rows = []
    prof = None
    for r in range(ns.repeats):
        prof = cProfile.Profile() if ns.profile and r == ns.repeats - 1 else None
        rows.append(run_w9(llm, ns, dev_cpu, prof))
    best = sorted(rows, key=lambda x: x["host_ms"])[len(rows) // 2]     # the median run by host time
    rec = {"model": label, "device": str(runner.device), "fake_forward": ns.fake_forward, "w9": True,
           "requests": ns.w9_requests, "prompt_len": ns.prompt_len, "max_tokens": ns.max_tokens,
           "repeats": ns.repeats, "hayabusa": str(Path(sys.modules["hayabusa"].__file__).parent), **best,
           "host_ms_repeats": [x["host_ms"] for x in rows]}
    print_w9_table(rec)
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(ns.top)
        print(f"cProfile of the last repeat (whole generate()), top {ns.top} by own time:")
        print(s.getvalue())
    return [rec]


def print_w9_table(rec: dict) -> None:
    fake = " (forward faked)" if rec["fake_forward"] else ""
    print(f"\nW9 on {rec['model']}, {rec['device']}{fake}: {rec['requests']} x {rec['prompt_len']} encoder tokens -> "
          f"{rec['max_tokens']} tokens, max_num_seqs 256; {rec['steps']} steps, generate {rec['generate_s']:.2f} s; "
          f"median of {rec['repeats']} by host time (host ms per repeat: "
          f"{', '.join(f'{h:.0f}' for h in rec['host_ms_repeats'])})")
    cols = PHASES + EXTRA
    print(f"{'us/step':>8} {'steps':>6} {'reqs':>6} {'admit':>6} " + " ".join(f"{c:>9}" for c in cols)
          + f" {'host_ms':>9}")
    for kind, row in rec["kinds"].items():
        print(f"{kind:>8} {row['steps']:>6} {row['reqs']:>6.0f} {row['admitted']:>6.1f} "
              + " ".join(f"{row[c]:>9.1f}" for c in cols) + f" {row['host_ms_all']:>9.1f}")
    print(f"add_request (before the first step): {rec['add_request_us_per_req']:.1f} us per request; host in all "
          f"(steps + add_request): {rec['host_ms']:.1f} ms, {rec['host_us_per_req']:.1f} us per request; of the "
          f"whole generate, {rec['gc_ms']:.1f} ms in the garbage collector")


def bench_model(model: str, label: str, ns) -> list[dict]:
    import torch

    from hayabusa import LLM

    results = []
    for batch in ns.batch:
        llm = LLM(model, device=ns.device, max_num_seqs=batch, max_model_len=ns.prompt_len + ns.max_tokens + 16,
                  max_num_batched_tokens=max(batch * ns.prompt_len, 2048), enforce_eager=ns.enforce_eager,
                  gpu_memory_utilization=ns.gpu_memory_utilization,
                  skip_tokenizer_init=ns.skip_tokenizer_init, speculative_config=ns.spec,
                  **({} if ns.swap_space is None else {"swap_space": ns.swap_space}))
        dev_cpu = llm.llm_engine.runner.device.type == "cpu"
        if ns.fake_forward:
            fake_forward(llm.llm_engine.runner, batch)
        run_once(llm, ns, batch, seed=1000, device_is_cpu=dev_cpu, profile=None)        # warm-up
        rows = []
        prof = None
        for r in range(ns.repeats):
            prof = cProfile.Profile() if ns.profile and r == ns.repeats - 1 else None
            rows.append(run_once(llm, ns, batch, seed=r, device_is_cpu=dev_cpu, profile=prof))
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        rec = {"model": label, "batch": batch, "device": str(llm.llm_engine.runner.device), "speculative_config": ns.spec,
               "fake_forward": ns.fake_forward, "clock": ns.clock, "swap_space": ns.swap_space,
               "hayabusa": str(Path(sys.modules["hayabusa"].__file__).parent),
               "prompt_len": ns.prompt_len, "max_tokens": ns.max_tokens, "repeats": ns.repeats,
               "us_per_step": med, "us_per_req_per_step": {k: v / batch for k, v in med.items()
                                                           if k not in ("steps", "generate_s", "swap_runs") and not k.startswith("end_")},
               "host_us_per_step_repeats": [x["host"] for x in rows]}
        results.append(rec)
        print_table(rec)
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(ns.top)
            print(f"cProfile of the last repeat (whole generate(), all steps), top {ns.top} by own time:")
            print(s.getvalue())
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def compare_spec(model: str, label: str, ns) -> list[dict]:
    """--compare-spec: bench_model without speculation, then with ns.spec; host µs per steady step of both."""
    spec, results = ns.spec, []
    for setting in (None, spec):
        ns.spec = setting
        results += bench_model(model, label, ns)
    ns.spec = spec
    print(f"\n{label}: host µs per steady decode step, speculation off vs {spec}")
    for off in (r for r in results if r["speculative_config"] is None):
        on = next(r for r in results if r["speculative_config"] is not None and r["batch"] == off["batch"])
        h_off, h_on = off["us_per_step"]["host"], on["us_per_step"]["host"]
        print(f"  batch {off['batch']:>4}: off {h_off:8.1f}  spec {h_on:8.1f}  ratio {h_on / h_off:.3f}  (repeats off "
              f"{', '.join(f'{h:.0f}' for h in off['host_us_per_step_repeats'])}; spec "
              f"{', '.join(f'{h:.0f}' for h in on['host_us_per_step_repeats'])})")
    return results


def print_table(rec: dict) -> None:
    med, per = rec["us_per_step"], rec["us_per_req_per_step"]
    fake = " (forward faked)" if rec["fake_forward"] else ""
    spec = f", speculative_config {rec['speculative_config']}" if rec.get("speculative_config") else ""
    print(f"\n{rec['model']} on {rec['device']}{fake}{spec}, batch {rec['batch']}: {rec['batch']} x {rec['prompt_len']} prompt "
          f"tokens -> {rec['max_tokens']} tokens, greedy; {int(med['steps'])} steady decode steps, median of "
          f"{rec['repeats']} (host_us per repeat: {', '.join(f'{h:.0f}' for h in rec['host_us_per_step_repeats'])})")
    cols = PHASES + EXTRA
    print(f"{'':>8} " + " ".join(f"{c:>9}" for c in cols))
    print(f"{'us/step':>8} " + " ".join(f"{med[c]:>9.1f}" for c in cols))
    print(f"{'per_req':>8} " + " ".join(f"{per[c]:>9.3f}" for c in cols))
    print(f"last step, per request: host {med['end_step_us_per_req']:.1f} us, of which output "
          f"{med['end_output_us_per_req']:.1f} us; KV block runs swapped per steady step: {med['swap_runs']:.1f} "
          "(each one copy per layer for K and for V)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: build the tiny ones of --arch)")
    p.add_argument("--arch", nargs="+", default=["llama", "t5"], choices=["llama", "t5"],
                   help="tiny models to build when --model is not given")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--prompt-len", type=int, default=None, help="default 16 (--w9: 256)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer (a `hayabusa bench --make-model` checkpoint has none): no detokenization")
    p.add_argument("--swap-space", type=float, default=None,
                   help="GiB of the KV cache's CPU tier (default: the engine's); 0 turns it off, and with it the "
                        "copies of evicted prefix-cache blocks (the swap phase)")
    p.add_argument("--padded-encoder", choices=["on", "off"], default=None,
                   help="--w9: T5's padded (CUDA-graph) encoder path on or off (default: the engine's, on on CUDA)")
    p.add_argument("--fake-forward", action="store_true",
                   help="replace the forward by a slice of fixed logits (greedy output then follows them; on CPU the "
                        "reference attention's ~70 ms per step otherwise sits between the host phases)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: time.perf_counter; cpu: the engine thread's CPU time (time.thread_time), steadier "
                        "when other processes share the CPU (not for CUDA: waiting for the device costs no CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--profile", action="store_true", help="cProfile the last repeat; print the top functions")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", default=None, help="write the records to this file")
    p.add_argument("--speculative-config", default=None, help="speculative_config as JSON (vLLM's dict)")
    p.add_argument("--compare-spec", action="store_true",
                   help="with --speculative-config: each batch without it, then with it; host µs side by side")
    p.add_argument("--w9", action="store_true",
                   help="W9's requests (T5): host time per step kind (admit / finish / decode) over a whole run; "
                        "--prompt-len defaults to 256 then")
    p.add_argument("--w9-requests", type=int, default=2000, help="--w9: the number of requests")
    ns = p.parse_args()
    global clock
    clock = time.thread_time if ns.clock == "cpu" else time.perf_counter
    if ns.prompt_len is None:
        ns.prompt_len = 256 if ns.w9 else 16
    ns.spec = json.loads(ns.speculative_config) if ns.speculative_config else None
    if ns.compare_spec and (ns.spec is None or ns.w9):
        p.error("--compare-spec needs --speculative-config (and not --w9)")
    bench = bench_w9 if ns.w9 else compare_spec if ns.compare_spec else bench_model
    import torch

    torch.set_num_threads(ns.threads)
    results = []
    if ns.model is not None:
        results += bench(ns.model, Path(ns.model).name, ns)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for arch in ns.arch:
                path = build_tiny(arch, Path(tmp) / arch)
                results += bench(path, f"tiny-{arch}", ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
        print(f"\nwrote {ns.json}")


if __name__ == "__main__":
    main()
