"""Time T5 fp16's residual add + clamp + T5LayerNorm: the torch ops of model/t5.py's ``_add_norm`` (transformers'
numerics, ~8-10 launches) against ``kernels/t5_fp16_norm.t5_fp16_add_norm`` (one launch), on a CUDA GPU (issue
#17); print a table and optionally JSON.

    python benchmarks/kernels/bench_t5_fp16_norm.py [--t 1,64,256,1024,8192] [--d 512,768] [--json FILE]

Cases per (T, d): "fp16" (fp16 delta + fp16 residual: the clamped sum, the first block's attention sub-layers),
"fp16_inf" (the same with an inf in the last row: the kernel's serial fix-up pass), "fp32" (fp32 delta from the
FFN's wo + fp16 residual: the fp32 stream). Medians in us of CUDA-graph replays of 20 calls (divided by 20: how
decode runs) and of eager calls (host launch cost included). Each case first checks the residual bit for bit
against the torch path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
try:
    import triton
    import triton.testing
except ImportError:  # a CPU-only install: the engine runs plain torch there, and there is no kernel to time
    sys.exit(f"{sys.argv[0]}: times Triton kernels on a CUDA GPU and needs Triton (a CUDA build of torch installs "
             "it: pip install torch)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing

from hayabusa.kernels.t5_fp16_norm import reserve_t5_fp16_norm_sync, t5_fp16_add_norm, t5_fp16_add_norm_ref  # noqa: E402
from hayabusa.model import t5  # noqa: E402

REPS = 20


def _inputs(kind: str, T: int, d: int):
    g = torch.Generator(device="cuda").manual_seed(T * 7 + d)
    delta = torch.randn(T, d, device="cuda", generator=g) * 3
    residual = (torch.randn(T, d, device="cuda", generator=g) * 30).half()
    if kind != "fp32":
        delta = delta.half()
    if kind == "fp16_inf":
        residual[-1, 0], delta[-1, 0] = 60000.0, 60000.0
    norm = t5.T5LayerNorm(d, 1e-6, torch.float16, torch.device("cuda"))
    norm.weight.data.copy_(torch.rand(d, device="cuda", generator=g).half() + 0.5)
    return norm, delta, residual


def _graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1000 / REPS


def _eager_us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1000


def case(kind: str, T: int, d: int) -> dict:
    norm, delta, residual = _inputs(kind, T, d)
    fused = lambda: t5_fp16_add_norm(delta, residual, norm.weight, norm.eps)   # noqa: E731
    ref = lambda: t5_fp16_add_norm_ref(delta, residual, norm.weight, norm.eps)   # noqa: E731  (the torch path)
    assert torch.equal(fused()[1].nan_to_num(0.0), ref()[1].nan_to_num(0.0)), (kind, T, d)
    row = {"kind": kind, "T": T, "d": d, "torch_graph_us": _graph_us(ref), "fused_graph_us": _graph_us(fused),
           "torch_eager_us": _eager_us(ref), "fused_eager_us": _eager_us(fused)}
    row["graph_x"] = row["torch_graph_us"] / row["fused_graph_us"]
    row["eager_x"] = row["torch_eager_us"] / row["fused_eager_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", default="1,64,256,1024,8192")
    ap.add_argument("--d", default="512,768")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    reserve_t5_fp16_norm_sync("cuda")
    rows = []
    print(f"{'kind':9} {'T':>5} {'d':>4} | {'torch graph':>11} {'fused graph':>11} {'x':>5} | "
          f"{'torch eager':>11} {'fused eager':>11} {'x':>5}   (us per call)")
    for d in (int(v) for v in args.d.split(",")):
        for T in (int(v) for v in args.t.split(",")):
            for kind in ("fp16", "fp16_inf", "fp32"):
                r = case(kind, T, d)
                rows.append(r)
                print(f"{kind:9} {T:>5} {d:>4} | {r['torch_graph_us']:>11.2f} {r['fused_graph_us']:>11.2f} "
                      f"{r['graph_x']:>5.2f} | {r['torch_eager_us']:>11.2f} {r['fused_eager_us']:>11.2f} "
                      f"{r['eager_x']:>5.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
