"""Where the engine's host time goes in Qwen2.5-VL steps (issue #16, W8's request shape), phase by phase.

    python benchmarks/vl_host_profile.py                           # tiny random Qwen2.5-VL (built in a temp dir), CPU
    python benchmarks/vl_host_profile.py --requests 8 --max-num-seqs 8 --max-tokens 32
    python benchmarks/vl_host_profile.py --model DIR --device cuda --requests 32 --max-num-seqs 32   # on the GPU
    python benchmarks/vl_host_profile.py --profile                 # plus cProfile's top functions of the run
    python benchmarks/vl_host_profile.py --json                    # one JSON object instead of the table
    python benchmarks/vl_host_profile.py --sync-vision             # the tower's host vs device time (syncs around it)
    python benchmarks/vl_host_profile.py --profile-vision          # torch.profiler over the tower calls
    python benchmarks/vl_host_profile.py --no-vision-varlen        # the tower's grouped SDPA path (A/B on CUDA)

The requests are W8's (``hayabusa bench --workload W8``: 2-5 random page images per request, each 512-1024 x
384-768 pixels, the chat template over them and W8's text; greedy, EOS ignored), the first ``--requests`` of
them, run through ``LLM.generate`` once after a warm-up run of two requests. Without ``--model`` a random-weight
``qwen2.5-vl-tiny`` checkpoint (hayabusa/bench/vl_models.py: the real image processor config, so the images
have W8's patch counts; a 2-block vision tower, 2 text layers) is written to a temp dir, so that the compute is
small and the host costs show.

Host time (wall, no device syncs added: on CUDA a phase that calls ``.item()`` / ``.tolist()`` / ``.cpu()`` waits
for the device inside it, which is the point) of the engine's phases, per step and per image:

    launch           ModelRunner.launch: all of the below and the rest (batch update, sampling)
      state_update   ModelRunner.update_states (new requests, mm: M-RoPE prompt positions at admission)
      input_prep     ModelRunner.prepare_inputs (per-request arrays, positions, slot mapping)
      mm_prepare     MultiModalState.prepare without the tower: per-request rope positions, image rows, copies
      vision_tower   the model's get_image_embeddings (eager; every kernel launch costs host time)
      mrope_admit    mrope_prompt_positions (part of state_update)
      copy_inputs    ModelRunner.copy_inputs (host -> device buffers)
      text_forward   the text model's forward (eager for steps with prompt chunks; a CUDA graph replay for decode)
    schedule, wait, collect: the engine's other phases (engine.stats)
    mm_preprocess    the image processor (on PreprocessStream's threads, off the engine thread: summed thread time)

``--sync-vision``: torch.cuda.synchronize() before and after every tower call, so its time splits into
``presync`` (waiting for the work queued before the call: not the tower's), ``host`` (until the call returns) and
``device tail`` (the device finishing after the call returned); a host time close to the total means the host
waited for the device inside the call (a sync, or a full launch queue). The call runs under
torch.cuda.set_sync_debug_mode("warn"): each synchronizing CUDA operation inside it is counted and named.

``--profile-vision``: torch.profiler over every tower call: per call the kernel launches (CUDA runtime launch
calls; on CPU the top-level aten ops, each of which is a launch on the GPU) and the calls that make the host wait
(cudaStreamSynchronize / cudaDeviceSynchronize / cudaMemcpy / cudaEventSynchronize / cudaFree; on CPU the aten
ops that sync on CUDA: .item() (as _local_scalar_dense), nonzero, unique, masked_select), the top kernel families
by device time, every CUDA runtime call by host time (cudaMalloc / cudaFree: the caching allocator growing or
emptying), the top host ops by self time. Printed, and in --json under ``vision_profile`` (``--sync-vision``: ``vision_sync``).

Steps are split into prefill steps (a prompt chunk in the step) and decode steps (one token per request).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PHASES = ("schedule_s", "launch_s", "wait_s", "collect_s")


class Timers:
    """Wall seconds and calls per named phase, by wrapping methods (restored by ``undo``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.syncs: dict[str, int] = defaultdict(int)    # --sync-vision: synchronizing operation -> count
        self._active: set[str] = set()     # phases being timed now: a nested call of one is not counted twice
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        timers = self

        def timed(*args, **kwargs):
            if name in timers._active:
                return fn(*args, **kwargs)
            timers._active.add(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.seconds[name] += time.perf_counter() - t0
                timers.calls[name] += 1
                timers._active.discard(name)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def undo(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()


def build_tiny(out_dir: str) -> str:
    from hayabusa.bench.vl_models import make_vl_model

    make_vl_model("qwen2.5-vl-tiny", out_dir, device="cpu")
    return out_dir


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cudaFree", "cudaFreeHost", "cuMemFree")   # (frees sync too)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch")
CPU_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::_unique",
                "aten::_unique2", "aten::unique_consecutive", "aten::masked_select", "aten::nonzero_static")


def kernel_family(name: str) -> str:
    """A CUDA kernel's name without its template arguments and parameters (``void ns::k<...>(...)`` -> ``ns::k``)."""
    name = name.removeprefix("void ")
    for stop in ("<", "("):
        name = name.split(stop, 1)[0]
    return name[:90]


class VisionProfile:
    """torch.profiler over each vision-tower call: launches, host waits, kernel families, host ops (summed)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.calls: list[dict] = []
        self.kernels: dict[str, list] = defaultdict(lambda: [0, 0.0])     # family -> [count, device us]
        self.host_ops: dict[str, list] = defaultdict(lambda: [0, 0.0])    # op -> [count, self host us]
        self.runtime: dict[str, list] = defaultdict(lambda: [0, 0.0])     # CUDA runtime call -> [count, host us]

    def wrap(self, fn):
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])

        def profiled(*args, **kwargs):
            with profile(activities=acts) as prof:
                out = fn(*args, **kwargs)
                if self.cuda:
                    torch.cuda.synchronize()          # the tower's kernels inside the trace
            launches = waits = top_ops = 0
            waits_by: dict[str, int] = defaultdict(int)
            for e in prof.events():
                if e.device_type == DeviceType.CUDA:
                    k = self.kernels[kernel_family(e.name)]
                    k[0] += 1
                    k[1] += e.time_range.elapsed_us()
                    continue
                if e.name.startswith("cu"):                  # CUDA runtime / driver calls (malloc, copies, ...)
                    r = self.runtime[e.name]
                    r[0] += 1
                    r[1] += e.cpu_time_total
                if e.name in LAUNCH_CALLS:
                    launches += 1
                elif e.name in SYNC_CALLS or (not self.cuda and e.name in CPU_SYNC_OPS):
                    waits += 1
                    waits_by[e.name] += 1
                elif e.name.startswith("aten::"):
                    h = self.host_ops[e.name]
                    h[0] += 1
                    h[1] += e.self_cpu_time_total
                    top_ops += e.cpu_parent is None
            self.calls.append({"launches": launches if self.cuda else top_ops, "host_waits": waits,
                               "host_waits_by": dict(waits_by), "images": len(args[1]) if len(args) > 1 else None})
            return out

        return profiled

    def result(self, top: int = 15) -> dict:
        n = max(len(self.calls), 1)
        kern = sorted(self.kernels.items(), key=lambda kv: -kv[1][1])
        ops = sorted(self.host_ops.items(), key=lambda kv: -kv[1][1])
        return {"calls": len(self.calls),
                "launch_kind": "CUDA kernel launches" if self.cuda else "top-level aten ops (a launch each on GPU)",
                "launches_per_call": [c["launches"] for c in self.calls],
                "host_waits_per_call": [c["host_waits"] for c in self.calls],
                "host_waits_by": {k: sum(c["host_waits_by"].get(k, 0) for c in self.calls)
                                  for k in sorted({k for c in self.calls for k in c["host_waits_by"]})},
                "images_per_call": [c["images"] for c in self.calls],
                "kernel_device_ms": [{"kernel": k, "count": c, "ms": us / 1e3, "ms_per_call": us / 1e3 / n}
                                     for k, (c, us) in kern[:top]],
                "kernel_device_ms_total": sum(us for _, us in self.kernels.values()) / 1e3,
                "host_ops": [{"op": k, "count": c, "self_ms": us / 1e3} for k, (c, us) in ops[:top]],
                "cuda_runtime_calls": [{"call": k, "count": c, "host_ms": us / 1e3}
                                       for k, (c, us) in sorted(self.runtime.items(), key=lambda kv: -kv[1][1])]}


def sync_wrap(fn, timers: Timers, cuda: bool):
    """The tower call between two device syncs, under sync debug mode "warn" (see the module docstring)."""
    import warnings

    import torch

    def synced(*args, **kwargs):
        t0 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
        t2 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        timers.seconds["vision_presync"] += t1 - t0
        timers.seconds["vision_host"] += t2 - t1
        timers.seconds["vision_device_tail"] += t3 - t2
        for w in caught:
            if "synchroniz" in str(w.message):
                timers.syncs[str(w.message).splitlines()[0][:120]] += 1
        return out

    return synced


def instrument(llm, timers: Timers, steps: list[dict], sync_vision: bool = False,
               vision_profile: VisionProfile | None = None) -> None:
    import hayabusa.worker.mm_inputs as mmi

    engine = llm.llm_engine
    runner = engine.runner
    model = runner.model
    timers.wrap(runner, "update_states", "state_update")
    timers.wrap(runner, "prepare_inputs", "input_prep")
    timers.wrap(runner, "copy_inputs", "copy_inputs")
    timers.wrap(runner.mm, "prepare", "mm_prepare")
    cuda = next(model.parameters()).is_cuda
    if vision_profile is not None:         # innermost: the profile holds the tower call alone
        fn = model.get_image_embeddings
        model.get_image_embeddings = vision_profile.wrap(fn)
        timers._undo.append((model, "get_image_embeddings", None))
    if sync_vision:
        fn = model.get_image_embeddings
        model.get_image_embeddings = sync_wrap(fn, timers, cuda)
        timers._undo.append((model, "get_image_embeddings", None))
    timers.wrap(model, "get_image_embeddings", "vision_tower")
    timers.wrap(mmi, "mrope_prompt_positions", "mrope_admit")
    timers.wrap(mmi.StepMultiModal, "run", "text_forward")
    if runner.decode_runner is not None:
        timers.wrap(runner.decode_runner, "run", "text_forward")
    timers.wrap(model, "forward", "text_forward")
    proc = engine.input_processor.mm_processor
    if proc is not None:
        timers.wrap(proc, "preprocess", "mm_preprocess")
    schedule, step = engine.scheduler.schedule, engine.step
    last: dict = {}

    def recording_schedule():
        out = schedule()
        last["R"], last["T"] = out.num_reqs, out.total_num_scheduled_tokens
        last["images"] = sum(len(v) for v in out.scheduled_encoder_inputs.values())
        return out

    def recording_step():
        before = {k: engine.stats[k] for k in PHASES}
        t_before = dict(timers.seconds)
        last.clear()
        outs = step()
        rec = {k: engine.stats[k] - before[k] for k in PHASES}
        rec.update({k: v - t_before.get(k, 0.0) for k, v in timers.seconds.items() if k != "mm_preprocess"})
        rec.update(R=last.get("R", 0), T=last.get("T", 0), images=last.get("images", 0))
        if rec["R"]:
            steps.append(rec)
        return outs

    engine.scheduler.schedule = recording_schedule
    engine.step = recording_step
    timers._undo.append((engine, "step", None))
    timers._undo.append((engine.scheduler, "schedule", None))


def uninstrument(llm, timers: Timers) -> None:
    for owner, attr, fn in reversed(timers._undo):
        if fn is None:
            with contextlib.suppress(AttributeError):
                delattr(owner, attr)          # back to the class's method
        else:
            setattr(owner, attr, fn)
    timers._undo.clear()


def summarize(steps: list[dict], timers: Timers, n_images: int) -> dict:
    keys = ("launch_s", "state_update", "input_prep", "mm_prepare", "vision_tower", "mrope_admit", "copy_inputs",
            "text_forward", "schedule_s", "wait_s", "collect_s")
    out: dict = {"images": n_images, "steps": {}}
    for kind in ("prefill", "decode", "all"):
        sel = [s for s in steps if kind == "all" or (s["T"] > s["R"]) == (kind == "prefill")]
        n = len(sel)
        row = {"steps": n}
        for k in keys:
            total = sum(s.get(k, 0.0) for s in sel)
            if k == "mm_prepare":     # the tower runs inside prepare: report prepare's own time
                total -= sum(s.get("vision_tower", 0.0) for s in sel)
            row[k] = total
        out["steps"][kind] = row
    out["mm_preprocess_s"] = timers.seconds.get("mm_preprocess", 0.0)
    out["vision_tower_calls"] = timers.calls.get("vision_tower", 0)
    if "vision_host" in timers.seconds:
        out["vision_sync"] = {"presync_s": timers.seconds["vision_presync"],
                              "host_s": timers.seconds["vision_host"],
                              "device_tail_s": timers.seconds["vision_device_tail"],
                              "sync_warnings": dict(timers.syncs)}
    return out


def print_table(res: dict) -> None:
    print(f"model {res['model']}  device {res['device']}  requests {res['requests']}  images {res['images']}  "
          f"max_num_seqs {res['max_num_seqs']}  max_tokens {res['max_tokens']}  wall {res['wall_s']:.2f} s")
    names = [("launch_s", "launch (all)"), ("state_update", "  state update"), ("mrope_admit", "    mrope @admit"),
             ("input_prep", "  input prep"), ("mm_prepare", "  mm prepare (no tower)"),
             ("vision_tower", "  vision tower"), ("copy_inputs", "  copy inputs"),
             ("text_forward", "  text forward"), ("schedule_s", "schedule"), ("wait_s", "wait"),
             ("collect_s", "collect")]
    s = res["steps"]
    print(f"{'phase':26s}{'total s':>10s}{'prefill ms/step':>17s}{'decode ms/step':>16s}{'ms/image':>10s}")
    for k, label in names:
        tot = s["all"][k]
        pre = 1e3 * s["prefill"][k] / max(s["prefill"]["steps"], 1)
        dec = 1e3 * s["decode"][k] / max(s["decode"]["steps"], 1)
        per_img = 1e3 * tot / max(res["images"], 1)
        print(f"{label:26s}{tot:10.3f}{pre:17.3f}{dec:16.3f}{per_img:10.3f}")
    _print_vision(res)
    print(f"steps: {s['prefill']['steps']} prefill, {s['decode']['steps']} decode; vision-tower calls "
          f"{res['vision_tower_calls']}; image processor (threads) {res['mm_preprocess_s']:.3f} s "
          f"({1e3 * res['mm_preprocess_s'] / max(res['images'], 1):.2f} ms/image)")


def _print_vision(res: dict) -> None:
    vs = res.get("vision_sync")
    if vs:
        print(f"vision tower with syncs: presync {vs['presync_s']:.3f} s (earlier work), host {vs['host_s']:.3f} s "
              f"(until the call returns), device tail {vs['device_tail_s']:.3f} s (after it); synchronizing ops "
              f"inside: {sum(vs['sync_warnings'].values())}")
        for msg, n in vs["sync_warnings"].items():
            print(f"    {n:6d}  {msg}")
    vp = res.get("vision_profile")
    if not vp:
        return
    per = vp["launches_per_call"]
    print(f"vision profile: {vp['calls']} calls, {vp['launch_kind']} per call {per} "
          f"(mean {sum(per) / max(len(per), 1):.0f}); host waits per call {vp['host_waits_per_call']} "
          f"{vp['host_waits_by']}; images per call {vp['images_per_call']}")
    if vp["kernel_device_ms"]:
        print(f"  top kernel families by device time (total {vp['kernel_device_ms_total']:.1f} ms):")
        for k in vp["kernel_device_ms"]:
            print(f"    {k['ms']:10.2f} ms {k['count']:8d}x  {k['kernel']}")
    if vp["cuda_runtime_calls"]:
        print("  CUDA runtime calls by host time (cudaMalloc / cudaFree / cudaHostAlloc here: the allocator at work):")
        for r in vp["cuda_runtime_calls"]:
            print(f"    {r['host_ms']:10.2f} ms {r['count']:8d}x  {r['call']}")
    print("  top host ops by self time:")
    for o in vp["host_ops"]:
        print(f"    {o['self_ms']:10.2f} ms {o['count']:8d}x  {o['op']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Qwen2.5-VL checkpoint folder (default: build the tiny one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile the measured run; print the top 30")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sync-vision", action="store_true",
                   help="synchronize before and after each tower call: its host vs device time, syncs inside it")
    p.add_argument("--profile-vision", action="store_true",
                   help="torch.profiler over the tower calls: launches per call, kernel families, host ops")
    p.add_argument("--no-vision-varlen", action="store_true",
                   help="the tower's grouped SDPA path on CUDA too (vision_attention.VISION_VARLEN = False), for A/B")
    ns = p.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from hayabusa import LLM, SamplingParams
    from hayabusa.bench.runner import bench_prompts
    from hayabusa.bench.workloads import w8

    torch.set_num_threads(max(1, torch.get_num_threads()))
    if ns.no_vision_varlen:
        import hayabusa.model.vision_attention as va

        va.VISION_VARLEN = False
    tmp = None
    model_dir = ns.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = build_tiny(tmp.name)
    wl = w8()
    reqs = wl.requests[:ns.requests]
    llm = LLM(model_dir, device=ns.device, max_num_seqs=ns.max_num_seqs, enforce_eager=ns.enforce_eager,
              **wl.engine_defaults)
    prompts = bench_prompts(llm.get_tokenizer(), reqs)
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    warm = bench_prompts(llm.get_tokenizer(), wl.requests[-2:])
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    timers, steps = Timers(), []
    vprof = VisionProfile(ns.device.startswith("cuda")) if ns.profile_vision else None
    instrument(llm, timers, steps, sync_vision=ns.sync_vision, vision_profile=vprof)
    prof = cProfile.Profile() if ns.profile else None
    t0 = time.perf_counter()
    try:
        if prof is not None:
            outs = prof.runcall(llm.generate, prompts, params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        uninstrument(llm, timers)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == ns.max_tokens for o in outs)
    n_images = sum(len(r.images or []) for r in reqs)
    res = summarize(steps, timers, n_images)
    res.update(model=ns.model or "qwen2.5-vl-tiny (temp)", device=ns.device, requests=len(reqs),
               max_num_seqs=ns.max_num_seqs, max_tokens=ns.max_tokens, wall_s=wall,
               vision_varlen=not ns.no_vision_varlen)
    if vprof is not None:
        res["vision_profile"] = vprof.result()
    if ns.json:
        print(json.dumps(res, indent=1))
    else:
        print_table(res)
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue()[:12000], file=sys.stderr)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
