"""W6 (hayabusa bench --workload W6 --base-url URL): vLLM's metric definitions checked by hand, and a tiny run
against the in-test server on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from hayabusa.bench import cli
from hayabusa.bench.serve_bench import RequestResult, arrival_times, calculate_metrics, parse_goodput


def test_metrics_by_hand():
    a = RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.02] * 4, latency=0.18,
                      start_time=0.0)
    b = RequestResult(success=True, prompt_len=10, output_tokens=1, ttft=0.3, itl=[], latency=0.3, start_time=0.05)
    c = RequestResult(success=False, error="HTTP 500")
    m = calculate_metrics([a, b, c], duration=2.0, percentiles=[50, 99], goodput={"ttft": 200.0, "tpot": 30.0})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 13.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(20.0)          # (180 - 100) / (5 - 1); b has one token: no TPOT
    assert m["mean_itl_ms"] == pytest.approx(20.0) and m["mean_e2el_ms"] == pytest.approx(240.0)
    assert m["request_goodput"] == 0.5                       # only a meets TTFT <= 200 ms (b: 300 ms)
    assert m["max_concurrent_requests"] == 2


def test_poisson_arrivals_and_goodput_parsing():
    t = arrival_times(100, rate=4.0, seed=0)
    assert len(t) == 100 and t == sorted(t) and t[-1] == pytest.approx(25.0)   # rescaled to num / rate
    assert arrival_times(5, float("inf")) == [0.0] * 5
    assert parse_goodput(["ttft:500", "e2el:3000"]) == {"ttft": 500.0, "e2el": 3000.0}
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])


def test_w6_against_a_server(qwen_server, tmp_path, capsys):
    out = tmp_path / "w6.json"
    rc = cli.main(["--workload", "W6", "--base-url", qwen_server.url, "--model", qwen_server.name,
                   "--api-key", qwen_server.api_key, "--scale", "0.02", "--request-rate", "50,inf",
                   "--goodput", "ttft:60000", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for label in ("Serving Benchmark Result", "Successful requests:", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Median TTFT (ms):", "P90 TPOT (ms):", "P99 ITL (ms):",
                  "P50 E2EL (ms):", "Request rate configured (RPS):"):
        assert label in printed
    recs = json.loads(out.read_text())
    assert [r["request_rate"] for r in recs] == [50.0, "inf"]
    for r in recs:
        assert r["workload"] == "W6" and r["completed"] == 10 and r["failed"] == 0
        assert r["total_output_tokens"] == 10 * 3 and r["total_input_tokens"] == 10 * 10   # 512 x 0.02, 128 x 0.02
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])
        assert r["p99_ttft_ms"] >= r["p50_ttft_ms"] > 0


def test_w6_needs_a_base_url(capsys):
    assert cli.main(["--workload", "W6", "--model", "m"]) == 2
    assert "--base-url" in capsys.readouterr().err
