"""Host overhead of the OpenAI server at high concurrency, measured on CPU (no GPU claim).

    python benchmarks/server_overhead.py                               # 100 clients x 128 tokens, 3 repeats
    python benchmarks/server_overhead.py --num-clients 64 --repeats 5
    python benchmarks/server_overhead.py --with-tokenizer              # detokenize every token as well
    python benchmarks/server_overhead.py --fake-forward-ms -1          # the real (CPU) forward of stories260K
    python benchmarks/server_overhead.py --profile /tmp/prof           # cProfile: event loop and engine thread

The server runs in a subprocess (this file with --serve): the AsyncLLMEngine of ``hayabusa serve`` on stories260K
with ``skip_tokenizer_init`` (as ``hayabusa bench --workload W6`` runs it) and the app of ``build_app`` under
``run_server`` (uvicorn), plus one route, ``GET /_overhead``, that reports the engine thread's time inside
``LLMEngine.step()``. By default the model forward is replaced by a 1.5 ms sleep (it releases the GIL, as a GPU
step does; the 0.5B decode step at batch 100 on an H200 is ~1.5 ms): everything else of a step (scheduler, KV
blocks, inputs, sampling, output processing) is real. The client, in this process, is a minimal asyncio HTTP/1.1
client (cheaper than httpx/openai) that sends N streaming /v1/completions at once (token-id prompts,
``ignore_eos``, ``stream_options.include_usage``) and checks each gets max_tokens tokens in at most as many chunks.

Reported per repeat (and the median of the repeats):
    wall_s          first request sent -> last stream closed
    tok_s           output tokens / wall_s
    tpot_ms         median over requests of (last chunk - first chunk) / (tokens - 1), client side
    chunks/req      SSE chunks with choices per request (fewer than tokens when a lagging stream got two at once)
    step_wall%      time the engine thread spent inside step(), as a share of wall_s
    step_ms         mean wall time of one step (the sleep, the step's own work, and waits for the GIL)
    step_cpu_ms     mean CPU time of the engine thread inside one step (its Python bookkeeping and torch calls)
    gc_ms           wall time in Python's cyclic garbage collector during the run (any thread)
    srv_cpu_s       CPU time of the whole server process during the run (both threads, /proc)
    host_us/tok     (server CPU - engine thread CPU inside step()) / output tokens: what each streamed token
                    costs the server outside the engine step (asyncio, FastAPI, JSON, HTTP writes)
    host_us/chnk    the same per SSE chunk with choices
    client_cpu_s    CPU time of this client process (it shares the machine's cores with the server)

The engine thread and the event loop share one GIL, so per decode step at batch B the server needs about
step_cpu_ms + B x host_us/chnk of CPU; where that exceeds the device's step time it is the TPOT. On a shared
2-core machine the other load moves wall_s, tok_s and tpot_ms a lot; the CPU-time columns are the steadier
measure of host work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(REPO.parent / "shared" / "assets" / "models" / "stories260K")


# ---------------------------------------------------------------------------------------------------- server side
def serve(ns: argparse.Namespace) -> None:
    """Run the server (this is the subprocess)."""
    sys.path.insert(0, str(REPO))
    import cProfile
    import threading

    import torch

    from hayabusa.bench.common import GCTimer
    from hayabusa.entrypoints.async_engine import AsyncEngineArgs, AsyncLLMEngine
    from hayabusa.entrypoints.openai.server import build_app, run_server

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=ns.model, skip_tokenizer_init=not ns.with_tokenizer, disable_log_requests=True, device="cpu",
        max_num_seqs=max(ns.num_clients, 1), max_model_len=ns.prompt_len + ns.max_tokens + 8),
        start_engine_loop=False)
    llm = engine.engine
    if ns.switch_interval:
        sys.setswitchinterval(ns.switch_interval)
    torch.set_num_threads(1)             # so that the engine thread's CPU time is all of the step's CPU time
    if ns.fake_forward_ms >= 0:
        fake_forward(llm.runner, ns.fake_forward_ms / 1e3)
    counters = {"steps": 0, "step_wall": 0.0, "step_cpu": 0.0}
    gc_timer = GCTimer().install()   # time in the cyclic garbage collector, all threads (for the server's life)
    step = llm.step

    def timed_step():
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = step()
        counters["step_cpu"] += time.thread_time() - c0
        counters["step_wall"] += time.perf_counter() - t0
        counters["steps"] += 1
        return outs

    llm.step = timed_step
    profiles = []
    if ns.profile:
        run = engine._run

        def profiled_run() -> None:
            prof = cProfile.Profile()
            profiles.append(("engine", prof))
            prof.runcall(run)

        engine._run = profiled_run
    engine.start_background_loop()
    app = build_app(engine, ["m"], model_path=ns.model)

    @app.get("/_overhead")
    async def overhead(reset: int = 0) -> dict:
        snap = dict(counters, gc_s=gc_timer.seconds, gc_n=gc_timer.passes,
                    num_generation_tokens=engine.get_stats()["num_generation_tokens"], threads=threading.active_count())
        if reset:
            counters.update(steps=0, step_wall=0.0, step_cpu=0.0)
            gc_timer.seconds, gc_timer.passes = 0.0, 0
        return snap

    loop_prof = cProfile.Profile() if ns.profile else None
    try:
        if loop_prof is not None:
            loop_prof.runcall(run_server, app, "127.0.0.1", ns.port, log_level="warning", access_log=False)
        else:
            run_server(app, "127.0.0.1", ns.port, log_level="warning", access_log=False)
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
        if ns.profile:
            os.makedirs(ns.profile, exist_ok=True)
            loop_prof.dump_stats(os.path.join(ns.profile, "event_loop.prof"))
            for name, prof in profiles:
                prof.dump_stats(os.path.join(ns.profile, f"{name}.prof"))


def fake_forward(runner, seconds: float) -> None:
    """Replace the model forward by a GIL-free sleep (a GPU step's wait) and logits that pick a token from the
    position, so that everything else of the step (scheduler, KV blocks, inputs, sampling, outputs) is real."""
    import torch

    vocab = runner.vocab_size

    def run_model(inp):
        if seconds > 0:
            time.sleep(seconds)
        rows = len(inp.logits_indices)
        ids = torch.from_numpy((inp.positions[inp.logits_indices] * 31 + 7) % (vocab - 3) + 3)
        logits = torch.zeros(rows, vocab)
        logits[torch.arange(rows), ids] = 1.0
        return logits

    runner._run_model = run_model


# ---------------------------------------------------------------------------------------------------- client side
async def stream_one(port: int, payload: bytes, max_tokens: int) -> tuple[float, float, int, int, str]:
    """One streaming completion: (first chunk time, last chunk time, chunks with choices, usage tokens, error)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        writer.close()
        return 0.0, 0.0, 0, 0, head.decode(errors="replace")[:200]
    first = last = 0.0
    body = bytearray()
    while True:                                   # chunked transfer encoding
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            break
        now = time.perf_counter()
        if b'"finish_reason"' in data:
            first = first or now
            last = now
        body += data[:-2]
    writer.close()
    chunks, usage, err = 0, 0, ""
    for event in bytes(body).split(b"\n\n"):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        obj = json.loads(event[6:])
        if "error" in obj:
            err = str(obj["error"])[:200]
        elif obj["choices"]:
            chunks += 1
        else:
            usage = obj["usage"]["completion_tokens"]
    # A slow reader may get two tokens in one chunk (a stream keeps only the newest output), never fewer tokens.
    if not err and (usage != max_tokens or not 0 < chunks <= max_tokens):
        err = f"got {chunks} chunks, usage {usage}, expected {max_tokens} tokens"
    return first, last, chunks, usage, err


def get_json(port: int, path: str) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(ns: argparse.Namespace, pid: int, seed: int) -> dict:
    payloads = []
    for i in range(ns.num_clients):
        prompt = [(seed * 7919 + i * 131 + j * 17) % 500 + 3 for j in range(ns.prompt_len)]
        payloads.append(json.dumps({"model": "m", "prompt": prompt, "max_tokens": ns.max_tokens, "temperature": 0.0,
                                    "ignore_eos": True, "stream": True,
                                    "stream_options": {"include_usage": True}}).encode())
    get_json(ns.port, "/_overhead?reset=1")
    before = get_json(ns.port, "/_overhead")
    cpu0 = proc_cpu_seconds(pid)

    async def main():
        return await asyncio.gather(*[stream_one(ns.port, p, ns.max_tokens) for p in payloads])

    t0, client0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    results = asyncio.run(main())
    wall = time.perf_counter() - t0
    client1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = proc_cpu_seconds(pid) - cpu0
    after = get_json(ns.port, "/_overhead")
    errors = [r[4] for r in results if r[4]]
    if errors:
        raise SystemExit(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    tokens = sum(r[3] for r in results)
    tpots = sorted((r[1] - r[0]) / (r[3] - 1) for r in results if r[3] > 1)
    steps = after["steps"] - before["steps"]
    step_wall = after["step_wall"] - before["step_wall"]
    step_cpu = after["step_cpu"] - before["step_cpu"]
    chunks = sum(r[2] for r in results)
    return {"wall_s": wall, "tok_s": tokens / wall, "tpot_ms": 1e3 * statistics.median(tpots),
            "chunks_per_req": chunks / len(results), "step_wall_pct": 100 * step_wall / wall,
            "step_ms": 1e3 * step_wall / max(steps, 1), "step_cpu_ms": 1e3 * step_cpu / max(steps, 1),
            "gc_ms": 1e3 * (after["gc_s"] - before["gc_s"]), "srv_cpu_s": cpu,
            "host_us_per_tok": 1e6 * (cpu - step_cpu) / tokens, "host_us_per_chunk": 1e6 * (cpu - step_cpu) / chunks,
            "client_cpu_s": client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-clients", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (stories260K's context is 512)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fake-forward-ms", type=float, default=1.5,
                   help="replace the model forward by a sleep of this many ms (default 1.5: the 0.5B decode step "
                        "at batch 100 on an H200); -1 runs the real forward of the model on the CPU")
    p.add_argument("--with-tokenizer", action="store_true", help="load the tokenizer (detokenize each token)")
    p.add_argument("--profile", metavar="DIR", help="cProfile the server: DIR/event_loop.prof, DIR/engine.prof")
    p.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval in the server (s)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.serve:
        return serve(ns)
    if not ns.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ns.port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve", "--port", str(ns.port), "--model", ns.model, "--num-clients",
           str(ns.num_clients), "--max-tokens", str(ns.max_tokens), "--prompt-len", str(ns.prompt_len),
           "--fake-forward-ms", str(ns.fake_forward_ms), "--switch-interval", str(ns.switch_interval)]
    cmd += ["--with-tokenizer"] * ns.with_tokenizer + (["--profile", ns.profile] if ns.profile else [])
    server = subprocess.Popen(cmd, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                get_json(ns.port, "/_overhead")
                break
            except (OSError, ValueError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.2)
        asyncio.run(stream_one(ns.port, json.dumps({"model": "m", "prompt": [5] * 8, "max_tokens": 4,
                                                    "ignore_eos": True, "stream": True}).encode(), 4))   # warm-up
        print(f"{ns.num_clients} clients x {ns.max_tokens} tokens, prompt {ns.prompt_len} tokens, "
              f"{'with' if ns.with_tokenizer else 'skip'} tokenizer, model {Path(ns.model).name}, forward "
              f"{'real (CPU)' if ns.fake_forward_ms < 0 else f'faked as a {ns.fake_forward_ms} ms sleep'}")
        cols = ("wall_s", "tok_s", "tpot_ms", "chunks_per_req", "step_wall_pct", "step_ms", "step_cpu_ms", "gc_ms",
                "srv_cpu_s", "host_us_per_tok", "host_us_per_chunk", "client_cpu_s")
        names = {"chunks_per_req": "chunks/req", "step_wall_pct": "step_wall%", "host_us_per_tok": "host_us/tok",
                 "host_us_per_chunk": "host_us/chnk", "client_cpu_s": "client_cpu_s"}
        print(" ".join(f"{names.get(c, c):>12}" for c in cols))
        rows = []
        for r in range(ns.repeats):
            rows.append(run_once(ns, server.pid, r))
            print(" ".join(f"{rows[-1][c]:>12.3f}" for c in cols), flush=True)
        if len(rows) > 1:
            print(" ".join(f"{statistics.median(x[c] for x in rows):>12.3f}" for c in cols), " (median)")
    finally:
        server.send_signal(signal.SIGINT)   # uvicorn re-raises it after a clean shutdown
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    if ns.profile:
        print(f"profiles in {ns.profile}: python -m pstats {ns.profile}/event_loop.prof")


if __name__ == "__main__":
    main()
