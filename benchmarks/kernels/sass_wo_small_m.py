"""What kernels/wo_small_m.py's int4 launches compile to on sm_90, without a GPU: Triton's front end and its bundled
ptxas / nvdisasm build each launch for an H100 / H200 target, and this prints the main loop's SASS per K tile: the
instructions one warp issues, the largest kinds, the MMA instructions (HMMA: mma.sync; HGMMA: warpgroup MMA) and the
waits on them, and the shared memory a block takes.

    python benchmarks/kernels/sass_wo_small_m.py                       # every int4 kind at 16 / 64 / 128 rows
    python benchmarks/kernels/sass_wo_small_m.py --kinds lop3j,join --rows 64:4,128:8 --json out.json

Counts depend on the Triton version (BENCHMARKS.md's were taken with Triton 3.6.0, the device's; a newer Triton
compiles the same launch to other counts). Static counts, not timings: a loop body with fewer instructions issues
faster, but latency, occupancy and the overlap of dequantization with the MMAs decide the time, which only
`bench_quant_linear.py --small-m` measures (on a GPU). Pointer and size arguments are compiled as the JIT
specializes them for 7B shapes (divisible by 16); BLOCK_N and BLOCK_K 128, G 128, bf16 (--fp16: fp16). Needs a
Triton with the NVIDIA backend (ptxas, nvdisasm); no CUDA device."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # compile for the GPU target even where tests set the interpreter

_OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def compile_launch(kind: str, block_m: int, num_warps: int, num_stages: int = 3, fp16: bool = False):
    """The compiled int4 _wo_small_m_kernel for one launch (no split-K, bias on), target sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import hayabusa.kernels.wo_small_m as wo

    slab, lop3, scale_w = wo.KIND_FLAGS[kind]
    fn = wo._wo_small_m_kernel
    dt = "*fp16" if fp16 else "*bf16"
    sig = {"x_ptr": dt, "qw_ptr": "*i32", "scales_ptr": dt, "zeros_ptr": dt, "bias_ptr": dt, "out_ptr": dt,
           "part_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
           "splits": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
    consts = dict(INT4=True, SLAB=slab, GROUP_SIZE=128, MAGIC=0x6400 if fp16 else 0x4300, BY_HAND=False,
                  HAS_BIAS=True, SPLIT=False, FUSED_REDUCE=False, EVEN_K=True, DOT_FP32=False, BLOCK_M=block_m,
                  BLOCK_N=128, BLOCK_K=128, PDL=False, LOP3=lop3, SCALE_W=scale_w)
    sig.update({k: "constexpr" for k in consts})
    div16 = ["x_ptr", "qw_ptr", "scales_ptr", "zeros_ptr", "bias_ptr", "out_ptr", "part_ptr", "lock_ptr", "N", "K",
             "k_per_split", "stride_xm", "stride_wn", "stride_om"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def disassemble(kernel) -> str:
    """The SASS of a compiled kernel, by the nvdisasm bundled with Triton."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The lines of the longest backward branch's body: the K loop (software-pipelined, so one K tile's work)."""
    lines = sass.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"\.L_x_\d+:", line)}
    best = (0, -1)
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    return lines[best[0]:best[1] + 1]


def loop_report(kind: str, block_m: int, num_warps: int, num_stages: int = 3, fp16: bool = False) -> dict:
    """One launch's main-loop counts: instructions a warp issues per K tile, by kind (full SASS names), the MMA
    instructions and the waits on warpgroup MMAs, and the block's shared memory (bytes)."""
    k = compile_launch(kind, block_m, num_warps, num_stages, fp16)
    body = main_loop(disassemble(k))
    ops = collections.Counter(m.group(2) for m in map(_OP.match, body) if m)
    text = "\n".join(body)
    return dict(kind=kind, block_m=block_m, num_warps=num_warps, num_stages=num_stages, fp16=fp16,
                smem=k.metadata.shared, loop_instructions=sum(ops.values()),
                mma=sum(v for op, v in ops.items() if op.startswith(("HMMA", "HGMMA"))),
                wgmma_waits=len(re.findall(r"WARPGROUP\.DEPBAR", text)), ops=dict(ops.most_common()))


def parse_rows(spec: str) -> tuple[int, int]:
    """One --rows entry "BLOCK_M:num_warps" -> (BLOCK_M, num_warps): powers of two, BLOCK_M 16-256, warps 1-16;
    anything else exits naming the entry."""
    parts = spec.split(":")
    ok = len(parts) == 2 and all(p.strip().isdigit() for p in parts)
    bm, warps = (int(p) for p in parts) if ok else (0, 0)
    if not (ok and 16 <= bm <= 256 and 1 <= warps <= 16 and not bm & (bm - 1) and not warps & (warps - 1)):
        sys.exit(f"--rows: {spec!r} is not BLOCK_M:num_warps with powers of two, BLOCK_M 16-256 and num_warps 1-16 "
                 "(e.g. 64:4)")
    return bm, warps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=None,
                        help="comma-separated int4 kinds of wo_small_m.WO_KINDS (default all: slab, join, lop3, lop3j)")
    parser.add_argument("--rows", default="16:8,64:4,128:8",
                        help="comma-separated BLOCK_M:num_warps launches (default 16:8,64:4,128:8)")
    parser.add_argument("--stages", type=int, default=3, help="num_stages, >= 1 (default 3)")
    parser.add_argument("--fp16", action="store_true", help="fp16 x (default bf16)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        sys.exit("this Triton has no NVIDIA backend (ptxas, nvdisasm): install the triton wheel from PyPI")
    from hayabusa.kernels.wo_small_m import WO_KINDS

    kinds = list(WO_KINDS["int4"]) if args.kinds is None else args.kinds.split(",")
    bad = [k for k in kinds if k not in WO_KINDS["int4"]]
    if bad:
        sys.exit(f"--kinds: unknown {bad}; choose from {list(WO_KINDS['int4'])}")
    launches = [parse_rows(spec) for spec in args.rows.split(",")]
    if args.stages < 1:
        sys.exit(f"--stages must be >= 1, got {args.stages}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        sys.exit(f"--json {args.json}: no such directory")
    rows = []
    print(f"{'kind':<6} {'BM':>4} {'warps':>5} {'smem KB':>7} {'loop instr':>10} {'MMA':>4} {'waits':>5}  "
          "largest kinds")
    for bm, warps in launches:
        for kind in kinds:
            r = loop_report(kind, bm, warps, args.stages, args.fp16)
            rows.append(r)
            top = ", ".join(f"{op} {n}" for op, n in list(r["ops"].items())[:6])
            print(f"{kind:<6} {bm:>4} {warps:>5} {r['smem'] / 1024:>7.0f} {r['loop_instructions']:>10} {r['mma']:>4} "
                  f"{r['wgmma_waits']:>5}  {top}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
