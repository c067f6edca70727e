"""Time a step's KV block copies between the device cache and its CPU tier (swap_space): the old per-layer copies
vs KVSwapper's one copy per run (strided, and gathered / scattered through one index_select / index_copy_).

    python benchmarks/kv_swap_bench.py [--device cuda|cpu] [--shapes q05,q7] [--runs 1,8,64] [--run-len 1,16]
                                       [--iters N] [--threads N] [--json FILE]

A model-shaped KV buffer [L, 2, N, block_size, H_kv, D] (bf16, blocks of 16; q05: Qwen2.5-0.5B's 24 layers,
2 KV heads, head dim 64; q7: Qwen2.5-7B's 28 layers, 4 KV heads, 128). A step swaps out R runs of n consecutive
blocks (the runs scattered over the device cache, one block apart, into scattered CPU blocks), or swaps them back
in. Paths:
  per-layer      the old KVSwapper: a layer-major CPU tier [L, 2, N_cpu, ...], 2 x L copies per run (kept here
                 only as the reference);
  strided        KVSwapper (gather=False, the default): a block-major CPU tier [N_cpu, L, 2, ...], one copy per run whose
                 device side is strided (on CUDA torch makes it contiguous in one kernel, then one memcpy);
  gather         KVSwapper(gather=True): one index_select of all the step's blocks, then one
                 contiguous copy per run (swap-in: one copy per run, then one index_copy_).
Per row: the copies issued (copy_ calls between the tiers), host us (the Python call, median), step us (until
the copies are done: CUDA events on the compute stream; on CPU the same as host us), GB/s (the step's KV bytes /
step time; each block's bytes cross the bus once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from hayabusa.worker.kv_swap import KVSwapper, block_runs  # noqa: E402

SHAPES = {"q05": (24, 2, 64), "q7": (28, 4, 128)}   # layers, KV heads, head dim
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


class PerLayerSwapper:
    """The old KVSwapper (before issue #20's fix): CPU tier [L, 2, N_cpu, block_size, H, D], per run of blocks one
    copy per layer for K and one for V. Reference for the benchmark only."""

    def __init__(self, buf: torch.Tensor, num_blocks: int) -> None:
        self.kv = [(buf[i, 0], buf[i, 1]) for i in range(buf.shape[0])]
        self.cuda = buf.device.type == "cuda"
        self.cpu = torch.empty((buf.shape[0], 2, num_blocks, *buf.shape[3:]), dtype=buf.dtype, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(buf.device) if self.cuda else None
        self.num_copies = 0

    def execute(self, swap_out, swap_in) -> None:
        if not self.cuda:
            return self._copy(swap_out, swap_in)
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(swap_out, swap_in)
        compute.wait_stream(self.stream)

    def _copy(self, swap_out, swap_in) -> None:
        nb = self.cuda
        for src, dst, n in block_runs(swap_out):
            for layer, (k, v) in enumerate(self.kv):
                self.cpu[layer, 0, dst:dst + n].copy_(k[src:src + n], non_blocking=nb)
                self.cpu[layer, 1, dst:dst + n].copy_(v[src:src + n], non_blocking=nb)
                self.num_copies += 2
        for src, dst, n in block_runs(swap_in):
            for layer, (k, v) in enumerate(self.kv):
                k[dst:dst + n].copy_(self.cpu[layer, 0, src:src + n], non_blocking=nb)
                v[dst:dst + n].copy_(self.cpu[layer, 1, src:src + n], non_blocking=nb)
                self.num_copies += 2


def step_pairs(runs: int, run_len: int, num_blocks: int, seed: int) -> list[tuple[int, int]]:
    """(device block, CPU block) pairs: `runs` runs of `run_len` consecutive ids, the runs at scattered places
    (never adjacent, so they stay separate runs) on both sides."""
    gen = torch.Generator().manual_seed(seed)
    slots = num_blocks // (run_len + 1)
    assert slots >= runs, (num_blocks, runs, run_len)
    dev = torch.randperm(slots, generator=gen)[:runs].tolist()
    cpu = torch.randperm(slots, generator=gen)[:runs].tolist()
    return [(d * (run_len + 1) + j, c * (run_len + 1) + j) for d, c in zip(dev, cpu) for j in range(run_len)]


def time_step(swapper, swap_out, swap_in, iters: int, cuda: bool) -> tuple[float, float]:
    """(median host us, median step us) of `iters` calls after 2 warm-up calls."""
    for _ in range(2):
        swapper.execute(swap_out, swap_in)
    if cuda:
        torch.cuda.synchronize()
    host, step = [], []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        swapper.execute(swap_out, swap_in)
        host.append((time.perf_counter() - t0) * 1e6)
        if cuda:
            end.record()
            end.synchronize()
            step.append(start.elapsed_time(end) * 1e3)
        else:
            step.append(host[-1])
    return statistics.median(host), statistics.median(step)


def bench_shape(name: str, device: torch.device, runs_list: list[int], lens: list[int], iters: int) -> list[dict]:
    L, H, D = SHAPES[name]
    need = max(r * (n + 1) for r in runs_list for n in lens) + 1
    buf = torch.randn((L, 2, need, BLOCK_SIZE, H, D), dtype=DTYPE, device=device)
    block_bytes = buf[:, :, 0].numel() * buf.element_size()
    paths = {"per-layer": PerLayerSwapper(buf, need), "strided": KVSwapper([buf], need, gather=False),
             "gather": KVSwapper([buf], need, gather=True)}
    rows = []
    for runs in runs_list:
        for n in lens:
            pairs = step_pairs(runs, n, need, seed=runs * 100 + n)
            back = [(c, d) for d, c in pairs]
            for op, (out, inn) in (("out", (pairs, [])), ("in", ([], back))):
                if op == "in":   # the CPU blocks hold something (the first swap-out of every path wrote them)
                    for sw in paths.values():
                        sw.execute(pairs, [])
                for path, sw in paths.items():
                    before = sw.num_copies
                    sw.execute(out, inn)
                    copies = sw.num_copies - before
                    host_us, step_us = time_step(sw, out, inn, iters, device.type == "cuda")
                    nbytes = runs * n * block_bytes
                    rows.append(dict(shape=name, device=device.type, op=op, runs=runs, run_len=n, blocks=runs * n,
                                     path=path, copies=copies, host_us=round(host_us, 1), step_us=round(step_us, 1),
                                     gb_per_s=round(nbytes / step_us / 1e3, 2), mib=round(nbytes / 2**20, 2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="q05,q7")
    ap.add_argument("--runs", default="1,8,64")
    ap.add_argument("--run-len", default="1,16")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per row (default 20 on CUDA, 5 on CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    iters = args.iters or (20 if device.type == "cuda" else 5)
    rows = []
    for name in args.shapes.split(","):
        rows += bench_shape(name, device, [int(x) for x in args.runs.split(",")],
                            [int(x) for x in args.run_len.split(",")], iters)
    print(f"{'shape':5} {'op':3} {'runs':>4} {'len':>3} {'MiB':>7} {'path':10} {'copies':>6} {'host us':>9} "
          f"{'step us':>9} {'GB/s':>7}")
    for r in rows:
        print(f"{r['shape']:5} {r['op']:3} {r['runs']:>4} {r['run_len']:>3} {r['mib']:>7.2f} {r['path']:10} "
              f"{r['copies']:>6} {r['host_us']:>9.1f} {r['step_us']:>9.1f} {r['gb_per_s']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                               "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
