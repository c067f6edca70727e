"""Time batch-invariant mode's GEMM (kernels/bi_gemm.py: fixed split-K per weight shape) against the mode's first GEMM
(``matmul_bi_unsplit``: one tile config, no split-K) and torch's F.linear (cuBLAS; not batch-invariant), per
projection shape and M; print a table and JSON. The input for BI_GEMM_TABLE (kernels/bi_gemm.py).

    python benchmarks/kernels/bench_bi_gemm.py --device cuda [--json FILE] [--m 1,8,32,256,2048]
        [--models qwen2.5-0.5b-shape,qwen2.5-7b-shape] [--layers qkv,o,gate_up,down,lm_head] [--shapes NxK,...]
        [--config '{"896x896": {"BLOCK_N": 32, "CHUNK_K": 128}}'] [--sweep]

Shapes: each model's linears as the engine holds them (bench/models.linear_shapes: q/k/v and gate/up merged, the
lm_head), or --shapes. bf16. Per (shape, M) the row has, in microseconds (CUDA-graph replays, how decode runs;
medians): ``torch`` F.linear, ``unsplit`` the first BI GEMM, ``bi`` bi_gemm as the engine launches it (``launch``:
split or unsplit by bi_gemm_splits), and ``bi_split`` / ``bi_unsplit`` forced each way (equal bits, checked: the
split decision only trades parallelism for partial traffic, so these two columns say where SPLIT_BELOW_TILES should
be); ``bi_fused`` the split launch with SUM_IN_KERNEL (the tile's last chunk program sums: no second kernel).
GB/s counts the bytes a perfect kernel moves (weight + x + y, bf16). 'bi/torch' = torch time / bi time (> 1: faster
than cuBLAS; the mode's target is >= 0.9 end to end). Every case is checked first: bi_gemm vs F.linear
within bf16 tolerance, forced split == forced unsplit bit for bit.

--config: fields over a shape's configuration for this run (the same JSON as HAYABUSA_BI_GEMM_CONFIGS, which it sets).
--sweep: also times a grid of configurations per shape (tiles, K chunks, warps; both launches at each M) and prints
per shape the one configuration (the mode needs ONE per weight shape, never per M) with the smallest mean of
bi / torch time over the M list, with its best SPLIT_BELOW_TILES (and SUM_IN_KERNEL when that is faster), as a
line to paste into BI_GEMM_TABLE. Not yet
timed on a GPU: about 700 timings per shape (~70 configs x 5 M x both launches, 10 ms each plus the capture of
thousands of launches for the microsecond-sized ones), so expect two to four minutes per shape: run one or two
--layers per command (e.g. --models qwen2.5-0.5b-shape --layers qkv,o) to stay under a 10-minute limit.
Without --sweep the table alone takes about 2-4 minutes for both models (300 timings).
--probe-tiles: only checks, per shape in bf16 and fp16, that a row's bits do not depend on the launch's tile shape,
warps, stages or split once BLOCK_K and CHUNK_K are fixed (what lets the mode pick its launch per M), and prints how
many launches differ. --bucket-sweep: only searches, per shape, the fastest launch per M under one arithmetic
(--keep-arith: the shape's own BLOCK_K / CHUNK_K) and prints it; from M = 64 on the candidates include the
persistent TMA kernel's tiles (on CUDA); --buckets-out FILE writes the winners as a HAYABUSA_BI_GEMM_BUCKETS file
(kernels/bi_gemm.py) for the engine to run with; --cold-l2 times each launch over copies of the weight that do not
fit in L2 (each engine layer reads its weight from HBM; one launch replayed alone finds it in L2, which made the
twenty-fourth session's decode launches look 1.8x faster than they ran in the engine), --gate-up-silu times gate_up
with its SiLU-and-mul as the engine launches it; --block-ks / --splits narrow the arithmetics tried (without
--keep-arith), e.g. ``--block-ks 128 --splits 1,2,4`` to ask whether K in chunks (decode split into more programs)
pays once weights come from HBM.
--device cpu runs the Triton interpreter (``TRITON_INTERPRET=1`` in the environment; tiny --shapes only; times
meaningless: a smoke test of this script).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing

from hayabusa.kernels import bi_gemm as bg  # noqa: E402
from hayabusa.kernels._triton import cdiv  # noqa: E402
from hayabusa.kernels.activation import silu_and_mul  # noqa: E402
from hayabusa.kernels.batch_invariant import matmul_bi_unsplit  # noqa: E402

DTYPE = torch.bfloat16


def time_us(fn, device: str, rep_ms: int = 50) -> float:
    """Median microseconds of fn(): CUDA-graph replays on CUDA, the wall time of one call elsewhere."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    t = time.perf_counter()        # the interpreter: one call (a smoke test; its times mean nothing)
    fn()
    return (time.perf_counter() - t) * 1e6


def shapes_to_run(args) -> list[tuple[str, str, int, int, bool]]:
    """(model, layer, N, K, has_bias) for each shape of the run."""
    if args.shapes:
        out = []
        for spec in args.shapes.split(","):
            try:
                n, k = (int(v) for v in spec.lower().split("x"))
                if n < 1 or k < 1:
                    raise ValueError
            except ValueError:
                sys.exit(f"bench_bi_gemm: --shapes {spec!r}: write weight shapes NxK (N output features, K input), "
                         f"comma-separated, e.g. --shapes 896x896,9728x896")
            out.append(("-", spec, n, k, False))
        return out
    from hayabusa.bench.models import linear_shapes

    layers = args.layers.split(",")
    return [(model, layer, n, k, bias) for model in args.models.split(",")
            for layer, (n, k, bias) in linear_shapes(model).items() if layer in layers]


def make_inputs(N: int, K: int, M: int, has_bias: bool, device: str, dtype: torch.dtype = DTYPE, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(N, K, device=device, generator=gen) / K ** 0.5).to(dtype)
    b = torch.randn(N, device=device, generator=gen).to(dtype) if has_bias else None
    x = torch.randn(M, K, device=device, generator=gen).to(dtype)
    return x, w, b


def chunk_of(K: int, splits: int, block_k: int) -> int:
    """CHUNK_K that cuts K into ``splits`` chunks, rounded up to whole BLOCK_K steps."""
    return -(-(-(-K // splits)) // block_k) * block_k


def check(x, w, b, cfg: bg.BiGemmConfig) -> None:
    bg.reserve_tile_counters(x.device)
    split = bg.bi_gemm(x, w, b, config=cfg, split=True)
    unsplit = bg.bi_gemm(x, w, b, config=cfg, split=False)
    if not torch.equal(split, unsplit):
        raise AssertionError(f"split != unsplit for {tuple(w.shape)} M={x.shape[0]} {cfg}")
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(unsplit.float(), ref, rtol=1.6e-2, atol=1.6e-2 * ref.abs().max().item())


def bench_case(model: str, layer: str, N: int, K: int, has_bias: bool, M: int, device: str) -> dict:
    x, w, b = make_inputs(N, K, M, has_bias, device)
    sms = bg.num_sms(torch.device(device))
    cfg = bg.bi_gemm_config(N, K, sms, M, torch.device(device))   # M's bucket's tiles, the shape's arithmetic
    check(x, w, b, cfg)
    fns = {"torch": lambda: F.linear(x, w, b), "unsplit": lambda: matmul_bi_unsplit(x, w, b),
           "bi": lambda: bg.bi_gemm(x, w, b, config=cfg),
           "bi_split": lambda: bg.bi_gemm(x, w, b, config=cfg, split=True),
           "bi_fused": lambda: bg.bi_gemm(x, w, b, config=fused, split=True),
           "bi_unsplit": lambda: bg.bi_gemm(x, w, b, config=cfg, split=False)}
    fused = dataclasses.replace(cfg, SUM_IN_KERNEL=True)
    if cfg.num_chunks(K) == 1:                 # one chunk: the launches are the same
        del fns["bi_split"], fns["bi_fused"], fns["bi_unsplit"]
    elif not torch.equal(fns["bi_fused"](), fns["bi_unsplit"]()):
        raise AssertionError(f"SUM_IN_KERNEL split != unsplit for {N}x{K} M={M}")
    nbytes = (N * K + M * K + M * N + (N if has_bias else 0)) * 2
    row = dict(model=model, layer=layer, N=N, K=K, M=M, config=dataclasses.asdict(cfg), S=cfg.num_chunks(K),
               launch="split" if bg.bi_gemm_splits(M, N, K, cfg, sms) else "unsplit")
    for name, fn in fns.items():
        us = time_us(fn, device, 25)
        row[f"{name}_us"] = us
        row[f"{name}_gb_s"] = nbytes / us / 1e3
    row["bi_vs_torch"] = row["torch_us"] / row["bi_us"]
    row["unsplit_vs_torch"] = row["torch_us"] / row["unsplit_us"]
    return row


def print_table(rows: list[dict]) -> None:
    cols = ("torch", "unsplit", "bi", "bi_split", "bi_fused", "bi_unsplit")
    print(f"{'model':<20} {'layer':<8} {'N':>6} {'K':>6} {'M':>5} " + " ".join(f"{c + ' us':>13}" for c in cols)
          + f" {'bi GB/s':>8} {'bi/torch':>8} {'old/torch':>9} launch   config")
    for r in rows:
        us = [f"{r[c + '_us']:>13.1f}" if c + "_us" in r else f"{'-':>13}" for c in cols]
        c = r["config"]
        desc = (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} chunk {c['CHUNK_K']} (S {r['S']}) w{c['num_warps']} "
                f"s{c['num_stages']}{' sum-in-kernel' if c['SUM_IN_KERNEL'] else ''}")
        print(f"{r['model'][:20]:<20} {r['layer']:<8} {r['N']:>6} {r['K']:>6} {r['M']:>5} " + " ".join(us)
              + f" {r['bi_gb_s']:>8.1f} {r['bi_vs_torch']:>8.2f} {r['unsplit_vs_torch']:>9.2f} {r['launch']:<8} {desc}")


# ------------------------------------------------------------------------------------------------------- sweep
def sweep_configs(N: int, K: int, device: str) -> list[bg.BiGemmConfig]:
    """Candidates for one weight shape (about 70): BLOCK_M 16 / 64 x BLOCK_N 32 / 64 / 128 x BLOCK_K 64 / 128 x K
    in S = 1 / 2 / 4 / 8 / 16 whole-BLOCK_K chunks, 4 warps (also 8 for 64 x 128 tiles). CHUNK_K is a runtime
    argument of the kernel: one compile per tile configuration, shared by every shape."""
    if device != "cuda":                       # the interpreter: a token grid
        return [bg.BiGemmConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, CHUNK_K=c) for c in (64, 128)]
    out = {}
    for bm in (16, 64):
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for splits in (1, 2, 4, 8, 16):
                    chunk = chunk_of(K, splits, bk)
                    for warps in ((4, 8) if bm * bn >= 64 * 128 else (4,)):
                        out[bg.BiGemmConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK_K=chunk, num_warps=warps)] = 0
    return list(out)


MAX_PARTIAL_BYTES = 1 << 28    # the sweep does not time a split launch whose fp32 partials exceed 256 MiB


def best_threshold(times: list[tuple[int, float, float]], torch_us: list[float]) -> tuple[int, float]:
    """(SPLIT_BELOW_TILES, mean bi / torch time) for one config from (tiles, unsplit us, split us) per M (split us
    = unsplit us when S = 1, inf when not timed): the rule "split below T tiles" that minimizes the mean ratio."""
    best = (1, float("inf"))
    for T in sorted({t for t, _, _ in times} | {1, 1 << 30}):
        ratios = [(s if tiles < T else u) / ref for (tiles, u, s), ref in zip(times, torch_us)]
        mean = sum(ratios) / len(ratios)
        if mean < best[1]:
            best = (T, mean)
    return best


def sweep_shape(N: int, K: int, has_bias: bool, ms: list[int], device: str) -> dict:
    inputs = {M: make_inputs(N, K, M, has_bias, device) for M in ms}
    torch_us = [time_us(lambda x=x, w=w, b=b: F.linear(x, w, b), device, 10) for x, w, b in inputs.values()]
    results = []
    for cfg in sweep_configs(N, K, device):
        S = cfg.num_chunks(K)
        times = []
        try:
            for M, (x, w, b) in inputs.items():
                u = time_us(lambda: bg.bi_gemm(x, w, b, config=cfg, split=False), device, 10)
                s = u if S == 1 else float("inf") if S * M * N * 4 > MAX_PARTIAL_BYTES else \
                    time_us(lambda: bg.bi_gemm(x, w, b, config=cfg, split=True), device, 10)
                times.append((-(-M // cfg.BLOCK_M) * -(-N // cfg.BLOCK_N), u, s))
        except Exception as e:  # noqa: BLE001 - out of shared memory / registers: not a candidate on this GPU
            print(f"#   {cfg}: {type(e).__name__}", file=sys.stderr)
            continue
        T, mean = best_threshold(times, torch_us)
        results.append((mean, dataclasses.replace(cfg, SPLIT_BELOW_TILES=T), times))
    mean, cfg, times = min(results, key=lambda r: r[0])
    best_us = [s if t < cfg.SPLIT_BELOW_TILES else u for t, u, s in times]
    # the winner's split launches again with the sum in the kernel (no second launch): kept if faster overall
    fused = dataclasses.replace(cfg, SUM_IN_KERNEL=True)
    fused_us = [time_us(lambda x=x, w=w, b=b: bg.bi_gemm(x, w, b, config=fused, split=True), device, 10)
                if t < cfg.SPLIT_BELOW_TILES else u for (t, u, _), (x, w, b) in zip(times, inputs.values())]
    if sum(f / r for f, r in zip(fused_us, torch_us)) < sum(b_ / r for b_, r in zip(best_us, torch_us)):
        cfg, best_us = fused, fused_us
        mean = sum(f / r for f, r in zip(fused_us, torch_us)) / len(ms)
    x, w, b = inputs[ms[0]]
    check(x, w, b, cfg)
    return dict(N=N, K=K, best=dataclasses.asdict(cfg), mean_ratio=mean, torch_us=torch_us, ms=ms,
                best_us=best_us, candidates=len(results))


def print_sweep(best: list[dict]) -> None:
    print("# sweep: per shape the one config with the smallest mean (bi us / torch us) over M; paste into "
          "BI_GEMM_TABLE (kernels/bi_gemm.py):")
    for r in best:
        fields = ", ".join(f"{k}={v}" for k, v in r["best"].items() if k != "GROUP_M")
        per_m = " ".join(f"M{m}:{b:.1f}/{t:.1f}us" for m, b, t in zip(r["ms"], r["best_us"], r["torch_us"]))
        print(f"    ({r['N']}, {r['K']}): BiGemmConfig({fields}),   # mean bi/torch {r['mean_ratio']:.2f}x time; "
              f"{per_m}; {r['candidates']} candidates")


# ------------------------------------------------------------------------------- tiles that share the arithmetic
def tile_variants(cfg: bg.BiGemmConfig, device: str, probe: bool = False,
                  tma: bool = False) -> list[bg.BiGemmConfig]:
    """Launches that keep ``cfg``'s arithmetic (BLOCK_K, CHUNK_K: the order a row's products are added in) and change
    everything else: BLOCK_M 16 / 64 / 128, BLOCK_N 32 / 64 / 128 / 256, 4 / 8 warps (8 only for tiles of 64 x 64 or
    more, and the only choice above 128 x 128), 3 / 4 stages (``probe``: 3, and 2 / 4 on one tile); ``tma`` (CUDA):
    also the persistent TMA kernel's tiles of 64 / 128 x 64 / 128 / 256, 2-4 stages (8 warps from 128 x 128 on)."""
    if device != "cuda":
        return [dataclasses.replace(cfg, BLOCK_M=bm, BLOCK_N=bn) for bm in (16, 32) for bn in (16, 32)]
    out = []
    for bm in (16, 64, 128):
        for bn in (32, 64, 128, 256):
            for warps in (4, 8):
                for stages in ((3,) if probe else (3, 4)):
                    if bm * bn > 128 * 128 and warps < 8 or bm * bn < 64 * 64 and warps > 4:
                        continue
                    out.append(dataclasses.replace(cfg, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages))
    if probe:
        out += [dataclasses.replace(cfg, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=st) for st in (2, 4)]
    elif tma:
        out += [dataclasses.replace(cfg, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, TMA=True)
                for bm in (64, 128) for bn in (64, 128, 256) for warps in (4, 8) for stages in (2, 3, 4)
                if (warps == 8) == (bm * bn >= 128 * 128) and not (bm == 64 and bn == 256 and stages < 3)]
    return out


def probe_tiles(N: int, K: int, has_bias: bool, device: str, dtype=DTYPE, M: int = 300) -> dict:
    """Whether a row's bits depend on the tile shape, warps or stages once BLOCK_K and CHUNK_K are fixed: x [M, K]
    through every ``tile_variants`` launch (split and unsplit) of two arithmetics (the shape's configuration, and
    BLOCK_K 64 with one chunk), each compared bit for bit with the first. Returns counts and the differing launches."""
    x, w, b = make_inputs(N, K, M, has_bias, device, dtype, seed=3)
    base = bg.bi_gemm_config(N, K, bg.num_sms(torch.device(device)))
    arith = [base, dataclasses.replace(base, BLOCK_K=64, CHUNK_K=-(-K // 64) * 64)]
    out = dict(N=N, K=K, dtype=str(dtype), compared=0, differ=[], failed=0)
    for a in arith:
        ref = None
        for cfg in tile_variants(a, device, probe=True):
            for split in (False, True):
                try:
                    y = bg.bi_gemm(x, w, b, config=cfg, split=split)
                    y1 = bg.bi_gemm(x[M // 2:M // 2 + 1], w, b, config=cfg, split=split)
                except Exception:  # noqa: BLE001 - out of shared memory / registers on this GPU
                    out["failed"] += 1
                    continue
                if ref is None:
                    ref = y
                out["compared"] += 1
                if not (torch.equal(y, ref) and torch.equal(y1[0], ref[M // 2])):
                    out["differ"].append(dict(cfg=dataclasses.asdict(cfg), split=split,
                                              rows=int((y != ref).any(dim=1).sum()),
                                              max_abs=(y.float() - ref.float()).abs().max().item()))
    return out


def cold_copies(w: torch.Tensor, device: str) -> list[torch.Tensor]:
    """``w`` and copies of it whose bytes together exceed twice the GPU's L2 (2 on CPU, at most COLD_MAX_COPIES):
    a launch timed over them in turn reads its weight from HBM, as each layer of the engine does (one launch replayed
    on one weight would find it in L2: a 17 MB gate_up fits in an H200's 50 MB)."""
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size if device == "cuda" else 0
    n = min(COLD_MAX_COPIES, max(2, cdiv(2 * l2, w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(n - 1)]


COLD_MAX_COPIES = 64


def engine_launch(x, w, b, cfg: bg.BiGemmConfig, split: bool, silu: bool) -> torch.Tensor:
    """The launch the engine runs for a bucket candidate ``cfg``: ``bi_gemm``, or, ``silu`` (an MLP's gate_up), the
    one-launch gate_up + SiLU-and-mul with BLOCK_N halved per half (what ``silu_and_mul_bi`` does with the bucket's
    launch), its split launches through ``bi_gemm`` and the activation kernel (the engine's fallback)."""
    if not silu:
        return bg.bi_gemm(x, w, b, config=cfg, split=split)
    if split:
        return silu_and_mul(bg.bi_gemm(x, w, b, config=cfg, split=True))
    half = bg.silu_launch_config(dataclasses.replace(cfg, SPLIT_BELOW_TILES=bg.UNSPLIT))
    y = bg.silu_and_mul_bi(x, w, b, config=half)            # None with a bias: the two launches
    return y if y is not None else silu_and_mul(bg.bi_gemm(x, w, b, config=cfg, split=False))


def timed_us(launch, x, ws: list[torch.Tensor], b, device: str) -> float:
    """Median us of ``launch(x, w, b)`` per weight, over the weights ``ws`` in turn (one weight: replays of one
    launch)."""
    if len(ws) == 1:
        return time_us(lambda: launch(x, ws[0], b), device, 10)
    return time_us(lambda: [launch(x, w, b) for w in ws], device, 10) / len(ws)


def bucket_sweep_shape(N: int, K: int, has_bias: bool, ms: list[int], device: str, keep_arith: bool = False,
                       cold_l2: bool = False, silu: bool = False, block_ks: tuple[int, ...] = (64, 128),
                       splits: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """The fastest launch per M that keeps one arithmetic per shape. For each arithmetic (BLOCK_K 64 / 128, K in 1 /
    2 / 4 / 8 chunks, or ``block_ks`` x ``splits``; ``keep_arith``: only the shape's own, bi_gemm_config's) and each
    M: the best of
    ``tile_variants`` x (split, unsplit); then the arithmetic with the smallest mean of best / torch time over M.
    ``cold_l2``: every launch (torch's too) timed over ``cold_copies`` of the weight; ``silu``: the shape is an MLP's
    gate_up, timed as the engine runs it (``engine_launch``; torch: F.linear + the SiLU-and-mul kernel).
    Returns that arithmetic, the per-M winners and times."""
    inputs = {M: make_inputs(N, K, M, has_bias, device) for M in ms}
    weights = {M: cold_copies(w, device) if cold_l2 else [w] for M, (_x, w, _b) in inputs.items()}
    ref = (lambda x, w, b: silu_and_mul(F.linear(x, w, b))) if silu else F.linear
    torch_us = {M: timed_us(ref, x, weights[M], b, device) for M, (x, _w, b) in inputs.items()}
    ariths = {}
    if keep_arith:
        own = bg.bi_gemm_config(N, K, bg.num_sms(torch.device(device)))
        ariths[(own.BLOCK_K, own.CHUNK_K)] = None
    for bk in () if keep_arith else block_ks:
        for n in splits:
            ariths[(bk, chunk_of(K, n, bk))] = None
    results, failure = [], None
    for bk, chunk in ariths:
        per_m = {}
        for M, (x, w, b) in inputs.items():
            best = (float("inf"), None, None)
            for cfg in tile_variants(bg.BiGemmConfig(BLOCK_K=bk, CHUNK_K=chunk), device, tma=M >= 64):
                if (cfg.BLOCK_M == 16 and M > 64) or (cfg.BLOCK_M >= 64 and M <= 16 and cfg.BLOCK_M > 64) \
                        or (cfg.BLOCK_M > 16 and M == 1):
                    continue                       # pruned: tiles far from M's size
                S = cfg.num_chunks(K)
                for split in ((False, True) if S > 1 and not cfg.TMA else (False,)):
                    if split and S * M * N * 4 > MAX_PARTIAL_BYTES or not split and S > 1 and M <= 16:
                        continue
                    try:
                        us = timed_us(lambda x, w, b: engine_launch(x, w, b, cfg, split, silu), x, weights[M], b,
                                      device)
                    except Exception as e:  # noqa: BLE001 - out of resources: not a candidate
                        failure = e
                        continue
                    if us < best[0]:
                        best = (us, cfg, split)
            if best[1] is None:
                raise RuntimeError(f"no launch of {N}x{K} at BLOCK_K {bk} / CHUNK_K {chunk} ran at M={M}; the last "
                                   f"one failed with {failure!r}")
            per_m[M] = best
        mean = sum(per_m[M][0] / torch_us[M] for M in ms) / len(ms)
        results.append((mean, (bk, chunk), per_m))
    mean, (bk, chunk), per_m = min(results, key=lambda r: r[0])
    return dict(N=N, K=K, BLOCK_K=bk, CHUNK_K=chunk, mean_ratio=mean, ms=ms, cold_l2=cold_l2, silu=silu,
                torch_us=[torch_us[M] for M in ms], best_us=[per_m[M][0] for M in ms],
                per_m=[dict(M=M, split=per_m[M][2], cfg=dataclasses.asdict(per_m[M][1])) for M in ms],
                arith_means={f"{a[1][0]}/{a[1][1]}": a[0] for a in results})


def buckets_json(found: list[dict]) -> dict:
    """The sweep's winners as a HAYABUSA_BI_GEMM_BUCKETS file: per "NxK", [[largest M, the launch's tile fields],
    ...] with M's bucket (the previous measured M, this one], the last one's bound null (every larger M)."""
    out = {}
    for r in found:
        rows = []
        for i, p in enumerate(r["per_m"]):
            c = p["cfg"]
            tile = {k: c[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA")}
            tile["SPLIT_BELOW_TILES"] = bg.SPLIT if p["split"] else bg.UNSPLIT
            rows.append([p["M"] if i < len(r["per_m"]) - 1 else None, tile])     # null: every larger M
        out[f"{r['N']}x{r['K']}"] = rows
    return out


def print_bucket_sweep(best: list[dict]) -> None:
    print("# bucket sweep: per shape one arithmetic (BLOCK_K / CHUNK_K), the fastest tiles per M, us bi / torch")
    for r in best:
        per = " ".join(f"M{p['M']}:{b:.1f}/{t:.1f}({p['cfg']['BLOCK_M']}x{p['cfg']['BLOCK_N']} w{p['cfg']['num_warps']}"
                       f" s{p['cfg']['num_stages']}{' split' if p['split'] else ''}"
                       f"{' tma' if p['cfg'].get('TMA') else ''})"
                       for p, b, t in zip(r["per_m"], r["best_us"], r["torch_us"]))
        print(f"  {r['N']}x{r['K']} BK {r['BLOCK_K']} CHUNK {r['CHUNK_K']} mean {r['mean_ratio']:.2f}x: {per}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", type=Path, help="also write the rows (and the setup) to this JSON file")
    parser.add_argument("--m", default="1,8,32,256,2048", help="comma-separated batch sizes M")
    parser.add_argument("--models", default="qwen2.5-0.5b-shape,qwen2.5-7b-shape",
                        help="comma-separated bench/models shapes (Llama / Qwen2)")
    parser.add_argument("--layers", default="qkv,o,gate_up,down,lm_head", help="subset of the models' linears")
    parser.add_argument("--shapes", help="comma-separated NxK weight shapes instead of --models / --layers")
    parser.add_argument("--config", help=f"JSON per-shape config fields for this run (sets {bg.ENV_CONFIGS})")
    parser.add_argument("--sweep", action="store_true", help="also search a grid of configs per shape (slow)")
    parser.add_argument("--probe-tiles", action="store_true",
                        help="only check that a row's bits do not depend on tiles / warps / stages at fixed BLOCK_K "
                             "and CHUNK_K (bf16 and fp16), then exit")
    parser.add_argument("--bucket-sweep", action="store_true",
                        help="only search, per shape, one arithmetic and the fastest tiles per M (slow)")
    parser.add_argument("--keep-arith", action="store_true",
                        help="--bucket-sweep: only the shape's own BLOCK_K / CHUNK_K (8x faster)")
    parser.add_argument("--buckets-out", type=Path,
                        help=f"--bucket-sweep: also write the winners as a {bg.ENV_BUCKETS} file")
    parser.add_argument("--cold-l2", action="store_true",
                        help="--bucket-sweep: time every launch over copies of the weight larger than twice the L2 "
                             "(weights from HBM, as in the engine)")
    parser.add_argument("--gate-up-silu", action="store_true",
                        help="--bucket-sweep: time gate_up as the engine runs it (with its SiLU-and-mul)")
    parser.add_argument("--block-ks", default="64,128", help="--bucket-sweep: the BLOCK_K candidates")
    parser.add_argument("--splits", default="1,2,4,8", help="--bucket-sweep: how many K chunks to try")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_bi_gemm --device cuda needs a CUDA GPU (--device cpu: the Triton interpreter, tiny shapes)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench_bi_gemm --device cpu runs Triton's CPU interpreter, which must be on before Triton is "
                 "imported: run it as TRITON_INTERPRET=1 python benchmarks/kernels/bench_bi_gemm.py --device cpu ...")
    if args.config:
        os.environ[bg.ENV_CONFIGS] = args.config
    try:
        ms = [int(m) for m in args.m.split(",")]
        if not ms or min(ms) < 1:
            raise ValueError
    except ValueError:
        sys.exit(f"bench_bi_gemm: --m {args.m!r}: give row counts >= 1, comma-separated, e.g. --m 1,16,256,2048")
    if args.probe_tiles or args.bucket_sweep:
        found = []
        for _model, layer, N, K, has_bias in shapes_to_run(args):
            if args.probe_tiles:
                for dtype in (torch.bfloat16, torch.float16):
                    r = probe_tiles(N, K, has_bias, args.device, dtype)
                    print(f"# probe {N}x{K} {dtype}: {r['compared']} launches, {len(r['differ'])} differ, "
                          f"{r['failed']} did not run", flush=True)
                    found.append(r)
            else:
                found.append(bucket_sweep_shape(
                    N, K, has_bias, ms, args.device, args.keep_arith, args.cold_l2,
                    silu=args.gate_up_silu and layer == "gate_up",
                    block_ks=tuple(int(v) for v in args.block_ks.split(",")),
                    splits=tuple(int(v) for v in args.splits.split(","))))
                print_bucket_sweep(found[-1:])
                sys.stdout.flush()
            if args.json:                          # after every shape: a run cut short keeps what it measured
                args.json.write_text(json.dumps(found, indent=2))
            if args.buckets_out and not args.probe_tiles:
                args.buckets_out.write_text(json.dumps(buckets_json(found), indent=1))
        return
    rows, best = [], []
    for model, layer, N, K, has_bias in shapes_to_run(args):
        for M in ms:
            rows.append(bench_case(model, layer, N, K, has_bias, M, args.device))
        if args.sweep:
            best.append(sweep_shape(N, K, has_bias, ms, args.device))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    import triton

    print(f"# {name}  torch {torch.__version__}  triton {triton.__version__}  bf16, SMs "
          f"{bg.num_sms(torch.device(args.device))}")
    print_table(rows)
    if best:
        print_sweep(best)
    setup = dict(device=name, torch=torch.__version__, triton=triton.__version__, m=ms, config=args.config,
                 sms=bg.num_sms(torch.device(args.device)))
    out = dict(setup=setup, rows=rows, sweep=best)
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
