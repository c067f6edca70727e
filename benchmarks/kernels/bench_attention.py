"""Time paged_attention (decode, prefill), store_kv and RoPE + store_kv on a CUDA GPU; print a table with GB/s.

    python benchmarks/kernels/bench_attention.py [--json FILE] [--dtype bf16] [--block-size 16]

Shapes are Qwen2.5-7B's (H=28, H_kv=4, D=128). GB/s counts the bytes a perfect kernel must move: every K/V row a
request attends to, read once, plus q read and out written (store_kv: k/v read and written). Prefill also reports
TFLOP/s (causal: 4 * D * sum over queries of visible keys) and the dense torch SDPA time for the same batch.
RoPE + KV-cache write, per decode step of one layer at batch 1 / 64 / 256, on Qwen2.5-0.5B's (H=14, H_kv=2, D=64)
and -7B's shapes, model-dtype and fp8 e4m3 caches: 'rope+store_kv (2 launches)' is rotary_embedding then store_kv,
'rope_and_store_kv (fused)' the one-launch kernel the Triton backend uses; both rows count the fused kernel's bytes
(q read and written, k and v read, the cache rows written), so their GB/s compare directly.
GB/s and TFLOP/s use the time of a CUDA-graph replay (as the engine runs decode; it also checks that the launch
captures); 'eager us' adds the Python launch cost. Needs CUDA (the Triton interpreter would take hours).

    python benchmarks/kernels/bench_attention.py --verify [--json FILE]

--verify (issue #21): speculative decoding's verify steps, q_len 5 (k = 4) per request, R in 1, 4, 16, contexts
256 / 700 / 2048 / 4096 keys, SmolLM2-135M's heads (9 q / 3 kv, D 64) and Qwen2.5-7B's (28 / 4, D 128): the old
choice (prefill tile, no split-KV: SHORT_QUERY_SPLIT off) vs the new one (short-query tile, split-KV), CUDA-graph
replay µs and the speedup; about 30 s on an H200.

    python benchmarks/kernels/bench_attention.py --bi-tiles [--json FILE]

--bi-tiles (issue #23): batch-invariant mode runs one tile for prefill and decode (``batch_invariant_tile_config``:
64 query rows x 64 keys). Decode steps with smaller tiles would be cheaper, but may keep the mode's bits only if a
row's arithmetic does not depend on BLOCK_M or num_warps. For Qwen2.5-0.5B's and -7B's heads, decode batches of
mixed context lengths: each candidate tile's output against the mode's own, bit for bit (and the largest
difference), and its CUDA-graph replay µs next to the mode's and the default decode kernel's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
try:
    import triton
    import triton.testing
except ImportError:  # a CPU-only install: the engine runs plain torch there, and there is no kernel to time
    triton = None
NEEDS_GPU = (f"{sys.argv[0]}: times the Triton attention kernels on a CUDA GPU; this machine has no CUDA device (or "
             "no Triton), and the CPU path runs plain torch, so there is nothing to time here. Run it on a GPU "
             "machine (a CUDA build of torch brings Triton).")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing

from hayabusa.kernels import paged_attention as pa  # noqa: E402
from hayabusa.kernels.paged_attention import paged_attention  # noqa: E402
from hayabusa.kernels.rope_store_kv import rope_and_store_kv  # noqa: E402
from hayabusa.kernels.rotary import rotary_embedding  # noqa: E402
from hayabusa.kernels.store_kv import store_kv  # noqa: E402

H, H_KV, D = 28, 4, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_batch(q_lens: list[int], seq_lens: list[int], block_size: int, dtype: torch.dtype, seed: int = 0,
               heads: tuple[int, int, int] = (H, H_KV, D)) -> dict:
    """Paged-attention arguments with a shuffled block table (blocks of one request are scattered); heads are
    (H, H_kv, D)."""
    H, H_KV, D = heads  # noqa: N806
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    block_table = torch.zeros(len(q_lens), max(need), dtype=torch.int32, device="cuda")
    off = 0
    for r, n in enumerate(need):
        block_table[r, :n] = perm[off:off + n]
        off += n
    shape = (num_blocks, block_size, H_KV, D)
    T = sum(q_lens)
    qsl = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    return dict(
        q=torch.randn(T, H, D, device="cuda", dtype=dtype, generator=gen),
        k_cache=torch.randn(shape, device="cuda", dtype=dtype, generator=gen),
        v_cache=torch.randn(shape, device="cuda", dtype=dtype, generator=gen),
        out=torch.empty(T, H, D, device="cuda", dtype=dtype),
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=block_table, scale=D ** -0.5, max_query_len=max(q_lens))


def attention_bytes(q_lens: list[int], seq_lens: list[int], elem: int) -> int:
    kv = sum(seq_lens) * H_KV * D * 2 * elem
    return kv + sum(q_lens) * H * D * 2 * elem


def causal_flops(q_lens: list[int], seq_lens: list[int]) -> int:
    visible = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))
    return 4 * H * D * visible


def time_ms(fn) -> tuple[float, float]:
    """(CUDA-graph replay ms, eager ms), medians."""
    graph = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return graph, eager


def row(op: str, case: str, times: tuple[float, float], nbytes: int, flops: int) -> dict:
    ms, eager_ms = times
    return dict(op=op, case=case, ms=ms, eager_ms=eager_ms, gb_s=nbytes / ms / 1e6, tflop_s=flops / ms / 1e9)


def bench_decode(R: int, ctx: int, block_size: int, dtype: torch.dtype, splits: int | None) -> dict:
    q_lens, seq_lens = [1] * R, [ctx] * R
    batch = make_batch(q_lens, seq_lens, block_size, dtype)
    times = time_ms(lambda: paged_attention(**batch, num_kv_splits=splits))
    name = f"decode R={R} ctx={ctx}" + (f" splits={splits}" if splits else "")
    return row("paged_attention", name, times, attention_bytes(q_lens, seq_lens, batch["q"].element_size()),
               causal_flops(q_lens, seq_lens))


def bench_prefill(R: int, q_len: int, block_size: int, dtype: torch.dtype) -> list[dict]:
    q_lens, seq_lens = [q_len] * R, [q_len] * R
    batch = make_batch(q_lens, seq_lens, block_size, dtype)
    flops, nbytes = causal_flops(q_lens, seq_lens), attention_bytes(q_lens, seq_lens, batch["q"].element_size())
    rows = [row("paged_attention", f"prefill R={R} x {q_len}", time_ms(lambda: paged_attention(**batch)),
                nbytes, flops)]
    q = batch["q"].view(R, q_len, H, D).transpose(1, 2)            # [R, H, q_len, D]
    k = torch.randn(R, H_KV, q_len, D, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    rows.append(row("torch_sdpa (dense, baseline)", f"prefill R={R} x {q_len}", time_ms(sdpa), nbytes, flops))
    return rows


def bench_store_kv(T: int, block_size: int, dtype: torch.dtype) -> dict:
    num_blocks = -(-T // block_size) * 2
    qkv = torch.randn(T, (H + 2 * H_KV) * D, device="cuda", dtype=dtype)  # k, v are strided views, as in a model
    k = qkv[:, H * D:(H + H_KV) * D].view(T, H_KV, D)
    v = qkv[:, (H + H_KV) * D:].view(T, H_KV, D)
    k_cache = torch.empty(num_blocks, block_size, H_KV, D, device="cuda", dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:T]
    nbytes = 2 * 2 * T * H_KV * D * k.element_size()  # k and v, each read once and written once
    return row("store_kv", f"T={T}", time_ms(lambda: store_kv(k, v, k_cache, v_cache, slots)), nbytes, 0)


ROPE_SHAPES = {"0.5b": (14, 2, 64), "7b": (28, 4, 128)}  # (H, H_kv, D) of Qwen2.5-0.5B and -7B


def bench_rope_store_kv(T: int, model: str, block_size: int, dtype: torch.dtype,
                        cache_dtype: torch.dtype) -> list[dict]:
    """One layer's RoPE + KV-cache write for T decode tokens: two launches vs the fused one."""
    h, h_kv, d = ROPE_SHAPES[model]
    max_pos = 4096
    qkv = torch.randn(T, (h + 2 * h_kv) * d, device="cuda", dtype=dtype)  # views into a fused qkv, as in a model
    q = qkv[:, :h * d].view(T, h, d)
    k = qkv[:, h * d:(h + h_kv) * d].view(T, h_kv, d)
    v = qkv[:, (h + h_kv) * d:].view(T, h_kv, d)
    freqs = torch.arange(max_pos, device="cuda").float()[:, None] * (
        1e6 ** -(torch.arange(0, d, 2, device="cuda").float() / d))[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.randint(0, max_pos, (T,), device="cuda")
    num_blocks = -(-T // block_size) * 2
    k_cache = torch.zeros(num_blocks, block_size, h_kv, d, device="cuda", dtype=dtype).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:T]
    scale = torch.ones(1, device="cuda")
    elem, cache_elem = qkv.element_size(), k_cache.element_size()
    nbytes = T * (2 * h * d * elem + 2 * h_kv * d * elem + 2 * h_kv * d * cache_elem)

    def sequential():
        rotary_embedding(positions, q, k, cos, sin)
        store_kv(k, v, k_cache, v_cache, slots, scale, scale)

    def fused():
        rope_and_store_kv(positions, q, k, v, k_cache, v_cache, slots, cos, sin, scale, scale)

    case = f"{model} T={T} cache={str(cache_dtype).removeprefix('torch.')}"
    return [row("rope+store_kv (2 launches)", case, time_ms(sequential), nbytes, 0),
            row("rope_and_store_kv (fused)", case, time_ms(fused), nbytes, 0)]


VERIFY_HEADS = {"smollm2": (9, 3, 64), "qwen2.5-7b": (28, 4, 128)}  # (H, H_kv, D)


def bench_verify(block_size: int, dtype: torch.dtype, q_len: int = 5) -> list[dict]:
    """Verify steps: the old choice (prefill tile, one pass) vs the current one (``is_short_query``: the
    short-query tile with split-KV where it measured faster, else the old choice; splits = 1 marks the latter)."""
    rows = []
    for model, heads in VERIFY_HEADS.items():
        for R in (1, 4, 16):
            for ctx in (256, 700, 2048, 4096):
                batch = make_batch([q_len] * R, [ctx] * R, block_size, dtype, heads=heads)
                us = {}
                for on in (False, True):
                    pa.SHORT_QUERY_SPLIT = on
                    us[on] = 1e3 * triton.testing.do_bench_cudagraph(lambda: paged_attention(**batch), rep=20,
                                                                      return_mode="median")
                pa.SHORT_QUERY_SPLIT = True
                group = heads[0] // heads[1]
                splits = pa._auto_num_splits(R * heads[1], q_len, torch.device("cuda"), True) \
                    if pa.is_short_query(q_len, group, R * heads[1]) else 1
                rows.append(dict(model=model, R=R, ctx=ctx, q_len=q_len, old_us=us[False], new_us=us[True],
                                 splits=splits, speedup=us[False] / us[True]))
    return rows


BI_TILE_CANDIDATES = [  # (BLOCK_M, TILE_N, num_warps, num_stages); TILE_N 128 is the control: it must differ
    (16, 64, 1, 2), (16, 64, 2, 2), (16, 64, 4, 2), (32, 64, 2, 2), (32, 64, 4, 2), (64, 64, 8, 2),
    (64, 64, 4, 3), (16, 128, 4, 2)]
BI_TILE_QUICK_CANDIDATES = [(16, 64, 1, 2), (16, 64, 2, 2)]   # --quick: one- and two-warp 16-row tiles
BI_TILE_BATCHES = ((64, 20, 2000), (128, 300, 900), (192, 300, 900), (256, 300, 900))  # (requests, context range)


def bench_bi_tiles(block_size: int, dtype: torch.dtype, quick: bool = False) -> list[dict]:
    """Batch-invariant decode: candidate tiles' bits and µs against the mode's tile (see --bi-tiles); ``quick``:
    BI_TILE_QUICK_CANDIDATES instead of BI_TILE_CANDIDATES (the engine's own choice is timed either way)."""
    rows = []
    mode_cfg = pa.batch_invariant_tile_config
    pinned = lambda group, d_pad, elem, *_: mode_cfg(group, d_pad, elem)  # noqa: E731  the mode's one tile
    try:
        for model, heads in ROPE_SHAPES.items():
            group = heads[0] // heads[1]
            d_pad = max(16, triton.next_power_of_2(heads[2]))
            for R, lo, hi in BI_TILE_BATCHES:
                gen = torch.Generator().manual_seed(R)
                ctx = torch.randint(lo, hi, (R,), generator=gen).tolist()
                batch = make_batch([1] * R, ctx, block_size, dtype, heads=heads)
                pa.batch_invariant_tile_config = pinned
                paged_attention(**batch, batch_invariant=True)
                ref = batch["out"].clone()
                mode_us = 1e3 * triton.testing.do_bench_cudagraph(
                    lambda: paged_attention(**batch, batch_invariant=True), rep=20, return_mode="median")
                default_us = 1e3 * triton.testing.do_bench_cudagraph(
                    lambda: paged_attention(**batch), rep=20, return_mode="median")
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                engine = mode_cfg(group, d_pad, batch["q"].element_size(), R * heads[1], sms)
                for cand in [*(BI_TILE_QUICK_CANDIDATES if quick else BI_TILE_CANDIDATES), "engine"]:
                    if cand == "engine":   # what paged_attention picks for this step (batch_invariant_tile_config)
                        cfg = dict(engine)
                    else:
                        block_m, tile_n, warps, stages = cand
                        cfg = dict(BLOCK_M=max(block_m, triton.next_power_of_2(group)), TILE_N=tile_n,
                                   num_warps=warps, num_stages=stages)
                        cfg["BLOCK_Q"] = cfg["BLOCK_M"] // group
                    pa.batch_invariant_tile_config = lambda *a, c=cfg: dict(c)
                    batch["out"].zero_()
                    paged_attention(**batch, batch_invariant=True)
                    out = batch["out"].clone()
                    us = 1e3 * triton.testing.do_bench_cudagraph(
                        lambda: paged_attention(**batch, batch_invariant=True), rep=20, return_mode="median")
                    rows.append(dict(model=model, R=R, ctx=f"{lo}-{hi}",
                                     mode_cfg=mode_cfg(group, d_pad, batch["q"].element_size()),
                                     cfg=cfg, engine=cand == "engine", bits_equal=bool(torch.equal(out, ref)),
                                     rows_differ=int((out != ref).any(-1).any(-1).sum()),
                                     max_abs_diff=float((out.float() - ref.float()).abs().max()),
                                     us=us, mode_us=mode_us, default_us=default_us))
    finally:
        pa.batch_invariant_tile_config = mode_cfg
    return rows


def print_bi_tiles_table(rows: list[dict]) -> None:
    print(f"{'heads':<5} {'R':>4} {'ctx':>9} {'M x N / warps / stages':<24} {'bits':>5} {'rows!=':>6} "
          f"{'max diff':>9} {'us':>7} {'mode us':>8} {'default':>8}")
    for r in rows:
        c = r["cfg"]
        tile = f"{c['BLOCK_M']} x {c['TILE_N']} / {c['num_warps']} / {c['num_stages']}"
        tile += " (engine)" if r.get("engine") else ""
        print(f"{r['model']:<5} {r['R']:>4} {r['ctx']:>9} {tile:<24} {'same' if r['bits_equal'] else 'DIFF':>5} "
              f"{r['rows_differ']:>6} {r['max_abs_diff']:>9.2e} {r['us']:>7.1f} {r['mode_us']:>8.1f} "
              f"{r['default_us']:>8.1f}")


def print_verify_table(rows: list[dict]) -> None:
    print(f"{'heads':<11} {'R':>3} {'ctx':>5} {'q_len':>5} {'old us':>8} {'new us':>8} {'splits':>6} {'speedup':>8}")
    for r in rows:
        print(f"{r['model']:<11} {r['R']:>3} {r['ctx']:>5} {r['q_len']:>5} {r['old_us']:>8.1f} {r['new_us']:>8.1f} "
              f"{r['splits']:>6} {r['speedup']:>7.2f}x")


def run_all(args) -> list[dict]:
    dtype = DTYPES[args.dtype]
    rows = []
    for R in (1, 64, 256):
        for ctx in (512, 2048):
            rows.append(bench_decode(R, ctx, args.block_size, dtype, None))
    for ctx in (4096, 16384):  # the split-KV ("flash decoding") path vs one pass
        for splits in (None, 1):
            rows.append(bench_decode(1, ctx, args.block_size, dtype, splits))
    rows += bench_prefill(16, 512, args.block_size, dtype)
    for T in (256, 8192):
        rows.append(bench_store_kv(T, args.block_size, dtype))
    for model in ROPE_SHAPES:
        for cache_dtype in (dtype, torch.float8_e4m3fn):
            for T in (1, 64, 256):
                rows += bench_rope_store_kv(T, model, args.block_size, dtype, cache_dtype)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'op':<30} {'case':<36} {'graph us':>9} {'eager us':>9} {'GB/s':>8} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['op']:<30} {r['case']:<36} {r['ms'] * 1e3:>9.1f} {r['eager_ms'] * 1e3:>9.1f} "
              f"{r['gb_s']:>8.1f} {r['tflop_s']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the rows (and the setup) to this JSON file")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--verify", action="store_true",
                        help="only the verify-step table (q_len 5): old choice vs short-query split-KV")
    parser.add_argument("--bi-tiles", action="store_true",
                        help="only batch-invariant decode: candidate tiles' bits and µs against the mode's tile")
    parser.add_argument("--quick", action="store_true", help="--bi-tiles with the one- and two-warp 16-row tiles only")
    args = parser.parse_args()
    if triton is None or not torch.cuda.is_available():
        sys.exit(NEEDS_GPU)
    if args.bi_tiles:
        rows = bench_bi_tiles(args.block_size, DTYPES[args.dtype], args.quick)
        print(f"# {torch.cuda.get_device_name()}  triton {triton.__version__}  {args.dtype} "
              f"block_size={args.block_size}  batch-invariant decode tiles (CUDA-graph replay, median)")
        print_bi_tiles_table(rows)
        if args.json:
            args.json.write_text(json.dumps(dict(setup=dict(device=torch.cuda.get_device_name(), dtype=args.dtype,
                                                            block_size=args.block_size), rows=rows), indent=2))
        return
    if args.verify:
        t0 = time.perf_counter()
        rows = bench_verify(args.block_size, DTYPES[args.dtype])
        print(f"# {torch.cuda.get_device_name()}  triton {triton.__version__}  {args.dtype} "
              f"block_size={args.block_size}  verify steps (CUDA-graph replay, median)")
        print_verify_table(rows)
        print(f"# {time.perf_counter() - t0:.1f} s")
        if args.json:
            args.json.write_text(json.dumps(dict(setup=dict(device=torch.cuda.get_device_name(), dtype=args.dtype,
                                                            block_size=args.block_size), rows=rows), indent=2))
        return
    rows = run_all(args)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"H={H} H_kv={H_KV} D={D} {args.dtype} block_size={args.block_size}")
    print_table(rows)
    if args.json:
        setup = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                     H=H, H_kv=H_KV, D=D, dtype=args.dtype, block_size=args.block_size)
        args.json.write_text(json.dumps(dict(setup=setup, rows=rows), indent=2))


if __name__ == "__main__":
    main()
