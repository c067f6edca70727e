"""Hardware ceilings measured on the current GPU, and the floors (least possible times) they imply.

- copy bandwidth: ``dst.copy_(src)`` of a 1 GiB buffer, GB/s counting read + write (2 x bytes / s, 1 GB = 1e9 B).
- matmul rate: bf16 ``8192 x 8192 @ 8192 x 8192``, TFLOP/s (2 x 8192^3 FLOPs per product, 1 TFLOP = 1e12).

Floors (BENCHMARKS.md "Ceilings and floors"):
- decode (W3): seconds per token = (weight bytes read + KV bytes read) / bandwidth.
- prefill / large batch (W1, W2, W4): seconds = (2 x matmul parameters x tokens + attention FLOPs) / matmul rate.
``fraction_of_ceiling`` = floor / measured time (1.0 = at the ceiling).
"""

from __future__ import annotations

import time
from typing import Any

import torch

COPY_BYTES = 1 << 30
MATMUL_N = 8192


def _time_cuda(fn: Any, iters: int, warmup: int = 3) -> float:
    """Seconds per call of fn() on the current CUDA stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_ceilings(device: str | None = None) -> dict[str, Any] | None:
    """Measure copy bandwidth and bf16 matmul rate on a CUDA device.

    Returns:
        {"gpu", "copy_bandwidth_gbs" (GB/s, read+write), "matmul_tflops" (bf16 TFLOP/s), "copy_bytes",
        "matmul_n", "seconds"}, or None (with a message on stdout) when no CUDA device is available.
    """
    if not torch.cuda.is_available() or (device is not None and not str(device).startswith("cuda")):
        print("hayabusa bench: ceilings need a CUDA GPU; skipped on CPU (no fraction_of_ceiling is reported).")
        return None
    t0 = time.perf_counter()
    dev = torch.device(device or "cuda")
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src), iters=20)
    del src, dst
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
    c = torch.empty_like(a)
    mm_s = _time_cuda(lambda: torch.matmul(a, b, out=c), iters=20)
    del a, b, c
    torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(dev),
            "copy_bandwidth_gbs": round(2 * COPY_BYTES / copy_s / 1e9, 1),
            "matmul_tflops": round(2 * MATMUL_N ** 3 / mm_s / 1e12, 1),
            "copy_bytes": COPY_BYTES, "matmul_n": MATMUL_N, "seconds": round(time.perf_counter() - t0, 2)}


def decode_bytes_per_token(stats: dict[str, int], prompt_len: int, output_len: int, elem_bytes: int = 2) -> float:
    """Bytes one decode step of a single sequence reads, averaged over the `output_len` steps.

    Weights: every matrix except the input embedding (only one row is read) plus the lm_head
    (= the embedding when tied). KV: 2 x layers x kv_heads x head_dim x elem_bytes per context token, at the
    mean context length prompt_len + (output_len - 1) / 2.
    """
    weight_bytes = elem_bytes * (stats["non_embedding_params"] + stats["embedding_params"])
    kv_per_token = 2 * stats["num_layers"] * stats["num_kv_heads"] * stats["head_dim"] * elem_bytes
    mean_ctx = prompt_len + (output_len - 1) / 2
    return weight_bytes + kv_per_token * mean_ctx


def request_flops(stats: dict[str, int], prompt_len: int, output_len: int) -> float:
    """FLOPs to process one request of prompt_len + output_len tokens (the last output token is never fed back).

    Matmuls: 2 x non-embedding params per token fed, plus 2 x vocab x hidden per logit row (one per output token).
    Attention: QK^T and PV, 4 x layers x heads x head_dim FLOPs per (query, key) pair, causal.
    """
    fed = prompt_len + output_len - 1
    dense = 2.0 * stats["non_embedding_params"] * fed + 2.0 * stats["embedding_params"] * output_len
    pairs = fed * (fed + 1) / 2
    attn = 4.0 * stats["num_layers"] * stats["num_heads"] * stats["head_dim"] * pairs
    return dense + attn


def floor_seconds(kind: str | None, stats: dict[str, int] | None, ceilings: dict[str, Any] | None,
                  requests: list[tuple[int, int]], elem_bytes: int = 2) -> float | None:
    """Least possible seconds for the workload under the ceiling `kind`.

    Args:
        kind: "bandwidth" (per output token, single stream) or "matmul" (whole run).
        stats: models.shape_stats of the checkpoint.
        ceilings: measure_ceilings() result.
        requests: (prompt_len, output_len) per sequence (a request with n samples counts n times).
        elem_bytes: bytes per weight / KV element (2 for bf16).

    Returns:
        bandwidth: seconds per output token; matmul: seconds for all requests; None when anything is missing.
    """
    if kind is None or not stats or not ceilings or not requests:
        return None
    if kind == "bandwidth":
        p, o = requests[0]
        return decode_bytes_per_token(stats, p, o, elem_bytes) / (ceilings["copy_bandwidth_gbs"] * 1e9)
    if kind == "matmul":
        flops = sum(request_flops(stats, p, o) for p, o in requests)
        return flops / (ceilings["matmul_tflops"] * 1e12)
    raise ValueError(f"unknown ceiling kind {kind!r}")
