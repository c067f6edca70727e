"""Time small_m_linear (kernels/small_m_linear.py) against cuBLAS's bf16 F.linear at decode's row counts on a CUDA
GPU; with --sweep, search its launches and write the SMALL_M_TABLE that HAYABUSA_SMALL_M_TABLE_JSON loads.

    python benchmarks/kernels/bench_small_m_linear.py [--shapes 7b,05b] [--m 1,4,16] [--sweep]
                                                      [--table-json FILE] [--json FILE]
    python benchmarks/kernels/bench_small_m_linear.py --from-json SWEEP.json [--table-json FILE]

Shapes, (K, N): Qwen2.5-7B's qkv (3584, 4608), o (3584, 3584), gate_up (3584, 37888), down (18944, 3584),
lm_head (3584, 152064), and Qwen2.5-0.5B's qkv (896, 1152), o (896, 896), gate_up (896, 9728), down (4864, 896),
lm_head (896, 151936). Times are CUDA-graph replay medians (how decode runs; this also checks the launch
captures), in us; '%copy' is the weight bytes moved per second over a device-to-device copy of the same bytes
measured in the same run (read + write counted). Note that a weight of <= ~40 MB stays in the H200's L2 cache between
replays of one layer, so the small layers' figures overstate what they reach inside a decode step (the engine-level
W3 is the measure that counts). Every case is checked against the torch reference first (2 ulps of the output
scale). --sweep times 8 tile shapes x 1-3 K splits per case and prints, per (shape class, M bucket), the
candidate with the least time summed over the class's layers (SMALL_M_TABLE) and each layer's fastest
(SMALL_M_SHAPES), as literals; --table-json writes both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
try:
    import triton
    import triton.testing
except ImportError:  # a CPU-only install: the engine runs plain torch there, and there is no kernel to time
    sys.exit(f"{sys.argv[0]}: times Triton kernels on a CUDA GPU and needs Triton (a CUDA build of torch installs "
             "it: pip install torch)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench_quant_linear beside it

from bench_quant_linear import copy_gb_s  # noqa: E402  (a same-size device copy: the bandwidth yardstick)

from hayabusa.kernels.fp8_gemv import fp8_launch, fp8_m_bucket  # noqa: E402
from hayabusa.kernels.quant_linear import LaunchConfig, gemm_shape_class  # noqa: E402
from hayabusa.kernels.activation import silu_and_mul  # noqa: E402
from hayabusa.kernels.small_m_linear import (  # noqa: E402
    pick_small_m_config, small_m_linear, small_m_linear_ref, small_m_silu_config, small_m_silu_linear,
)

SHAPES = {
    "7b": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584),
           "lm_head": (3584, 152064)},
    "05b": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
            "lm_head": (896, 151936)},
}
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the 16-row tl.dot tiles: the FP8 XQ sweep's shapes (2026-12-03) at
# equal bytes per stage (bf16 is two bytes a weight) and their neighbours
TILES = ((32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (32, 128, 4, 4), (64, 64, 8, 4),
         (128, 64, 8, 3), (64, 128, 8, 3))
SPLITS = (1, 2, 4, 8, 16)


def sweep_configs(M: int, N: int, K: int, sms: int) -> list[LaunchConfig]:
    """The candidates of one case: every TILES entry with the K splits (of SPLITS) that put 1-12 programs per SM
    (fewer leave SMs idle, more only add partials), or the one nearest 4 per SM."""
    cands = []
    for bn, bk, warps, stages in TILES:
        tiles = triton.cdiv(M, 16) * triton.cdiv(N, bn)
        splits = [sp for sp in SPLITS if sms <= tiles * sp <= 12 * sms and sp <= triton.cdiv(K, bk)]
        for sp in splits or [min(SPLITS, key=lambda sp: abs(tiles * sp - 4 * sms))]:
            cands.append(fp8_launch(("dot", 16, bn, bk, sp, warps, stages), M, N, K, torch.device("cuda")))
    return cands


def entry(cfg: LaunchConfig) -> tuple:
    return (cfg.kind, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, cfg.num_stages)


def _close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((y.float() - ref.float()).abs().max()) <= 2 * 2.0 ** -7 * float(ref.float().abs().max())


def case(shape: str, layer: str, M: int, sweep: bool) -> dict:
    K, N = SHAPES[shape][layer]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ref = small_m_linear_ref(x, w)
    if not _close(small_m_linear(x, w), ref):
        raise AssertionError(f"{shape} {layer} M={M}: small_m_linear differs from its reference")
    nbytes = N * K * 2 + M * K * 2 + M * N * 2
    row = dict(shape=shape, layer=layer, K=K, N=N, M=M, copy_gb_s=copy_gb_s(N * K * 2), bytes=nbytes,
               config=entry(pick_small_m_config(M, N, K, x.device)))
    for name, fn in (("cublas", lambda: F.linear(x, w)), ("small_m", lambda: small_m_linear(x, w))):
        row[name + "_us"] = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    if layer == "gate_up" and small_m_silu_config(M, N // 2, K, x.device) is not None:
        # the MLP's gate_up + SiLU-and-mul: two launches against the fused one (none where a loaded table's
        # gate_up launch splits K: the engine then runs the two launches too)
        if not torch.equal(small_m_silu_linear(x, w), silu_and_mul(small_m_linear(x, w))):
            raise AssertionError(f"{shape} gate_up M={M}: the fused SiLU launch differs from the two launches")
        for name, fn in (("silu_two", lambda: silu_and_mul(small_m_linear(x, w))),
                         ("silu_fused", lambda: small_m_silu_linear(x, w))):
            row[name + "_us"] = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    if sweep:
        times = {}
        for cfg in sweep_configs(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count):
            try:
                if not _close(small_m_linear(x, w, cfg=cfg), ref):
                    raise AssertionError("differs from the reference")
                ms = triton.testing.do_bench_cudagraph(lambda: small_m_linear(x, w, cfg=cfg), rep=10,
                                                       return_mode="median")
            except Exception as e:  # noqa: BLE001 - out of shared memory / registers: not a candidate here
                print(f"# {shape} {layer} M={M} {entry(cfg)}: {type(e).__name__}: {e}", flush=True)
                continue
            times[repr(entry(cfg))] = ms * 1e3
        row["sweep_us"] = times
    print(f"# {shape} {layer} M={M} done", flush=True)
    return row


def pct(row: dict, us: float) -> float:
    return 100 * row["bytes"] / us * 1e-3 / row["copy_gb_s"]


def class_cost(rows: list[dict], cand: str) -> float:
    """us of one launch candidate summed over a shape class's swept rows. The candidates differ by row (the K splits
    that suit each layer's tile count), so a row that did not time ``cand`` is charged its slowest candidate: the
    choice may fall on a launch only some layers timed, but never because the others were left out (the session-19
    table took the few launches every layer shared, 20 % slower on the 7b qkv / o than the best)."""
    return sum(r["sweep_us"].get(cand, max(r["sweep_us"].values())) for r in rows)


def print_table(rows: list[dict], table_json: str | None) -> None:
    print(f"{'shape':<5} {'layer':<8} {'K':>6} {'N':>7} {'M':>3} {'cuBLAS us':>9} {'%copy':>6} {'small_m us':>10} "
          f"{'%copy':>6} {'vs cuBLAS':>9}  launch [| best]")
    for r in rows:
        best = ""
        if r.get("sweep_us"):
            b = min(r["sweep_us"], key=r["sweep_us"].get)
            best = f" | best {b}: {r['sweep_us'][b]:.1f} us {pct(r, r['sweep_us'][b]):.0f}%"
        print(f"{r['shape']:<5} {r['layer']:<8} {r['K']:>6} {r['N']:>7} {r['M']:>3} {r['cublas_us']:>9.1f} "
              f"{pct(r, r['cublas_us']):>5.0f}% {r['small_m_us']:>10.1f} {pct(r, r['small_m_us']):>5.0f}% "
              f"{r['cublas_us'] / r['small_m_us']:>9.2f}  {r['config']}{best}")
    for r in rows:
        if "silu_fused_us" in r:
            print(f"# {r['shape']} gate_up + SiLU-and-mul M={r['M']}: two launches {r['silu_two_us']:.1f} us, fused "
                  f"{r['silu_fused_us']:.1f} us (x{r['silu_two_us'] / r['silu_fused_us']:.2f})")
    print("# CUDA-graph replay medians; 'vs cuBLAS' = cuBLAS time / small_m time (> 1: the kernel is faster); "
          "%copy = (weight + x + out bytes) per second over a same-size weight copy's: "
          + ", ".join(f"{n / 1e6:.0f} MB {g:.0f} GB/s" for n, g in sorted({(r["N"] * r["K"] * 2, r["copy_gb_s"])
                                                                             for r in rows})))
    swept = [r for r in rows if r.get("sweep_us")]
    if not swept:
        return
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in swept:
        groups.setdefault((gemm_shape_class(r["N"], r["K"]), fp8_m_bucket(r["M"])), []).append(r)
    table = {}
    print("# per (shape class, M bucket): the candidate with the least time summed over the class's layers (a layer "
          "whose sweep did not try it counts its own slowest candidate)")
    for key, rs in sorted(groups.items()):
        best = min(set().union(*(r["sweep_us"] for r in rs)), key=lambda e: (class_cost(rs, e), e))
        table[key] = best
        now, new = sum(r["small_m_us"] for r in rs), class_cost(rs, best)
        print(f"#   {key}: {best}  {new:.1f} us (default {now:.1f} us, x{now / new:.2f}; cuBLAS "
              f"{sum(r['cublas_us'] for r in rs):.1f} us)  " + ", ".join(f"{r['shape']} {r['layer']} M={r['M']}"
                                                                         for r in rs))
    print("SMALL_M_TABLE: dict[tuple[str, int], tuple[str, int, int, int, int, int, int]] = {")
    for key in sorted(table):
        print(f"    {key!r}: {table[key]},")
    print("}")
    print("SMALL_M_SHAPES: dict[tuple[int, int, int], tuple[str, int, int, int, int, int, int]] = {")
    layers: dict[tuple[int, int, int], list[dict]] = {}
    for r in swept:   # one layer shape's rows per M bucket (--m 2,4 gives bucket 4 two rows; two models may share one)
        layers.setdefault((r["N"], r["K"], fp8_m_bucket(r["M"])), []).append(r)
    shapes = {}
    for key, rs in layers.items():   # each timed layer's own fastest launch: class_cost's rule over its rows
        b = shapes[key] = min(set().union(*(r["sweep_us"] for r in rs)), key=lambda e: (class_cost(rs, e), e))
        print(f"    {key}: {b},  # " + ", ".join(f"{r['shape']} {r['layer']} M={r['M']}" for r in rs)
              + f": {class_cost(rs, b):.1f} us, cuBLAS {sum(r['cublas_us'] for r in rs):.1f}")
    print("}")
    if table_json:  # what HAYABUSA_SMALL_M_TABLE_JSON loads (kernels/fp8_gemv.load_launch_tables)
        import ast

        Path(table_json).write_text(json.dumps({
            "SMALL_M_TABLE": [[c, b, list(ast.literal_eval(e))] for (c, b), e in sorted(table.items())],
            "SMALL_M_SHAPES": [[n, k, b, list(ast.literal_eval(e))] for (n, k, b), e in sorted(shapes.items())]}))
        print(f"# wrote {table_json}: HAYABUSA_SMALL_M_TABLE_JSON={table_json} runs the engine with these launches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="7b,05b", help="comma-separated subset of 7b,05b")
    parser.add_argument("--layers", default="qkv,o,gate_up,down,lm_head",
                        help="comma-separated subset of qkv,o,gate_up,down,lm_head")
    parser.add_argument("--m", default="1,4,16", help="comma-separated row counts (<= 16: the kernel's range)")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate launches")
    parser.add_argument("--table-json", default=None, help="--sweep: write the tuned SMALL_M_TABLE here")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="print the table (and --table-json) from the rows a --sweep --json run wrote; no GPU")
    args = parser.parse_args()
    if args.from_json:
        try:
            rows = json.loads(args.from_json.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"--from-json {args.from_json}: not a file written by --sweep --json ({type(e).__name__}: {e}); "
                     "pass the --json file of a --sweep run")
        print_table(rows, args.table_json)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_small_m_linear needs a CUDA GPU")
    rows = [case(s, layer, int(m), args.sweep) for s in args.shapes.split(",") for layer in args.layers.split(",")
            for m in args.m.split(",")]
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  bf16")
    print_table(rows, args.table_json)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
