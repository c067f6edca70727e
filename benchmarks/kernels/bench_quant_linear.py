"""Time the weight-only int8 / int4 linears against torch's bf16 F.linear on a CUDA GPU; print a table and JSON.

    python benchmarks/kernels/bench_quant_linear.py [--json FILE] [--m 1,8,64,256,2048] [--group-size 128]
                                                    [--sweep | --dequant | --w8a8 | --fp8 [--sweep] | --sweep-gemm
                                                     | --sweep-w8a8 [--budget-s 170] | --small-m [--budget-s 110]]
                                                    [--layers qkv,o,gate_up,down] [--merge A.json B.json ...]

Shapes are Qwen2.5-7B's linears, (K, N): qkv (3584, 4608), o (3584, 3584), gate_up (3584, 37888),
down (18944, 3584). GB/s counts the bytes a perfect kernel moves: the weights as stored (int4: packed nibbles plus
bf16 scales and zeros; int8: bytes plus bf16 scales; bf16: 2 bytes each), x read once and the output written once.
TFLOP/s = 2 M N K / time. 'vs bf16' = bf16 time / kernel time (> 1: faster). Times are CUDA-graph replays (how the
engine runs decode; this also checks that the launch captures), 'eager us' adds the Python launch cost.
--sweep also times a grid of launch configs per case and prints the best next to pick_config's choice (the input
for retuning pick_config); it compiles and times hundreds of launches, so split it with --layers / --m to stay
under a 10-minute run. Every case is checked against the torch reference first. Needs CUDA.
--dequant instead compares, per layer, M (default 16,64,128,256,512,2048,8192) and scheme, the two CUDA paths of
the linears: the fused Triton kernel (pick_config's launch) and dequantize-to-bf16 + F.linear (cuBLAS; also the
dequantization alone), with bf16 F.linear as the yardstick, eager times (prefill does not run in CUDA graphs), and
prints per layer and scheme the smallest M from which dequant + cuBLAS wins: the input for DEQUANT_GEMM_MIN_M.
'vs bf16' columns are bf16 time / path time (> 1: faster than bf16). About two minutes on an H200.
--w8a8 instead times the W8A8 linears per layer and M (default 1,16,64,256,1024,8192), eager medians (CUDA-graph
replays for M <= 64, how decode runs): bf16 F.linear (cuBLAS); INT8 W8A8 as the engine runs it (activation
quantization + int8_scaled_mm's dispatch) and its two GEMM paths on pre-quantized inputs (the Triton int8 kernel;
torch._int_mm + the Triton epilogue, where its shape rules allow); the int8 activation quantizer alone; FP8 W8A8
(per_token_quant_fp8 + torch._scaled_mm, sm89+). It prints per layer the smallest M from which _int_mm wins: the
input for INT_MM_MIN_M (kernels/int8_gemm.py). About a minute on an H200.
--fp8 instead times, per layer and M (default 1,4,16,64), CUDA-graph replays of: bf16 F.linear (cuBLAS); FP8 W8A8
as it ran before kernels/fp8_gemv.py (per_token_quant_fp8 + torch._scaled_mm, two launches); fp8_small_m_linear
(the quantization fused in, FP8_TABLE's launch; the engine uses it up to FP8_SMALL_M_MAX rows); and 'xq', the same
kernel on x already quantized (its XQ launch, FP8Q_TABLE's: what the engine runs when the norm / SiLU-and-mul
before the linear quantizes its output, kernels/fused_act_quant.py). GB/s counts the
FP8 weights (1 byte each) + their fp32 scales + x read once + the output written once; '%copy' is that over a
device-to-device copy of the same weight bytes measured in the same run (read + write counted). With --sweep it
first compiles every candidate in --jobs processes (8; Triton's disk cache is shared), then times 10-28
candidates per case (fp8_sweep_configs: GEMV tiles up to 4 rows, 16-row dot tiles, K splits for 1-12 programs
per SM), prints the best next to the current default, per (shape class, M bucket) the candidate with the least
time over the class's layers, and the FP8_TABLE and FP8Q_TABLE literals to paste into hayabusa/kernels/fp8_gemv.py
(both launches are swept; --table-json FILE also writes them where HAYABUSA_FP8_TABLE_JSON=FILE loads them into an
engine without editing the code). `--fp8 --sweep --m 1,4,16` took about 45 s on an H200 with one launch swept.
--sweep-gemm instead searches the swapped-operand GEMM (gemm_t) per layer, M (default 16,32,64,128,256) and scheme
(int8; int4 at --group-size): up to 24 tile / warp / stage candidates each (gemm_t_candidates), CUDA-graph
medians next to bf16 F.linear, dequantize + F.linear and the current GEMM_T_TABLE launch. It prints, per (scheme,
shape class, M bucket), the candidate with the least time summed over the class's layers, the smallest M from
which dequantize + cuBLAS wins (for DEQUANT_GEMM_MIN_M / _INT4) and the GEMM_T_TABLE literal to paste into
hayabusa/kernels/quant_linear.py. About 180 compiles over all layers: run it per layer (or per --m) with --json
(written after every case), then print the tables of all runs together with --merge a.json b.json ... (no GPU).
--sweep-w8a8 instead searches the INT8 W8A8 GEMM's tiles (kernels/int8_gemm.py, INT8_GEMM_TABLE) per layer and M
(default 16,32,64,128,256): 5-17 candidates each (w8a8_candidates: the two row tiles nearest M, N tiles 64-256, K
tiles 128 / 256, two warp / stage pairs, K split as the table resolves SPLIT_K 0), all compiled first in --jobs
processes, then CUDA-graph medians of each next to bf16 F.linear and the current table's launch (the GEMM alone,
on pre-quantized int8 operands; every candidate's output must equal the table launch's bit for bit: the int32 sum
is exact). It prints per (shape class, M) the candidate with the least time summed over the class's layers and
the INT8_GEMM_TABLE literal to paste into hayabusa/kernels/int8_gemm.py. --budget-s (default 170) stops starting
new cases after that many seconds, so a full run stays under 3 minutes on an H200 (the JSON and the tables keep
what was measured); --merge prints the tables of several runs' --json files together.
--small-m instead times kernels/wo_small_m.py (the weight-only int4 / int8 linear on small_m_linear's 16-row tl.dot
tile loop) per M (default 1,4,8,16,32,64), layer and scheme (int4 at --group-size, int8), CUDA-graph medians in us:
bf16 F.linear; today's quant_linear path at that M (_kernel_linear with USE_WO_SMALL_M off: GEMV to 4 rows, then
the tl.dot GEMM, dequantize + cuBLAS from DEQUANT_GEMM_MIN_M*); WO_SMALL_M_TABLE's launch; and 8-13 candidate launches
(small_m_candidates: BLOCK_N 32-256, SPLIT_K 1 / auto, 4 / 8 warps, 3 / 4 stages, the slab and the join / dot tile
builds, int4's inline-PTX kinds lop3 / lop3j; the row tile is M's bucket 16-256, at most 128; --m 32,64,128,256
--schemes int4 times the lop3j launches that HAYABUSA_WO_MID_M would run), each checked against the reference
first (2 ulps of the output scale),
all compiled first in --jobs processes. '%copy' = the quantized weight bytes (int4: nibbles + bf16 scales and zeros;
int8: bytes + scales) per second over a device copy of that many bytes (read + write counted); the 7b qkv / o
int4 weights (8-9 MB) stay in L2 between replays, so their figures overstate a decode step's. It prints per (scheme,
shape class, M bucket) the candidate with the least summed time as a WO_SMALL_M_TABLE literal. --budget-s
(default 110 here) stops starting cases after that many seconds from the start (precompile included; M outer, so a
cut run keeps whole row counts); about 150 s at most on an H200 (not yet run there).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
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

from hayabusa.kernels.quant_linear import (  # noqa: E402
    DEQUANT_GEMM_MIN_M, DEQUANT_GEMM_MIN_M_INT4, GEMM_M_BUCKETS, GEMM_T_TABLE, LaunchConfig, _dequantize, _launch,
    gemm_shape_class, gemm_t_launch, int4_weight_only_linear_ref, int8_weight_only_linear_ref, pick_config,
    quantize_int4_grouped, quantize_int8_per_channel,
)

LAYERS = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}


def time_ms(fn) -> tuple[float, float]:
    """(CUDA-graph replay ms, eager ms), medians."""
    graph = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return graph, eager


def sweep_configs(M: int, G: int | None) -> list[LaunchConfig]:
    """Candidate launches for --sweep (about 40-200 per case): GEMV shapes and K splits for M <= 16, tl.dot tiles
    at the two row-tile sizes nearest M (with K splits up to M = 256)."""
    cands = []
    if M <= 16:
        for bn in (64, 128, 256, 512, 1024):
            for bk in ((32, 64, 128) if G is not None else (64, 128, 256)):
                if G is not None and G % bk:
                    continue
                for warps in (4, 8):
                    if bn * bk // (32 * warps) > 512:  # weight elements per thread: keep registers sane
                        continue
                    for split in (1, 4, 16, 32):
                        cands.append(LaunchConfig("gemv", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                                                  num_stages=1))
    bms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, triton.next_power_of_2(M))][-2:]
    for bm in bms:
        for bn in (64, 128, 256):
            for bk in (32, 64, 128):
                if G is not None and G % bk:
                    continue
                for split in (1, 2, 4, 8) if M <= 256 else (1,):
                    for warps, stages in ((4, 3), (8, 3)):
                        cands.append(LaunchConfig("gemm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                                                  num_warps=warps, num_stages=stages))
    return cands


def best_of(fn_for_cfg, cands: list[LaunchConfig]) -> tuple[LaunchConfig | None, float]:
    best, best_ms = None, float("inf")
    for cfg in cands:
        try:
            ms = triton.testing.do_bench_cudagraph(lambda: fn_for_cfg(cfg), rep=20, return_mode="median")
        except Exception:  # noqa: BLE001 - out of shared memory / registers: not a candidate on this GPU
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms


def layer_inputs(layer: str, M: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(K, N, x [M, K], w [N, K]) of one 7b layer: bf16 on CUDA from seed 0 (w scaled by 0.02), as every mode uses."""
    K, N = LAYERS[layer]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return K, N, x, w


def bench_case(layer: str, M: int, G: int, sweep: bool) -> list[dict]:
    K, N, x, w = layer_inputs(layer, M)
    q8, s8 = quantize_int8_per_channel(w)
    q4, s4, z4 = quantize_int4_grouped(w, G)
    io = (M * K + M * N) * 2
    schemes = {
        "bf16 F.linear": (lambda cfg=None: F.linear(x, w), N * K * 2 + io, None),
        "int8 W8A16": (lambda cfg=None: _launch(x, q8, s8, None, None, N, None, cfg), N * K + N * 2 + io, None),
        f"int4 W4A16 g{G}": (lambda cfg=None: _launch(x, q4, s4, z4, None, N, G, cfg),
                             N * K // 2 + 2 * (K // G) * N * 2 + io, G),
    }
    torch.testing.assert_close(schemes["int8 W8A16"][0](), int8_weight_only_linear_ref(x, q8, s8), atol=0.05, rtol=0.02)
    torch.testing.assert_close(schemes[f"int4 W4A16 g{G}"][0](), int4_weight_only_linear_ref(x, q4, s4, z4, G),
                               atol=0.05, rtol=0.02)
    rows = []
    for name, (fn, nbytes, group) in schemes.items():
        ms, eager_ms = time_ms(fn)
        row = dict(layer=layer, K=K, N=N, M=M, scheme=name, ms=ms, eager_ms=eager_ms, gb_s=nbytes / ms / 1e6,
                   tflop_s=2 * M * N * K / ms / 1e9)
        if not name.startswith("bf16"):
            cfg = pick_config(M, N, K, group, x.device)
            row["config"] = cfg.__dict__
            if sweep:
                best, best_ms = best_of(fn, sweep_configs(M, group))
                row.update(sweep_best=best.__dict__ if best else None, sweep_best_ms=best_ms)
        rows.append(row)
    base = rows[0]["ms"]
    for r in rows:
        r["vs_bf16"] = base / r["ms"]
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'layer':<8} {'K':>6} {'N':>6} {'M':>5} {'scheme':<16} {'graph us':>9} {'eager us':>9} {'GB/s':>8} "
          f"{'TFLOP/s':>8} {'vs bf16':>8}  config")
    for r in rows:
        cfg = r.get("config")
        desc = "" if cfg is None else (f"{cfg['kind']} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} "
                                       f"split {cfg['SPLIT_K']} w{cfg['num_warps']} s{cfg['num_stages']}")
        if r.get("sweep_best"):
            b = r["sweep_best"]
            desc += (f" | best {b['kind']} {b['BLOCK_M']}x{b['BLOCK_N']}x{b['BLOCK_K']} split {b['SPLIT_K']} "
                     f"w{b['num_warps']} s{b['num_stages']}: {r['sweep_best_ms'] * 1e3:.1f} us")
        print(f"{r['layer']:<8} {r['K']:>6} {r['N']:>6} {r['M']:>5} {r['scheme']:<16} {r['ms'] * 1e3:>9.1f} "
              f"{r['eager_ms'] * 1e3:>9.1f} {r['gb_s']:>8.1f} {r['tflop_s']:>8.2f} {r['vs_bf16']:>8.2f}  {desc}")


def dequant_case(layer: str, M: int, G: int) -> list[dict]:
    """One row per scheme (int8, int4): eager median us of the Triton path, dequantize + F.linear, the
    dequantization alone and bf16 F.linear, on the same x and weights."""
    K, N, x, w = layer_inputs(layer, M)
    bf16_ms = triton.testing.do_bench(lambda: F.linear(x, w), warmup=25, rep=100, return_mode="median")
    q8, s8 = quantize_int8_per_channel(w)
    q4, s4, z4 = quantize_int4_grouped(w, G)
    schemes = {"int8": ((q8, s8, None, None), N, int8_weight_only_linear_ref(x, q8, s8)),
               f"int4 g{G}": ((q4, s4, z4, G), N, int4_weight_only_linear_ref(x, q4, s4, z4, G))}
    rows = []
    for name, ((qw, sc, zr, group), n, ref) in schemes.items():
        fused = lambda: _launch(x, qw, sc, zr, None, n, group, None)  # noqa: E731
        dequant = lambda: _dequantize(qw, sc, zr, group, x.dtype)  # noqa: E731
        dq_gemm = lambda: F.linear(x, dequant())  # noqa: E731
        for fn in (fused, dq_gemm):
            torch.testing.assert_close(fn(), ref, atol=0.05, rtol=0.02)
        t = {key: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
             for key, fn in (("triton_ms", fused), ("dq_gemm_ms", dq_gemm), ("dequant_ms", dequant))}
        rows.append(dict(layer=layer, K=K, N=N, M=M, scheme=name, bf16_ms=bf16_ms, **t,
                         config=pick_config(M, N, K, group, x.device).__dict__))
    return rows


def print_dequant_table(rows: list[dict]) -> None:
    print(f"{'layer':<8} {'K':>6} {'N':>6} {'M':>5} {'scheme':<10} {'triton us':>10} {'dq+cuBLAS':>10} "
          f"{'dequant':>8} {'bf16 us':>8} {'tri vs bf16':>11} {'dq vs bf16':>10}  faster")
    for r in rows:
        us = {k: r[k] * 1e3 for k in ("triton_ms", "dq_gemm_ms", "dequant_ms", "bf16_ms")}
        faster = "dq+cuBLAS" if r["dq_gemm_ms"] < r["triton_ms"] else "triton"
        print(f"{r['layer']:<8} {r['K']:>6} {r['N']:>6} {r['M']:>5} {r['scheme']:<10} {us['triton_ms']:>10.1f} "
              f"{us['dq_gemm_ms']:>10.1f} {us['dequant_ms']:>8.1f} {us['bf16_ms']:>8.1f} "
              f"{r['bf16_ms'] / r['triton_ms']:>11.2f} {r['bf16_ms'] / r['dq_gemm_ms']:>10.2f}  {faster}")
    print(f"# smallest M from which dequant + cuBLAS is faster at every larger measured M "
          f"(DEQUANT_GEMM_MIN_M = {DEQUANT_GEMM_MIN_M}):")
    for key in dict.fromkeys((r["layer"], r["scheme"]) for r in rows):
        ms = sorted((r["M"], r["dq_gemm_ms"] < r["triton_ms"]) for r in rows if (r["layer"], r["scheme"]) == key)
        wins = [m for i, (m, _) in enumerate(ms) if all(win for _, win in ms[i:])]
        print(f"#   {key[0]:<8} {key[1]:<10} {wins[0] if wins else f'never (up to M = {ms[-1][0]})'}")


def w8a8_case(layer: str, M: int) -> dict:
    """One row: us of bf16 F.linear, INT8 W8A8 (engine path, Triton GEMM, _int_mm + epilogue, quantizer) and FP8."""
    from hayabusa.kernels import int8_gemm
    from hayabusa.kernels.int8_quant import per_token_quant_int8, per_token_quant_int8_ref

    K, N, x, w = layer_inputs(layer, M)
    wq, sw = per_token_quant_int8_ref(w)
    sw = sw.view(-1).contiguous()
    xq, sx = per_token_quant_int8(x)
    ref = int8_gemm.int8_scaled_mm_ref(xq, sx, wq, sw, None, torch.bfloat16)
    fns = {
        "bf16": lambda: F.linear(x, w),
        "w8a8": lambda: int8_gemm.int8_scaled_mm(*per_token_quant_int8(x), wq, sw, None, torch.bfloat16),
        "triton": lambda: int8_gemm.int8_gemm_triton(xq, sx, wq, sw, None, torch.bfloat16),
        "quant": lambda: per_token_quant_int8(x),
    }
    if int8_gemm.int_mm_usable(M, N, K):
        fns["int_mm"] = lambda: int8_gemm.int8_gemm_int_mm(xq, sx, wq, sw, None, torch.bfloat16)
    if torch.cuda.get_device_capability() >= (8, 9):
        from hayabusa.kernels.fp8_quant import per_token_quant_fp8
        from hayabusa.quantization.fp8 import fp8_matmul_cuda, quantize_fp8_rows

        wf, swf = quantize_fp8_rows(w)
        swf = swf.view(1, -1).contiguous()
        fns["fp8"] = lambda: fp8_matmul_cuda(*per_token_quant_fp8(x), wf.t(), swf, torch.bfloat16)
    for name in ("w8a8", "triton", "int_mm"):
        if name in fns:
            torch.testing.assert_close(fns[name](), ref, atol=0, rtol=1e-2)
    row = dict(layer=layer, K=K, N=N, M=M, timing="graph" if M <= 64 else "eager",
               triton_config=int8_gemm.pick_int8_config(M, N, K, x.device).__dict__,
               dispatch="int_mm" if int8_gemm.INT_MM_MIN_M is not None and M >= int8_gemm.INT_MM_MIN_M
                        and "int_mm" in fns else "triton")
    for name, fn in fns.items():
        if M <= 64:
            ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        else:
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        row[f"{name}_us"] = ms * 1e3
    return row


def print_w8a8_table(rows: list[dict]) -> None:
    from hayabusa.kernels.int8_gemm import INT_MM_MIN_M

    cols = ("bf16", "w8a8", "triton", "int_mm", "quant", "fp8")
    print(f"{'layer':<8} {'K':>6} {'N':>6} {'M':>5} {'timing':>6} " + " ".join(f"{c + ' us':>10}" for c in cols)
          + f" {'w8a8/bf16':>9} {'tri/bf16':>8} {'imm/bf16':>8} {'fp8/bf16':>8}  dispatch")
    for r in rows:
        us = [f"{r[c + '_us']:>10.1f}" if c + "_us" in r else f"{'-':>10}" for c in cols]
        speed = [f"{r['bf16_us'] / r[c + '_us']:>8.2f}" if c + "_us" in r else f"{'-':>8}"
                 for c in ("triton", "int_mm", "fp8")]
        print(f"{r['layer']:<8} {r['K']:>6} {r['N']:>6} {r['M']:>5} {r['timing']:>6} " + " ".join(us)
              + f" {r['bf16_us'] / r['w8a8_us']:>9.2f} " + " ".join(speed) + f"  {r['dispatch']}")
    print(f"# 'x/bf16' = bf16 time / x time (> 1: faster). Smallest M from which _int_mm + epilogue beats the Triton "
          f"GEMM at every larger measured M (INT_MM_MIN_M = {INT_MM_MIN_M}):")
    for layer in dict.fromkeys(r["layer"] for r in rows):
        ms = sorted((r["M"], "int_mm_us" in r and r["int_mm_us"] < r["triton_us"]) for r in rows
                    if r["layer"] == layer)
        wins = [m for i, (m, _) in enumerate(ms) if all(win for _, win in ms[i:])]
        print(f"#   {layer:<8} {wins[0] if wins else f'never (up to M = {ms[-1][0]})'}")




FP8_SPLITS = (1, 2, 4, 8, 16)


def fp8_sweep_configs(M: int, N: int, K: int, sms: int) -> list[LaunchConfig]:
    """--fp8 --sweep candidates, 20-30 per case, the same for every layer of a shape class (so the table can keep
    the one with the least time over the class). Pruned by what a bandwidth-bound small-M kernel needs:
      * GEMV (M <= 4, all rows in one program): 16-byte vectors, 64-128 weight bytes per thread per step (4-8 loads
        in flight: less starves HBM, more spills) in 8-32 KB tiles; 4 or 8 warps; num_stages 1 (the loads of one
        step are independent, and Triton 3.6 does not pipeline loads that feed no tl.dot);
      * dot (M = 16, and a few at M = 1 and 4): 16-row tiles, 32-128 wide, BLOCK_K 128-256, 3-4 stages (cp.async);
      * K splits from FP8_SPLITS that put 1-12 programs per SM (fewer leave SMs idle, more only add partials)."""
    from hayabusa.kernels.fp8_gemv import fp8_launch

    shapes = []
    if M <= 4:
        shapes += [("gemv", min(4, triton.next_power_of_2(M)), bn, bk, w, 1) for bn, bk, w in
                   ((16, 512, 4), (32, 256, 4), (32, 512, 4), (16, 1024, 4), (32, 512, 8), (64, 256, 8),
                    (64, 512, 8), (32, 1024, 8))]
    dots = ((32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (32, 256, 4, 4),
            (64, 128, 8, 4), (128, 128, 8, 3), (64, 256, 8, 3))
    # one row too: the 16-row tl.dot tile on x quantized by its producer streamed the weights at 72-95 % of a copy
    # from 4 rows up (2026-12-03), above the GEMV's 60-76 % at one row
    shapes += [("dot", 16, bn, bk, w, st) for bn, bk, w, st in (dots if M > 4 else dots[:3])]
    cands = []
    for kind, bm, bn, bk, warps, stages in shapes:
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        splits = [sp for sp in FP8_SPLITS if sms <= tiles * sp <= 12 * sms and sp <= triton.cdiv(K, bk)]
        for sp in splits or [min(FP8_SPLITS, key=lambda sp: abs(tiles * sp - 4 * sms))]:
            cands.append(fp8_launch((kind, bm, bn, bk, sp, warps, stages), M, N, K, torch.device("cuda")))
    return cands


def _fp8_entry(cfg: LaunchConfig) -> tuple:
    return (cfg.kind, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, cfg.num_stages)


def _fp8_compile(job: tuple[str, int, list[tuple]]) -> int:
    """A worker process of --fp8 --sweep: compile (and run once) the launches of one case, filling Triton's disk
    cache, so the timing process finds every kernel built. Returns how many failed (not candidates on this GPU)."""
    from hayabusa.kernels.fp8_gemv import fp8_small_m_linear
    from hayabusa.quantization.fp8 import quantize_fp8_rows

    layer, M, entries = job
    K, N, x, w = layer_inputs(layer, M)
    wf, swf = quantize_fp8_rows(w)
    xq, sx = quantize_fp8_rows(x)
    failed = 0
    for e in entries:
        cfg = LaunchConfig(e[0], BLOCK_M=e[1], BLOCK_N=e[2], BLOCK_K=e[3], SPLIT_K=e[4], num_warps=e[5],
                           num_stages=e[6])
        for args in ((x,), (xq,)):  # the kernel quantizing x, and its XQ launch (x quantized by the producer)
            try:
                fp8_small_m_linear(*args, wf, swf.view(-1).contiguous(), cfg=cfg,
                                   x_scale=sx if args[0] is xq else None)
            except Exception:  # noqa: BLE001 - out of registers / shared memory: timed as not a candidate later
                failed += 1
    torch.cuda.synchronize()
    return failed


def fp8_precompile(cases: list[tuple[str, int]], jobs: int) -> None:
    """Compile every --fp8 --sweep candidate of every case in `jobs` processes (Triton compiles one kernel at a
    time per process; the cache on disk is shared), before the timing starts."""
    import concurrent.futures
    import multiprocessing

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    work = []
    for layer, M in cases:
        K, N = LAYERS[layer]
        entries = [_fp8_entry(c) for c in fp8_sweep_configs(M, N, K, sms)]
        work += [(layer, M, entries[i::3]) for i in range(3)]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(pool.map(_fp8_compile, work))
    print(f"# precompiled {sum(len(w[2]) for w in work)} launches in {jobs} processes ({failed} failed)",
          flush=True)


_COPY_GB_S: dict[int, float] = {}


def copy_gb_s(nbytes: int) -> float:
    """A device-to-device copy of nbytes (read + write counted), CUDA-graph median: the bandwidth yardstick."""
    if nbytes not in _COPY_GB_S:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=20, return_mode="median")
        _COPY_GB_S[nbytes] = 2 * nbytes / ms / 1e6
    return _COPY_GB_S[nbytes]


def fp8_case(layer: str, M: int, sweep: bool) -> dict:
    """One row: CUDA-graph us of bf16 F.linear, per_token_quant_fp8 + _scaled_mm, fp8_small_m_linear (+ sweep:
    every candidate's us, keyed by its FP8_TABLE entry)."""
    from hayabusa.kernels.fp8_gemv import fp8_small_m_linear, fp8_small_m_linear_ref, pick_fp8_config
    from hayabusa.kernels.fp8_quant import per_token_quant_fp8
    from hayabusa.quantization.fp8 import fp8_matmul_cuda, quantize_fp8_rows

    K, N, x, w = layer_inputs(layer, M)
    wf, swf = quantize_fp8_rows(w)
    swf = swf.view(-1).contiguous()
    ref = fp8_small_m_linear_ref(x, wf, swf)
    xq, sx = per_token_quant_fp8(x)
    fused = lambda cfg=None: fp8_small_m_linear(x, wf, swf, cfg=cfg)  # noqa: E731
    pre = lambda cfg=None: fp8_small_m_linear(xq, wf, swf, cfg=cfg, x_scale=sx)  # noqa: E731
    torch.testing.assert_close(fused(), ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(pre(), ref, atol=0.05, rtol=0.02)
    fns = {"bf16": lambda: F.linear(x, w),
           "scaled_mm": lambda: fp8_matmul_cuda(*per_token_quant_fp8(x), wf.t(), swf.view(1, -1), torch.bfloat16),
           "fused": fused, "xq": pre}
    io = M * K * 2 + M * N * 2
    nbytes = {"bf16": N * K * 2 + io, "scaled_mm": N * K + N * 4 + io, "fused": N * K + N * 4 + io,
              "xq": N * K + N * 4 + M * K + M * N * 2}
    row = dict(layer=layer, K=K, N=N, M=M, config=pick_fp8_config(M, N, K, x.device).__dict__,
               copy_gb_s=copy_gb_s(N * K), fused_bytes=nbytes["fused"])
    for name, fn in fns.items():
        ms = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
        row[name + "_us"] = ms * 1e3
        row[name + "_gb_s"] = nbytes[name] / ms / 1e6
    if sweep:
        for key, fn in (("", fused), ("xq_", pre)):
            times = {}
            for cfg in fp8_sweep_configs(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count):
                try:
                    y = fn(cfg)
                    torch.testing.assert_close(y, ref, atol=0.05, rtol=0.02)
                    ms = triton.testing.do_bench_cudagraph(lambda: fn(cfg), rep=10, return_mode="median")
                except Exception as e:  # noqa: BLE001 - out of shared memory / registers: not a candidate here
                    print(f"# {layer} M={M} {key}{_fp8_entry(cfg)}: {type(e).__name__}", flush=True)
                    continue
                times[repr(_fp8_entry(cfg))] = ms * 1e3
            best = min(times, key=times.get) if times else None
            nb = nbytes["xq" if key else "fused"]
            row.update({f"{key}sweep_us": times, f"{key}sweep_best": best,
                        f"{key}sweep_best_us": times.get(best, float("nan")),
                        f"{key}sweep_best_gb_s": nb / times[best] * 1e3 / 1e6 if best else float("nan")})
    print(f"# {layer} M={M} done", flush=True)
    return row


def print_fp8_table(rows: list[dict], table_json: str | None = None) -> None:
    print(f"{'layer':<8} {'K':>6} {'N':>6} {'M':>4} {'bf16 us':>8} {'q+smm us':>9} {'fused us':>9} {'GB/s':>6} "
          f"{'%copy':>6} {'vs bf16':>7} {'vs smm':>7} {'xq us':>7} {'%copy':>6}  config [| best us GB/s %copy]")
    for r in rows:
        c = r["config"]
        desc = (f"{c['kind']} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} split {c['SPLIT_K']} w{c['num_warps']} "
                f"s{c['num_stages']}")
        for key in ("", "xq_"):
            if r.get(f"{key}sweep_best"):
                desc += (f" | {key}best {r[f'{key}sweep_best']}: {r[f'{key}sweep_best_us']:.1f} us "
                         f"{r[f'{key}sweep_best_gb_s']:.0f} {100 * r[f'{key}sweep_best_gb_s'] / r['copy_gb_s']:.0f}%")
        print(f"{r['layer']:<8} {r['K']:>6} {r['N']:>6} {r['M']:>4} {r['bf16_us']:>8.1f} {r['scaled_mm_us']:>9.1f} "
              f"{r['fused_us']:>9.1f} {r['fused_gb_s']:>6.0f} {100 * r['fused_gb_s'] / r['copy_gb_s']:>5.0f}% "
              f"{r['bf16_us'] / r['fused_us']:>7.2f} {r['scaled_mm_us'] / r['fused_us']:>7.2f} {r['xq_us']:>7.1f} "
              f"{100 * r['xq_gb_s'] / r['copy_gb_s']:>5.0f}%  {desc}")
    copies = sorted({(r["N"] * r["K"], r["copy_gb_s"]) for r in rows})
    print("# CUDA-graph replay medians; 'q+smm' = per_token_quant_fp8 + torch._scaled_mm (the path above "
          "FP8_SMALL_M_MAX); 'vs x' = x time / fused time (> 1: the fused kernel is faster); GB/s of the fused "
          "kernel counts weights + scales + x + out once; '%copy' = that over a device-to-device copy of the same "
          "weight bytes measured in this run (read + write): "
          + ", ".join(f"{n / 1e6:.0f} MB {g:.0f} GB/s" for n, g in copies))
    if not any(r.get("sweep_us") for r in rows):
        return
    from hayabusa.kernels.fp8_gemv import fp8_m_bucket
    from hayabusa.kernels.quant_linear import gemm_shape_class

    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((gemm_shape_class(r["N"], r["K"]), fp8_m_bucket(r["M"])), []).append(r)
    tables = {}
    for name, key, now_key in (("FP8_TABLE", "sweep_us", "fused_us"), ("FP8Q_TABLE", "xq_sweep_us", "xq_us")):
        table = tables[name] = {}
        print(f"# {name}, per (shape class, M bucket): the candidate with the least time summed over the class's "
              f"layers, against the current default ({name} as run)")
        for gkey, rs in sorted(groups.items()):
            common = set.intersection(*(set(r.get(key, {})) for r in rs))
            if not common:
                continue
            best = min(common, key=lambda e: sum(r[key][e] for r in rs))
            table[gkey] = best
            now = sum(r[now_key] for r in rs)
            new = sum(r[key][best] for r in rs)
            print(f"#   {gkey}: {best}  {new:.1f} us (default {now:.1f} us, x{now / new:.2f})  layers "
                  + ", ".join(f"{r['layer']} M={r['M']}" for r in rs))
        print(f"{name}: dict[tuple[str, int], tuple[str, int, int, int, int, int, int]] = {{")
        for gkey in sorted(table):
            print(f"    {gkey!r}: {table[gkey]},")
        print("}")
    if table_json:  # what HAYABUSA_FP8_TABLE_JSON loads (kernels/fp8_gemv.load_fp8_tables)
        import ast

        Path(table_json).write_text(json.dumps({name: [[c, b, list(ast.literal_eval(e))] for (c, b), e in
                                                       sorted(t.items())] for name, t in tables.items()}, indent=1))
        print(f"# wrote {table_json}: HAYABUSA_FP8_TABLE_JSON={table_json} runs the engine with these launches")


# ------------------------------------------------------------------------------------ --sweep-gemm (gemm_t tiles)
SWEEP_GEMM_M = (16, 32, 64, 128, 256)


def gemm_t_candidates(M: int, G: int | None) -> list[tuple[int, int, int, int, int, int]]:
    """GEMM_T_TABLE entries to try at M rows (at most 24): the two token tiles nearest M (>= 16), N tiles 128 / 256
    (the MMA's M side: 64 rows per warpgroup), K tiles 64 / 128 (int4: dividing G), three warp / stage pairs, K
    splits as pick_config resolves them (SPLIT_K 0); accumulators above 128 fp32 registers per thread left out.
    About 180 kernels compile over a full sweep (a second or two each): the first run on a machine pays for most."""
    bms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, M)][-2:]
    cands = []
    for bm in bms:
        for bn in (128, 256):
            for bk in (64, 128):
                if G is not None and G % bk:
                    continue
                for warps, stages in ((4, 3), (4, 5), (8, 3)):
                    if bm * bn // (32 * warps) <= 128:
                        cands.append((bm, bn, bk, 0, warps, stages))
    return cands


def sweep_gemm_case(layer: str, M: int, scheme: str, G: int) -> dict:
    """One (layer, M, scheme): CUDA-graph us of bf16 F.linear, dequantize + F.linear, the current table's launch
    and every candidate (the resolved launches deduplicated); the fastest candidate checked against the reference."""
    K, N, x, w = layer_inputs(layer, M)
    group = G if scheme == "int4" else None
    packed = quantize_int4_grouped(w, G) if group else (*quantize_int8_per_channel(w), None)
    ref = int4_weight_only_linear_ref(x, *packed, G) if group else int8_weight_only_linear_ref(x, *packed[:2])
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3  # noqa: E731
    row = dict(layer=layer, K=K, N=N, M=M, scheme=scheme, shape_class=gemm_shape_class(N, K),
               bf16_us=bench(lambda: F.linear(x, w)),
               dq_cublas_us=bench(lambda: F.linear(x, _dequantize(*packed, group, x.dtype))))
    table_cfg = pick_config(M, N, K, group, x.device)
    row.update(table_config=table_cfg.__dict__, table_us=bench(lambda: _launch(x, *packed, None, N, group, table_cfg)))
    seen, cands = set(), []
    for entry in gemm_t_candidates(M, group):
        cfg = gemm_t_launch(entry, M, N, K, group, x.device)
        if cfg in seen:
            continue
        seen.add(cfg)
        try:
            cands.append([list(entry), bench(lambda: _launch(x, *packed, None, N, group, cfg))])
        except Exception:  # noqa: BLE001 - out of shared memory / registers: not a candidate on this GPU
            continue
    best = min(cands, key=lambda c: c[1])
    torch.testing.assert_close(_launch(x, *packed, None, N, group, gemm_t_launch(tuple(best[0]), M, N, K, group,
                                                                                    x.device)),
                               ref, atol=0.05, rtol=0.02)
    row.update(candidates=cands, best_entry=best[0], best_us=best[1])
    print(f"# {layer} M={M} {scheme}: bf16 {row['bf16_us']:.1f} dq+cuBLAS {row['dq_cublas_us']:.1f} table "
          f"{row['table_us']:.1f} best {best[1]:.1f} us {tuple(best[0])}", flush=True)
    return row


def print_gemm_sweep(rows: list[dict]) -> None:
    """Per (scheme, shape class, M bucket): the entry with the least time summed over the class's swept layers,
    next to bf16 and dequantize + cuBLAS; then per (scheme, layer) the dequantize + cuBLAS crossover; then the
    GEMM_T_TABLE literal to paste into hayabusa/kernels/quant_linear.py (unswept keys keep their entries)."""
    print(f"{'scheme':<6} {'class':<7} {'M':>4} {'layers':<12} {'gemm_t us':>9} {'bf16 us':>8} {'dq+cuBLAS':>9} "
          f"{'table us':>8} {'vs bf16':>7}  best entry (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)")
    table = dict(GEMM_T_TABLE)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scheme"], r["shape_class"], r["M"]), []).append(r)
    for (scheme, shape, M), rs in sorted(groups.items()):
        totals: dict[tuple, float] = {}
        for r in rs:
            for entry, us in r["candidates"]:
                totals[tuple(entry)] = totals.get(tuple(entry), 0.0) + us
        common = [e for e in totals if all(any(tuple(c[0]) == e for c in r["candidates"]) for r in rs)]
        best = min(common, key=totals.__getitem__)
        if M in GEMM_M_BUCKETS:  # a swept M between buckets is printed, not tabled
            table[(scheme, M, shape)] = best
        bf16, dq, cur = (sum(r[k] for r in rs) for k in ("bf16_us", "dq_cublas_us", "table_us"))
        print(f"{scheme:<6} {shape:<7} {M:>4} {','.join(r['layer'] for r in rs):<12} {totals[best]:>9.1f} "
              f"{bf16:>8.1f} {dq:>9.1f} {cur:>8.1f} {bf16 / totals[best]:>7.2f}  {best}")
    print("# smallest swept M from which dequantize + cuBLAS beats the best gemm_t at every larger swept M "
          f"(DEQUANT_GEMM_MIN_M = {DEQUANT_GEMM_MIN_M}, DEQUANT_GEMM_MIN_M_INT4 = {DEQUANT_GEMM_MIN_M_INT4}):")
    for key in dict.fromkeys((r["scheme"], r["layer"]) for r in rows):
        ms = sorted((r["M"], r["dq_cublas_us"] < r["best_us"]) for r in rows if (r["scheme"], r["layer"]) == key)
        wins = [m for i, (m, _) in enumerate(ms) if all(win for _, win in ms[i:])]
        print(f"#   {key[0]:<5} {key[1]:<8} {wins[0] if wins else f'never (up to M = {ms[-1][0]})'}")
    print("GEMM_T_TABLE: dict[tuple[str, int, str], tuple[int, int, int, int, int, int]] = {")
    for key in sorted(table):
        print(f"    {key!r}: {tuple(table[key])!r},")
    print("}")


# --------------------------------------------------------------------- --sweep-w8a8 (the INT8 W8A8 GEMM's tiles)
SWEEP_W8A8_M = (16, 32, 64, 128, 256)


def w8a8_candidates(M: int) -> list[tuple[int, int, int, int, int, int]]:
    """INT8_GEMM_TABLE entries to try at M rows (5-17): the two row tiles nearest M (>= 16); N tiles 64 / 128 /
    256; K tiles 128, and 256 where the N tile is <= 128 (int8: 16-32 KB per operand and stage); 4 warps with 4
    stages, plus 8 warps with 3 stages for tiles of >= 8192 outputs; SPLIT_K 0 (the table's rule: split only while
    the tiles do not fill the SMs). Shared memory over 200 KB (stages x both operand tiles) is left out."""
    bms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, M)][-2:]
    cands = []
    for bm in bms:
        for bn in (64, 128, 256):
            for bk in (128, 256) if bn <= 128 else (128,):
                for warps, stages in ((4, 4), (8, 3)):
                    if warps == 8 and bm * bn < 8192:
                        continue
                    if stages * (bm + bn) * bk > 200 * 1024:
                        continue
                    cands.append((bm, bn, bk, 0, warps, stages))
    return cands


def _w8a8_operands(layer: str, M: int):
    from hayabusa.kernels.int8_quant import per_token_quant_int8_ref

    K, N, x, w = layer_inputs(layer, M)
    xq, sx = per_token_quant_int8_ref(x)
    wq, sw = per_token_quant_int8_ref(w)
    return K, N, x, w, xq, sx, wq, sw.view(-1).contiguous()


def _w8a8_compile(job: tuple[str, int, list[tuple]]) -> int:
    """A worker process of --sweep-w8a8: compile (and run once) one case's candidate launches into Triton's disk
    cache. Returns how many failed (not candidates on this GPU)."""
    from hayabusa.kernels.int8_gemm import int8_gemm_triton, int8_table_launch

    layer, M, entries = job
    K, N, _, _, xq, sx, wq, sw = _w8a8_operands(layer, M)
    failed = 0
    for e in entries:
        try:
            int8_gemm_triton(xq, sx, wq, sw, None, torch.bfloat16, int8_table_launch(e, M, N, K, xq.device))
        except Exception:  # noqa: BLE001 - out of registers / shared memory: timed as not a candidate later
            failed += 1
    torch.cuda.synchronize()
    return failed


def w8a8_precompile(cases: list[tuple[str, int]], jobs: int) -> None:
    """Compile every --sweep-w8a8 candidate of every case in `jobs` processes before the timing starts."""
    import concurrent.futures
    import multiprocessing

    work = [(layer, M, w8a8_candidates(M)[i::2]) for layer, M in cases for i in range(2)]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(pool.map(_w8a8_compile, work))
    print(f"# precompiled {sum(len(w[2]) for w in work)} launches in {jobs} processes ({failed} failed)",
          flush=True)


def sweep_w8a8_case(layer: str, M: int) -> dict:
    """One (layer, M): CUDA-graph us of bf16 F.linear, the current table's int8 GEMM launch and every candidate's
    (resolved launches deduplicated). Each candidate's output is compared bit for bit with the table launch's (the
    int32 sum is exact; only the epilogue's fp32 rounding could differ, e.g. a fused multiply-add in one kernel and
    not the other): a candidate that differs is reported and left out, since it could change a greedy token."""
    from hayabusa.kernels import int8_gemm

    K, N, x, w, xq, sx, wq, sw = _w8a8_operands(layer, M)
    run = lambda cfg: int8_gemm.int8_gemm_triton(xq, sx, wq, sw, None, torch.bfloat16, cfg)  # noqa: E731
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3  # noqa: E731
    table_cfg = int8_gemm.pick_int8_config(M, N, K, x.device)
    expect = run(table_cfg)
    row = dict(kind="w8a8_sweep", layer=layer, K=K, N=N, M=M, shape_class=int8_gemm.gemm_shape_class(N, K),
               bf16_us=bench(lambda: F.linear(x, w)), table_config=table_cfg.__dict__,
               table_us=bench(lambda: run(table_cfg)))
    seen, cands, differ = set(), [], []
    for entry in w8a8_candidates(M):
        cfg = int8_gemm.int8_table_launch(entry, M, N, K, x.device)
        if cfg in seen:
            continue
        seen.add(cfg)
        try:
            out = run(cfg)
        except Exception:  # noqa: BLE001 - out of shared memory / registers: not a candidate on this GPU
            continue
        if not torch.equal(out, expect):
            differ.append(list(entry))
            continue
        cands.append([list(entry), bench(lambda: run(cfg))])
    best = min(cands, key=lambda c: c[1]) if cands else [None, float("nan")]
    row.update(candidates=cands, differ=differ, best_entry=best[0], best_us=best[1])
    print(f"# {layer} M={M}: bf16 {row['bf16_us']:.1f} table {row['table_us']:.1f} best {best[1]:.1f} us "
          f"{best[0] and tuple(best[0])} ({len(cands)} candidates; {len(differ)} left out: output bits differ from the "
          f"table's{': ' + str(differ) if differ else ''})", flush=True)
    return row


def print_w8a8_sweep(rows: list[dict]) -> None:
    """Per (shape class, M): the entry with the least time summed over the class's swept layers (among entries
    every layer ran), next to bf16 and the current table; then the INT8_GEMM_TABLE literal to paste into
    hayabusa/kernels/int8_gemm.py (a swept M sets its bucket, int8_m_bucket(M); unswept keys keep their entries)."""
    from hayabusa.kernels.int8_gemm import INT8_GEMM_TABLE, int8_m_bucket

    print(f"{'class':<7} {'M':>4} {'layers':<12} {'best us':>8} {'table us':>8} {'bf16 us':>8} {'vs table':>8} "
          f"{'vs bf16':>7}  best entry (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)")
    table = dict(INT8_GEMM_TABLE)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape_class"], r["M"]), []).append(r)
    for (shape, M), rs in sorted(groups.items()):
        totals: dict[tuple, float] = {}
        for r in rs:
            for entry, us in r["candidates"]:
                totals[tuple(entry)] = totals.get(tuple(entry), 0.0) + us
        common = [e for e in totals if all(any(tuple(c[0]) == e for c in r["candidates"]) for r in rs)]
        if not common:
            print(f"{shape:<7} {M:>4} {','.join(r['layer'] for r in rs):<12} no candidate ran on every layer: kept")
            continue
        best = min(common, key=totals.__getitem__)
        bf16, cur = (sum(r[k] for r in rs) for k in ("bf16_us", "table_us"))
        if totals[best] < cur:  # keep the current entry unless a candidate beats it
            table[(int8_m_bucket(M), shape)] = best
        print(f"{shape:<7} {M:>4} {','.join(r['layer'] for r in rs):<12} {totals[best]:>8.1f} {cur:>8.1f} "
              f"{bf16:>8.1f} {cur / totals[best]:>8.2f} {bf16 / totals[best]:>7.2f}  {best}")
    print("INT8_GEMM_TABLE: dict[tuple[int, str], tuple[int, int, int, int, int, int]] = {")
    for key in sorted(table):
        print(f"    {key!r}: {tuple(table[key])!r},")
    print("}")


# ------------------------------------------------------------------------------------------------------- --small-m
SMALL_M_M = (1, 4, 8, 16, 32, 64)


def small_m_candidates(scheme: str, M: int) -> list[tuple]:
    """--small-m: the wo_small_m launches timed per case, WO_SMALL_M_TABLE entries (kind, BLOCK_M, BLOCK_N, BLOCK_K,
    SPLIT_K (0: from the SM count), num_warps, num_stages): N tiles 32-256, no split / auto split, 4 / 8 warps,
    3 / 4 stages; int4 both tile builds (slab: 8 nibble-slab dots; join: the k-ordered tile) and the inline-PTX
    kinds (to 16 rows "lop3", the slab with PTX-made slabs; from 17 "lop3j", the scaled slabs joined into one
    k-ordered tile, also with 64- and 256-wide N tiles), int8 both (slab: 4 byte-slab dots on int32 words; dot: the
    byte tile), K tiles 128-256. The row tile is M's bucket (16, 32, 64, 128, 256), at most 128 (lop3j: at least 64)."""
    from hayabusa.kernels.wo_small_m import wo_m_bucket

    bm = min(wo_m_bucket(M), 128)
    bm_wgmma = max(bm, 64)   # lop3j: 64 rows is the smallest warpgroup-MMA tile (wo_small_m's table comment)
    if scheme == "int4":
        shapes = [("slab", 64, 128, 1, 4, 3), ("slab", 64, 128, 0, 4, 4), ("slab", 128, 128, 1, 4, 4),
                  ("slab", 128, 128, 0, 8, 3), ("slab", 32, 128, 0, 4, 4), ("slab", 256, 128, 1, 8, 3),
                  ("join", 64, 128, 1, 4, 3), ("join", 128, 128, 0, 4, 4)]
        if M <= 16:
            shapes += [("lop3", 128, 128, 0, 8, 3), ("lop3", 64, 128, 1, 4, 3)]
        else:
            return [(kind, bm, bn, bk, split, warps, stages) for kind, bn, bk, split, warps, stages in shapes] + [
                ("lop3j", bm_wgmma, bn, bk, split, warps, stages) for bn, bk, split, warps, stages in
                ((128, 128, 0, 4, 3), (128, 128, 1, 4, 3), (128, 128, 0, 8, 3), (64, 128, 0, 4, 4),
                 (256, 128, 0, 8, 3))]
    else:
        shapes = [("slab", 64, 128, 1, 4, 3), ("slab", 64, 128, 0, 4, 4), ("slab", 128, 128, 1, 4, 4),
                  ("slab", 128, 128, 0, 8, 3), ("slab", 32, 128, 0, 4, 4), ("slab", 64, 256, 1, 8, 3),
                  ("dot", 32, 128, 0, 4, 4), ("dot", 64, 128, 1, 4, 3)]
    return [(kind, bm, bn, bk, split, warps, stages) for kind, bn, bk, split, warps, stages in shapes]


_SMALL_M_W: dict[tuple[str, str, int], tuple] = {}


def _small_m_operands(layer: str, M: int, scheme: str, G: int):
    """(x [M, K] bf16 (seed M), qweight, scales, zeros or None, group size or None, reference output, w [N, K] bf16)
    of one --small-m case; the layer's weight (seed 0, times 0.02) and its quantization made once per process."""
    K, N = LAYERS[layer]
    key = (layer, scheme, G)
    if key not in _SMALL_M_W:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        quant = quantize_int4_grouped(w, G) if scheme == "int4" else (*quantize_int8_per_channel(w), None)
        _SMALL_M_W[key] = (w, *quant)
    w, q, s, z = _SMALL_M_W[key]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(M))
    if scheme == "int4":
        return x, q, s, z, G, int4_weight_only_linear_ref(x, q, s, z, G), w
    return x, q, s, None, None, int8_weight_only_linear_ref(x, q, s), w


def _small_m_compile(job: tuple[str, int, str, int, list[tuple]]) -> int:
    """A worker process of --small-m: compile (and run once) the candidate launches of one case into Triton's disk
    cache. Returns how many failed (out of registers / shared memory: not candidates on this GPU)."""
    from hayabusa.kernels.wo_small_m import wo_small_m_launch, wo_small_m_linear

    layer, M, scheme, G, entries = job
    x, q, s, z, g, _, _ = _small_m_operands(layer, M, scheme, G)
    failed = 0
    for e in entries:
        try:
            cfg = wo_small_m_launch(e, M, LAYERS[layer][1], LAYERS[layer][0], g, x.device)
            wo_small_m_linear(x, q, s, z, g, cfg=cfg)
        except Exception:  # noqa: BLE001
            failed += 1
    torch.cuda.synchronize()
    return failed


def small_m_precompile(cases: list[tuple[str, int, str]], G: int, jobs: int) -> None:
    """Compile every --small-m candidate of every case in `jobs` processes before the timing (the disk cache is
    shared)."""
    import concurrent.futures
    import multiprocessing

    from hayabusa.kernels.wo_small_m import WO_SMALL_M_TABLE, wo_m_bucket

    work = [(layer, M, scheme, G, small_m_candidates(scheme, M)
             + [WO_SMALL_M_TABLE[(scheme, gemm_shape_class(*reversed(LAYERS[layer])), wo_m_bucket(M))]])
            for layer, M, scheme in cases]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(pool.map(_small_m_compile, work))
    print(f"# precompiled {sum(len(w[4]) for w in work)} launches in {jobs} processes ({failed} failed)", flush=True)


_BF16_US: dict[tuple[str, int], float] = {}


def small_m_case(layer: str, M: int, scheme: str, G: int) -> dict:
    """One --small-m row: CUDA-graph medians (us) of bf16 F.linear, today's quant_linear path at this M
    (_kernel_linear with USE_WO_SMALL_M off: GEMV to 4 rows, then the tl.dot GEMM / dequantize + cuBLAS), the
    WO_SMALL_M_TABLE launch and every small_m_candidates launch (each checked against the reference first)."""
    import hayabusa.kernels.quant_linear as ql
    from hayabusa.kernels.wo_small_m import pick_wo_small_m_config, wo_small_m_launch, wo_small_m_linear

    K, N = LAYERS[layer]
    x, q, s, z, g, ref, w = _small_m_operands(layer, M, scheme, G)
    w_bytes = N * K // 2 + 2 * (K // G) * N * 2 if scheme == "int4" else N * K + N * 2
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=5, return_mode="median") * 1e3  # noqa: E731
    if (layer, M) not in _BF16_US:
        _BF16_US[(layer, M)] = bench(lambda: F.linear(x, w))
    ql.USE_WO_SMALL_M = False
    row = dict(kind="small_m", layer=layer, K=K, N=N, M=M, scheme=scheme, group_size=g, weight_bytes=w_bytes,
               copy_gb_s=copy_gb_s(w_bytes), bf16_us=_BF16_US[(layer, M)],
               today_us=bench(lambda: ql._kernel_linear(x, q, s, z, None, N, g)))
    table_cfg = pick_wo_small_m_config(M, N, K, g, x.device)
    row["table"] = [table_cfg.kind, table_cfg.BLOCK_M, table_cfg.BLOCK_N, table_cfg.BLOCK_K, table_cfg.SPLIT_K,
                    table_cfg.num_warps, table_cfg.num_stages]
    times = {}
    for e in [None] + small_m_candidates(scheme, M):
        name = "table" if e is None else repr(e)
        try:
            cfg = table_cfg if e is None else wo_small_m_launch(e, M, N, K, g, x.device)
            y = wo_small_m_linear(x, q, s, z, g, cfg=cfg)
            if float((y.float() - ref.float()).abs().max()) > 2 * 2.0 ** -7 * float(ref.float().abs().max()):
                raise AssertionError("differs from the reference by more than 2 ulps of the output scale")
            times[name] = bench(lambda: wo_small_m_linear(x, q, s, z, g, cfg=cfg))
        except Exception as err:  # noqa: BLE001 - out of registers / shared memory: not a candidate here
            print(f"# {layer} {scheme} M={M} {name}: {type(err).__name__}: {err}", flush=True)
    row["table_us"] = times.pop("table", float("nan"))
    row["cand_us"] = times
    best = min(times, key=times.get) if times else None
    row["best"], row["best_us"] = best, times.get(best, float("nan"))
    for key in ("bf16", "today", "table", "best"):
        row[f"{key}_pct_copy"] = 100 * w_bytes / (row[f"{key}_us"] * 1e-6) / 1e9 / row["copy_gb_s"]
    print(f"# {layer} {scheme} M={M} done", flush=True)
    return row


def print_small_m_table(rows: list[dict]) -> None:
    """The --small-m rows, then per (scheme, shape class, M bucket) the candidate with the least time summed over
    the class's rows (a row missing it is charged its slowest) as a WO_SMALL_M_TABLE literal, and the mid-M keys
    (buckets past WO_SMALL_M_MAX) where that sum beat today's path's (small_m_case's "today_us": quant_linear's
    tl.dot GEMM below DEQUANT_GEMM_MIN_M(_INT4) rows, dequantize + cuBLAS from there) as a WO_MID_M_WINS literal;
    keys not swept keep the module's entries."""
    from hayabusa.kernels.wo_small_m import WO_MID_M_WINS, WO_SMALL_M_MAX, WO_SMALL_M_TABLE, wo_m_bucket

    print(f"{'layer':<8} {'scheme':<6} {'M':>3} {'bf16 us':>8} {'today us':>9} {'table us':>9} {'best us':>8} "
          f"{'best/bf16':>9} {'%copy':>6}  best launch (kind, BM, BN, BK, split, warps, stages)")
    for r in rows:
        print(f"{r['layer']:<8} {r['scheme']:<6} {r['M']:>3} {r['bf16_us']:>8.1f} {r['today_us']:>9.1f} "
              f"{r['table_us']:>9.1f} {r['best_us']:>8.1f} {r['bf16_us'] / r['best_us']:>9.2f} "
              f"{r['best_pct_copy']:>6.1f}  {r['best']}")
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in rows:
        if r["cand_us"]:
            groups.setdefault((r["scheme"], gemm_shape_class(r["N"], r["K"]), wo_m_bucket(r["M"])), []).append(r)
    table, wins = dict(WO_SMALL_M_TABLE), set(WO_MID_M_WINS)
    for key, rs in sorted(groups.items()):
        cands = {c for r in rs for c in r["cand_us"]}
        cost = {c: sum(r["cand_us"].get(c, max(r["cand_us"].values())) for r in rs) for c in cands}
        best = min(cost, key=cost.get)
        table[key] = ast.literal_eval(best)
        if key[2] > WO_SMALL_M_MAX:
            wins.discard(key)
            if cost[best] < sum(r["today_us"] for r in rs):
                wins.add(key)
    print("WO_SMALL_M_TABLE: dict[tuple[str, str, int], tuple[str, int, int, int, int, int, int]] = {")
    for key in sorted(table):
        print(f"    {key!r}: {table[key]!r},")
    print("}")
    print("WO_MID_M_WINS: frozenset[tuple[str, str, int]] = frozenset({")
    for key in sorted(wins):
        print(f"    {key!r},")
    print("})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the rows (and the setup) to this JSON file")
    parser.add_argument("--table-json", default=None,
                        help="--fp8 --sweep: write the tuned FP8_TABLE / FP8Q_TABLE here, the file "
                             "HAYABUSA_FP8_TABLE_JSON loads into the engine")
    parser.add_argument("--m", help="comma-separated batch sizes M (default 1,8,64,256,2048; with --dequant "
                                    "16,64,128,256,512,2048,8192)")
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated subset of {list(LAYERS)}")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sweep", action="store_true", help="also search launch configs (slow: many compiles)")
    parser.add_argument("--dequant", action="store_true",
                        help="compare the fused Triton path with dequantize + cuBLAS (for DEQUANT_GEMM_MIN_M)")
    parser.add_argument("--w8a8", action="store_true",
                        help="time INT8 W8A8 (Triton and _int_mm) and FP8 W8A8 against bf16 (for INT_MM_MIN_M)")
    parser.add_argument("--fp8", action="store_true",
                        help="time fp8_small_m_linear against quantize + _scaled_mm and bf16 (with --sweep: retune "
                             "pick_fp8_config)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="--fp8 --sweep: processes compiling the candidates before the timing (1: none)")
    parser.add_argument("--sweep-gemm", action="store_true",
                        help="search the swapped-operand GEMM's tiles per (scheme, shape class, M bucket) and print "
                             "GEMM_T_TABLE and the dequantize + cuBLAS crossovers")
    parser.add_argument("--sweep-w8a8", action="store_true",
                        help="search the INT8 W8A8 GEMM's tiles per (shape class, M) and print INT8_GEMM_TABLE")
    parser.add_argument("--small-m", action="store_true",
                        help="time kernels/wo_small_m.py's candidate launches against bf16 F.linear and today's "
                             "path, int4 and int8, M 1,4,8,16,32,64 (prints a WO_SMALL_M_TABLE literal)")
    parser.add_argument("--schemes", default="int4,int8",
                        help="--small-m: the weight-only schemes to time (int4, int8, or both)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--sweep-w8a8 / --small-m: start no new case after this many seconds from the start "
                             "(default 170 / 110)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="print the --sweep-gemm / --sweep-w8a8 tables of earlier runs' --json files together "
                             "(no GPU needed)")
    args = parser.parse_args()
    if args.merge:
        rows = [r for f in args.merge for r in json.loads(f.read_text())["rows"]]
        if rows and all(r.get("kind") == "w8a8_sweep" for r in rows):
            print_w8a8_sweep(rows)
        elif rows and all(r.get("kind") == "small_m" for r in rows):
            print_small_m_table(rows)
        else:
            print_gemm_sweep(rows)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_quant_linear needs a CUDA GPU")
    bad_schemes = [v for v in args.schemes.split(",") if v not in ("int4", "int8")]
    if bad_schemes:
        sys.exit(f"--schemes: unknown {bad_schemes}; choose from int4, int8")
    modes = args.dequant + args.w8a8 + args.sweep_gemm + args.sweep_w8a8 + args.small_m
    budget_s = args.budget_s if args.budget_s is not None else 110.0 if args.small_m else 170.0
    if args.sweep + modes > 1 or args.fp8 + modes > 1:
        sys.exit("--sweep, --dequant, --w8a8, --fp8, --sweep-gemm, --sweep-w8a8 and --small-m are separate runs "
                 "(--fp8 --sweep sweeps the FP8 kernel)")
    m_list = args.m or ("16,64,128,256,512,2048,8192" if args.dequant else "1,16,64,256,1024,8192" if args.w8a8
                        else "1,4,16,64" if args.fp8 else ",".join(map(str, SWEEP_GEMM_M)) if args.sweep_gemm
                        else ",".join(map(str, SWEEP_W8A8_M)) if args.sweep_w8a8
                        else ",".join(map(str, SMALL_M_M)) if args.small_m else "1,8,64,256,2048")
    rows = []
    if args.fp8 and args.sweep and args.jobs > 1:
        fp8_precompile([(layer, int(m)) for layer in args.layers.split(",") for m in m_list.split(",")], args.jobs)
    started = time.monotonic()
    if args.small_m and args.jobs > 1:
        small_m_precompile([(layer, int(m), scheme) for m in m_list.split(",") for layer in args.layers.split(",")
                            for scheme in args.schemes.split(",")], args.group_size, args.jobs)
    if args.small_m:  # M outer, layers inner: a run cut by the budget keeps whole row counts
        for M in (int(m) for m in m_list.split(",")):
            for layer in args.layers.split(","):
                for scheme in args.schemes.split(","):
                    if time.monotonic() - started > budget_s:
                        print(f"# --budget-s {budget_s:g} reached: {layer} {scheme} M={M} not run", flush=True)
                        continue
                    rows.append(small_m_case(layer, M, scheme, args.group_size))
                    if args.json:  # after every case: a run stopped by a time limit keeps what it measured
                        args.json.write_text(json.dumps(dict(setup=dict(small_m=True), rows=rows)))
    if args.sweep_w8a8 and args.jobs > 1:
        w8a8_precompile([(layer, int(m)) for layer in args.layers.split(",") for m in m_list.split(",")], args.jobs)
    for layer in args.layers.split(",") if not args.small_m else ():
        for M in (int(m) for m in m_list.split(",")):
            if args.sweep_w8a8:
                if time.monotonic() - started > budget_s:
                    print(f"# --budget-s {budget_s:g} reached: {layer} M={M} not run", flush=True)
                    continue
                rows.append(sweep_w8a8_case(layer, M))
                if args.json:  # after every case: a run stopped by a time limit keeps what it measured
                    args.json.write_text(json.dumps(dict(setup=dict(sweep_w8a8=True), rows=rows)))
            elif args.fp8:
                rows.append(fp8_case(layer, M, args.sweep))
            elif args.sweep_gemm:
                rows += [sweep_gemm_case(layer, M, scheme, args.group_size) for scheme in ("int8", "int4")]
                if args.json:  # after every case: a run stopped by a time limit keeps what it measured
                    args.json.write_text(json.dumps(dict(setup=dict(sweep_gemm=True), rows=rows)))
            elif args.w8a8:
                rows.append(w8a8_case(layer, M))
            else:
                rows += dequant_case(layer, M, args.group_size) if args.dequant else \
                    bench_case(layer, M, args.group_size, args.sweep)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"Qwen2.5-7B linears, bf16 activations, int4 group size {args.group_size}")
    if args.small_m:
        print_small_m_table(rows)
    elif args.fp8:
        print_fp8_table(rows, args.table_json)
    elif args.dequant:
        print_dequant_table(rows)
    elif args.sweep_gemm:
        print_gemm_sweep(rows)
    elif args.sweep_w8a8:
        print_w8a8_sweep(rows)
    elif args.w8a8:
        print_w8a8_table(rows)
    else:
        print_table(rows)
    setup = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                 group_size=args.group_size, sweep=args.sweep, dequant=args.dequant, w8a8=args.w8a8, fp8=args.fp8,
                 sweep_gemm=args.sweep_gemm, sweep_w8a8=args.sweep_w8a8, small_m=args.small_m)
    if not (args.small_m and args.json):  # --small-m's rows are long: with --json the table ends the output
        print(json.dumps(dict(setup=setup, rows=rows)))
    if args.json:
        args.json.write_text(json.dumps(dict(setup=setup, rows=rows), indent=2))


if __name__ == "__main__":
    main()
