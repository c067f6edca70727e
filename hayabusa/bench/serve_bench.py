"""W6: online serving against a running OpenAI-compatible server, with ``vllm bench serve``'s definitions and
printed names.

    hayabusa serve DIR --served-model-name m &                 # or vllm serve, or any OpenAI-compatible server
    hayabusa bench --workload W6 --base-url http://127.0.0.1:8000 --model m --request-rate 1,4,16,64,inf \\
        --goodput ttft:500 tpot:50 --json w6.json

Requests are W6's (token-id prompts, greedy, ``ignore_eos``) sent to /v1/completions with ``stream: true`` and
``stream_options.include_usage``; arrivals are a Poisson process (gamma intervals with --burstiness, 1 = Poisson),
the intervals rescaled so that the last one lands at ``num_requests / rate`` (as vLLM does). One run per rate.

Definitions (vLLM's ``calculate_metrics``), client side:
    TTFT  send -> first SSE chunk with choices        E2EL  send -> last chunk with choices
    ITL   gaps between consecutive chunks             TPOT  (E2EL - TTFT) / (output tokens - 1), per request
    output tokens = ``usage.completion_tokens``; throughputs divide by the run's wall time;
    goodput = requests meeting every SLO of --goodput (ms; a request with one token has TPOT 0) per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_RATES = "1,4,16,64,inf"
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def add_w6_args(p: argparse.ArgumentParser) -> None:
    """The W6 flags of ``hayabusa bench`` (vLLM's names). --model is the served model name for W6."""
    g = p.add_argument_group("W6 (online serving; needs a running server)")
    g.add_argument("--base-url", help="server address, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="the server path the requests are POSTed to (default /v1/completions)")
    g.add_argument("--request-rate", default=DEFAULT_RATES,
                   help=f"requests per second, comma-separated, 'inf' = all at once (default {DEFAULT_RATES})")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the intervals (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--num-prompts", type=int, default=None, help="requests per rate (default: W6's 512 x --scale)")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    g.add_argument("--metric-percentiles", default="50,90,99",
                   help="comma-separated percentiles (0-100) reported for each of --percentile-metrics "
                        "(default 50,90,99)")
    g.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                   help="comma-separated latency metrics whose percentiles are reported, of "
                        f"{', '.join(METRIC_NAMES)} (default {','.join(PERCENTILE_METRICS)})")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--seed-arrivals", type=int, default=0, help="seed of the arrival times")


@dataclass
class RequestResult:
    """One request as the client saw it (seconds, perf_counter clock)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}; raises ValueError naming a bad pair."""
    out: dict[str, float] = {}
    for pair in pairs or []:
        try:
            key, value = pair.split(":")
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: write KEY:MS with KEY one of ttft, tpot, e2el.") from None
        if key not in ("ttft", "tpot", "e2el") or out[key] < 0:
            raise ValueError(f"--goodput {pair!r}: KEY must be ttft, tpot or e2el and MS >= 0.")
    return out


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start): gamma intervals of mean 1/rate, rescaled so the last is at num / rate."""
    if rate == float("inf"):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    delays = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num))
    if delays[-1] > 0:
        delays *= (num / rate) / delays[-1]
    return delays.tolist()


async def send_request(client: Any, url: str, payload: dict[str, Any], prompt_len: int,
                       headers: dict[str, str]) -> RequestResult:
    """POST one streaming completion; time its SSE chunks."""
    res = RequestResult(prompt_len=prompt_len)
    st = time.perf_counter()
    res.start_time = most_recent = st
    got_first = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    return res
                if obj.get("choices"):
                    now = time.perf_counter()
                    if not got_first:
                        got_first, res.ttft = True, now - st
                    else:
                        res.itl.append(now - most_recent)
                    most_recent = now
                elif obj.get("usage"):
                    res.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
        res.latency = most_recent - st
        res.success = got_first
        if not got_first:
            res.error = "no tokens received"
    except Exception as e:  # noqa: BLE001 -- a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_rate(base_url: str, endpoint: str, model: str, requests: list[Any], rate: float, burstiness: float,
                   max_concurrency: int | None, headers: dict[str, str], seed: int = 0
                   ) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results and the wall time of the run."""
    import httpx

    url = base_url.rstrip("/") + endpoint
    times = arrival_times(len(requests), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(req: Any) -> RequestResult:
            payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
                       "temperature": req.temperature, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}
            if sem is None:
                return await send_request(client, url, payload, len(req.prompt_token_ids), headers)
            async with sem:
                return await send_request(client, url, payload, len(req.prompt_token_ids), headers)

        start = time.perf_counter()
        tasks = []
        for req, t in zip(requests, times):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                      goodput: dict[str, float]) -> dict[str, Any]:
    """vLLM's ``calculate_metrics`` (client side); times in ms, keys as in vLLM's result JSON."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [x for r in ok for x in r.itl]
    tpots, all_tpots = [], []
    for r in ok:
        n = r.output_tokens or (len(r.itl) + 1)
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens or (len(r.itl) + 1) for r in ok)
    good = 0
    if goodput:
        per_req = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            good += all(per_req[k][i] * 1000 <= slo for k, slo in goodput.items())
    m: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrent_requests": _peak_concurrency(ok),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(values or [0.0]) * 1000
        m[f"mean_{name}_ms"], m[f"median_{name}_ms"] = float(arr.mean()), float(np.median(arr))
        m[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            m[f"p{_pword(p)}_{name}_ms"] = float(np.percentile(arr, p))
    m["errors"] = [r.error for r in results if not r.success][:10]
    return m


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _peak_concurrency(ok: list[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def format_result(m: dict[str, Any], rate: float, max_concurrency: int | None, percentiles: list[float],
                  metrics: list[str], goodput: bool) -> str:
    """The block ``vllm bench serve`` prints, with the same labels."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines += [row("Successful requests:", m["completed"]), row("Failed requests:", m["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if rate != float("inf"):
        lines.append(rowf("Request rate configured (RPS):", rate))
    lines += [rowf("Benchmark duration (s):", m["duration"]), row("Total input tokens:", m["total_input_tokens"]),
              row("Total generated tokens:", m["total_output_tokens"]),
              rowf("Request throughput (req/s):", m["request_throughput"])]
    if goodput:
        lines.append(rowf("Request goodput (req/s):", m["request_goodput"]))
    lines += [rowf("Output token throughput (tok/s):", m["output_throughput"]),
              rowf("Peak concurrent requests:", m["max_concurrent_requests"]),
              rowf("Total token throughput (tok/s):", m["total_token_throughput"])]
    for key in metrics:
        short, header = METRIC_NAMES[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(rowf(f"Mean {short} (ms):", m[f"mean_{key}_ms"]))
        lines.append(rowf(f"Median {short} (ms):", m[f"median_{key}_ms"]))
        for p in percentiles:
            lines.append(rowf(f"P{_pword(p)} {short} (ms):", m[f"p{_pword(p)}_{key}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def _parse_rates(spec: str) -> list[float]:
    try:
        rates = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate {spec!r}: give numbers or 'inf', comma-separated.") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--request-rate {spec!r}: rates must be > 0.")
    return rates


def _served_model(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_w6(ns: argparse.Namespace) -> int:
    """``hayabusa bench --workload W6 --base-url URL [--model NAME]``. Returns the exit code."""
    from hayabusa.bench import report
    from hayabusa.bench.workloads import get_workload

    if ns.workload.strip().upper() != "W6":
        print("hayabusa bench: run W6 alone (it needs --base-url; the others run in-process).", file=sys.stderr)
        return 2
    if not ns.base_url:
        print("hayabusa bench: W6 sends requests to a running server: give --base-url http://HOST:PORT (start "
              "one with `hayabusa serve MODEL`) and --model with its served name.", file=sys.stderr)
        return 2
    try:
        rates = _parse_rates(ns.request_rate)
        goodput = parse_goodput(ns.goodput)
        percentiles = [float(p) for p in ns.metric_percentiles.split(",") if p.strip()]
        metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
        bad = [m for m in metrics if m not in METRIC_NAMES]
        if bad:
            raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRIC_NAMES)}.")
        workload = get_workload("W6", ns.scale)
    except ValueError as e:
        print(f"hayabusa bench: {e}", file=sys.stderr)
        return 2
    requests = workload.requests
    if ns.num_prompts:
        requests = [requests[i % len(requests)] for i in range(ns.num_prompts)]
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    try:
        model = ns.model or _served_model(ns.base_url, headers)
    except Exception as e:  # noqa: BLE001
        print(f"hayabusa bench: cannot reach {ns.base_url}/v1/models ({e}); is the server running?",
              file=sys.stderr)
        return 1
    return _run_rates(ns, model, requests, rates, goodput, percentiles, metrics, headers, report)


def _run_rates(ns: argparse.Namespace, model: str, requests: list[Any], rates: list[float],
               goodput: dict[str, float], percentiles: list[float], metrics: list[str], headers: dict[str, str],
               report: Any) -> int:
    env = report.environment(None)
    records: list[dict[str, Any]] = []
    failures = 0
    warm, _ = asyncio.run(run_rate(ns.base_url, ns.endpoint, model, requests[:1], float("inf"), 1.0, None, headers))
    if not warm[0].success:
        print(f"hayabusa bench: the first test request failed: {warm[0].error}", file=sys.stderr)
        return 1
    for rate in rates:
        print(f"hayabusa bench: W6 at {rate} req/s ({len(requests)} requests, burstiness {ns.burstiness})",
              flush=True)
        results, duration = asyncio.run(run_rate(ns.base_url, ns.endpoint, model, requests, rate, ns.burstiness,
                                                 ns.max_concurrency, headers, ns.seed_arrivals))
        m = calculate_metrics(results, duration, percentiles, goodput)
        print(format_result(m, rate, ns.max_concurrency, percentiles, metrics, bool(goodput)), flush=True)
        failures += m["failed"] > 0
        records.append(_record(m, env, model, ns, rate, goodput))
        if ns.json:
            report.write_json(ns.json, records)
    if ns.json:
        print(f"hayabusa bench: {len(records)} record(s) -> {ns.json}")
    return 1 if failures else 0


def _record(m: dict[str, Any], env: dict[str, Any], model: str, ns: argparse.Namespace, rate: float,
            goodput: dict[str, float]) -> dict[str, Any]:
    """A bench record (report.REQUIRED_KEYS; ttft_ms / tpot_ms are medians) plus vLLM's result fields."""
    rate_json = "inf" if rate == float("inf") else rate
    return {"workload": "W6", "model": model, "engine": "server", **{k: env[k] for k in ("gpu", "commit", "date")},
            "output_throughput": round(m["output_throughput"], 2),
            "total_throughput": round(m["total_token_throughput"], 2),
            "ttft_ms": round(m["median_ttft_ms"], 3), "tpot_ms": round(m["median_tpot_ms"], 3),
            "startup_s": None, "peak_memory_bytes": None, "kv_cache_tokens": None,
            "engine_args": {"base_url": ns.base_url, "endpoint": ns.endpoint}, "versions": env["versions"],
            "ceilings": None, "fraction_of_ceiling": None, "variant": {"request_rate": rate_json},
            "request_rate": rate_json, "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency,
            "goodput_slo_ms": goodput or None, "scale": ns.scale, "command": env.get("command"), **m}
