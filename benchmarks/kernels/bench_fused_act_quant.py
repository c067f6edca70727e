"""Time W8A8 linears with the activation quantized by its producer (kernels/fused_act_quant.py) against the separate
quantizer launch it replaces, on a CUDA GPU (issues #24 / #25); print a table and optionally JSON.

    python benchmarks/kernels/bench_fused_act_quant.py [--m 1,16,64,256] [--kinds int8,fp8] [--json FILE]

Cases are Qwen2.5-7B's (hidden 3584, intermediate 18944, bf16): RMSNorm with the residual add feeding qkv
(K 3584, N 4608) and gate_up (K 3584, N 37888); SiLU-and-mul feeding down (K 18944, N 3584). Per case, medians of
CUDA-graph replays (how decode runs; also checks that the launches capture), in us:
  sep_q     producer kernel + per_token_quant_{int8,fp8} (two launches)
  fused_q   the fused producer (one launch)
  sep       sep_q + the GEMM (int8_scaled_mm / torch._scaled_mm; the engine's path without the fusion)
  fused     fused_q + the same GEMM (the engine's path with HAYABUSA_FUSED_ACT_QUANT=1)
  saved     sep - fused, and 'x' = sep / fused.
Before timing, each case checks that both paths give the same quantized bytes and scales (bit for bit) and the
same GEMM output. FP8 rows up to FP8_SMALL_M_MAX also time the small-M kernel's two engine forms (each with
its producer): the plain norm / SiLU-and-mul + fp8_small_m_linear quantizing x in every program, against the fused
producer + its XQ launch on the quantized rows. fp8 needs compute capability >= 8.9 (skipped below). About 30 s
on an H200.
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

from hayabusa.kernels.activation import silu_and_mul  # noqa: E402
from hayabusa.kernels.fp8_gemv import FP8_SMALL_M_MAX, fp8_small_m_linear  # noqa: E402
from hayabusa.kernels.fp8_quant import per_token_quant_fp8, per_token_quant_fp8_ref  # noqa: E402
from hayabusa.kernels.fused_act_quant import rms_norm_quant, silu_and_mul_quant  # noqa: E402
from hayabusa.kernels.fused_norm import fused_add_rms_norm  # noqa: E402
from hayabusa.kernels.int8_gemm import int8_scaled_mm  # noqa: E402
from hayabusa.kernels.int8_quant import per_token_quant_int8, per_token_quant_int8_ref  # noqa: E402

HIDDEN, INTER = 3584, 18944
CASES = [("norm", "qkv", HIDDEN, 4608), ("norm", "gate_up", HIDDEN, 2 * INTER), ("silu", "down", INTER, HIDDEN)]


def _gemm(kind: str, N: int, K: int):
    """A random quantized weight and the GEMM that consumes (xq, s): int8_scaled_mm or torch._scaled_mm; for fp8
    also the small-M kernel's two forms, on the plain x (quantizing inside) and on (xq, s) (its XQ launch)."""
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    if kind == "int8":
        wq, sw = per_token_quant_int8_ref(w)
        sw = sw.view(-1).contiguous()
        return lambda xq, s: int8_scaled_mm(xq, s, wq, sw, None, torch.bfloat16), None, None
    from hayabusa.quantization.fp8 import fp8_matmul_cuda

    wq, sw = per_token_quant_fp8_ref(w)
    sw = sw.view(1, -1).contiguous()
    return (lambda xq, s: fp8_matmul_cuda(xq, s, wq.t(), sw, torch.bfloat16),
            lambda x: fp8_small_m_linear(x, wq, sw.view(-1)),
            lambda xq, s: fp8_small_m_linear(xq, wq, sw.view(-1), x_scale=s))


def case(producer: str, layer: str, K: int, N: int, kind: str, M: int) -> dict:
    quant = per_token_quant_int8 if kind == "int8" else per_token_quant_fp8
    g = torch.Generator(device="cuda").manual_seed(M)
    if producer == "norm":
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        res = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16()

        def plain():
            return fused_add_rms_norm(x, res, w, 1e-6)[0]

        def sep_q():
            return quant(plain())

        def fused_q():
            xq, s, _ = rms_norm_quant(x, res, w, 1e-6, kind)
            return xq, s
    else:
        h = (torch.randn(M, 2 * K, device="cuda", generator=g) * 2).bfloat16()

        def plain():
            return silu_and_mul(h)

        def sep_q():
            return quant(plain())

        def fused_q():
            return silu_and_mul_quant(h, kind)
    gemm, gemv_plain, gemv_xq = _gemm(kind, N, K)
    (a, sa), (b, sb) = sep_q(), fused_q()
    same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
    same = same and torch.equal(gemm(a, sa), gemm(b, sb))
    fns = {"sep_q": sep_q, "fused_q": fused_q, "sep": lambda: gemm(*sep_q()), "fused": lambda: gemm(*fused_q())}
    if gemv_plain is not None and M <= FP8_SMALL_M_MAX:
        # the engine's small-M FP8 forms: plain producer + the GEMV quantizing x in every program, against the
        # fused producer + the GEMV's XQ launch (FP8Q_TABLE); the same e4m3 inputs, so close outputs
        torch.testing.assert_close(gemv_plain(plain()), gemv_xq(b, sb), atol=0.05, rtol=0.02)
        fns.update(prod=plain, gemv_plain=lambda: gemv_plain(plain()), gemv_xq=lambda: gemv_xq(*fused_q()))
    row = dict(producer=producer, layer=layer, kind=kind, M=M, K=K, N=N, bits_equal=bool(same))
    for name, fn in fns.items():
        row[f"{name}_us"] = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,16,64,256")
    ap.add_argument("--kinds", default="int8,fp8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    kinds = [k for k in args.kinds.split(",") if k == "int8" or torch.cuda.get_device_capability() >= (8, 9)]
    rows = []
    print(f"{'case':<22}{'M':>5}  {'sep_q':>8}{'fused_q':>8}  {'sep':>8}{'fused':>8}{'saved':>8}{'x':>7}  bits")
    for kind in kinds:
        for producer, layer, K, N in CASES:
            for M in [int(m) for m in args.m.split(",")]:
                r = case(producer, layer, K, N, kind, M)
                rows.append(r)
                note = (f"  small-M kernel: producer {r['prod_us']:.1f} + GEMV quantizing x {r['gemv_plain_us']:.1f}"
                        f" vs fused producer + XQ GEMV {r['gemv_xq_us']:.1f} us" if "gemv_xq_us" in r else "")
                print(f"{kind + ' ' + producer + '->' + layer:<22}{M:>5}  {r['sep_q_us']:8.1f}{r['fused_q_us']:8.1f}"
                      f"  {r['sep_us']:8.1f}{r['fused_us']:8.1f}{r['sep_us'] - r['fused_us']:8.1f}"
                      f"{r['sep_us'] / r['fused_us']:7.2f}  {'equal' if r['bits_equal'] else 'DIFFER'}{note}",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if not all(r["bits_equal"] for r in rows):
        sys.exit("quantized bits differ between the fused and separate paths")


if __name__ == "__main__":
    main()
