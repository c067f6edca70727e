"""The swapped-operand weight-only GEMM (_wo_gemm_t_kernel: out^T = Wdeq @ x^T, weights dequantized by the magic
number trick straight into x's fp16 / bf16) under the Triton interpreter on CPU (or on CUDA when present): against
the torch references, bit for bit against the original GEMM on the interpreter, every launch of GEMM_T_TABLE's
shape (tile ratios kept, sizes shrunk), and pick_config's table lookup. Sizes are small: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels import quant_linear
from hayabusa.kernels.quant_linear import (
    GEMM_M_BUCKETS, GEMM_SHAPE_CLASSES, GEMM_T_TABLE, LaunchConfig, _launch, gemm_m_bucket, gemm_shape_class,
    int4_weight_only_linear_ref, int8_weight_only_linear_ref, pick_config, quantize_int4_grouped,
    quantize_int8_per_channel,
)
from tests.kernels.test_quant_linear import _assert_close_to_ref, _inputs

HALF_DTYPES = [torch.float16, torch.bfloat16]
N, K = 72, 256   # N not a multiple of any N tile below: masked columns


def _t(bm, bn, bk, split=1):
    return LaunchConfig("gemm_t", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)


def _int4(device, M, G, dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w, bias = _inputs(M, N, K, dtype, with_bias=with_bias, gen=gen, x_scale=2.0)
    return x, bias, tuple(t.to(device) for t in quantize_int4_grouped(w, G))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M,with_bias", [(16, True), (33, False), (64, True)])
def test_int4_gemm_t_matches_ref(device, dtype, G, M, with_bias):
    """Asymmetric zeros (quantize_int4_grouped's), three group sizes, M = 16 (one row tile), 33 (a ragged second
    tile) and 64 (two full tiles); K splits when G allows (the deterministic reduce adds the bias)."""
    x, bias, (q, s, z) = _int4(device, M, G, dtype, with_bias, seed=M + G)
    assert torch.any((z != 0) & (z != 15))                  # zero points inside the range: the subtraction matters
    cfg = _t(32, 32, min(G, 64), split=2 if M == 33 else 1)
    out = _launch(x, q, s, z, bias, N, G, cfg)
    _assert_close_to_ref(out, int4_weight_only_linear_ref(x, q, s, z, G, bias), dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("M,with_bias", [(16, False), (33, True), (64, False)])
def test_int8_gemm_t_matches_ref(device, dtype, M, with_bias):
    """K = 200 is not a multiple of the K tile (ragged last tile, masked); q spans -127..127 (fp16's 0x6480 LOP3 and
    bf16's fp32 route both reach every byte)."""
    gen = torch.Generator().manual_seed(M)
    x, w, bias = _inputs(M, N, 200, dtype, with_bias=with_bias, gen=gen, x_scale=2.0)
    q, s = (t.to(device) for t in quantize_int8_per_channel(w))
    assert int(q.min()) == -127 and int(q.max()) == 127
    out = _launch(x, q, s, None, bias, N, None, _t(16, 64, 64, split=2 if M == 33 else 1))
    _assert_close_to_ref(out, int8_weight_only_linear_ref(x, q, s, bias), dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_gemm_t_equals_original_gemm_on_the_interpreter(device, dtype, scheme):
    """The same exact-integer operands and the same fp32 per-K-tile sums: under the interpreter (one numpy matmul
    per tile either way) the swapped GEMM gives the original GEMM's bits. (On a GPU the MMA's summation order may
    differ: the CUDA tests bound the difference against the reference instead.)"""
    if device != "cpu":
        pytest.skip("bit equality holds for the interpreter's matmul, not across MMA shapes")
    gen = torch.Generator().manual_seed(3)
    x, w, bias = _inputs(33, N, K, dtype, with_bias=True, gen=gen, x_scale=2.0)
    if scheme == "int8":
        packed, G = (*quantize_int8_per_channel(w), None), None
    else:
        packed, G = quantize_int4_grouped(w, 64), 64
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    new = _launch(x, *packed, bias, N, G, LaunchConfig("gemm_t", **cfg))
    old = _launch(x, *packed, bias, N, G, LaunchConfig("gemm", **cfg))
    assert torch.equal(new, old)


def test_int4_magic_dequant_covers_every_nibble_and_zero(device):
    """Every (q, zero) pair 0..15 x 0..15 with scale 1 and x = one-hot rows: out[m, n] is W[m, n] = q - zero itself,
    exact in fp16 and bf16 (|q - zero| <= 15), so the OR-magic-subtract dequantization is checked value by value."""
    from hayabusa.kernels.quant_ref import pack_int4
    Kc, G = 16, 16
    n = torch.arange(256)
    zeros = (n % 16)[None, :].float()                                       # [1, 256]: zero = n % 16
    q = ((torch.arange(Kc)[:, None] + n[None, :] // 16) % 16)               # [16, 256]: q = (k + n // 16) % 16
    for dtype in HALF_DTYPES:
        x = torch.eye(Kc, dtype=dtype).to(device)                           # M = K = 16: out = W^T
        args = (pack_int4(q).to(device), torch.ones(1, 256, dtype=dtype, device=device), zeros.to(dtype).to(device))
        out = _launch(x, *args, None, 256, G, _t(16, 64, 16))
        assert torch.equal(out.float().cpu(), (q - zeros).float())


def test_pick_config_reads_the_table(monkeypatch):
    """fp16 / bf16 x at 5..256 rows: gemm_t with the table's tiles for (scheme, M bucket, shape class); int4's K
    tile capped by the group; SPLIT_K 0 -> enough splits for the SMs (4 on the interpreter). fp32 x and M > 256
    keep the original GEMM; M <= 4 the GEMV."""
    dev = torch.device("cpu")
    assert pick_config(40, 256, 18944, 32, dev).kind == "gemm"                 # off by default (measured slower)
    monkeypatch.setattr(quant_linear, "USE_GEMM_T", True)
    assert [gemm_m_bucket(m) for m in (5, 16, 17, 33, 64, 65, 200, 256, 300)] == \
        [16, 16, 32, 64, 64, 128, 256, 256, 256]
    assert [gemm_shape_class(n, k) for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944))] == \
        ["square", "square", "wide", "deep"]
    assert set(GEMM_T_TABLE) == {(s, b, c) for s in ("int8", "int4") for b in GEMM_M_BUCKETS
                                 for c in GEMM_SHAPE_CLASSES}
    monkeypatch.setitem(GEMM_T_TABLE, ("int4", 64, "deep"), (64, 256, 128, 0, 8, 5))
    monkeypatch.setitem(GEMM_T_TABLE, ("int8", 32, "wide"), (32, 128, 64, 3, 4, 4))
    cfg = pick_config(40, 256, 18944, 32, dev)                               # G = 32 caps BLOCK_K
    assert (cfg.kind, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps, cfg.num_stages) == \
        ("gemm_t", 64, 256, 32, 8, 5)
    assert cfg.SPLIT_K == 4                                                  # one tile, 4 "SMs": 4 K splits
    assert pick_config(40, 3584, 18944 * 2, 32, dev).SPLIT_K == 1            # 14 N tiles fill 4 "SMs"
    cfg = pick_config(20, 37888, 3584, None, dev)
    assert (cfg.kind, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K) == ("gemm_t", 32, 128, 64, 3)
    assert pick_config(20, 37888, 3584, None, dev, x_bytes=4).kind == "gemm"
    assert pick_config(300, 4608, 3584, 128, dev).kind == "gemm"
    assert pick_config(4, 4608, 3584, 128, dev).kind == "gemv"


@pytest.mark.parametrize("scheme,dtype", [("int4", torch.bfloat16), ("int8", torch.float16)])
def test_every_table_launch_shape_runs(device, scheme, dtype):
    """Each distinct (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of GEMM_T_TABLE, run at its own tile sizes on one
    tile's worth of a small problem (M = BLOCK_M + 1: a ragged row tile; N = BLOCK_N + 8), against the reference.
    The real shapes run in tests/kernels/test_wo_gemm_t_cuda.py."""
    launches = sorted({v for (s, _, _), v in GEMM_T_TABLE.items() if s == scheme})
    gen = torch.Generator().manual_seed(11)
    for bm, bn, bk, split, warps, stages in launches:
        M, n, G = bm + 1, bn + 8, 128
        x, w, bias = _inputs(M, n, 2 * max(bk, G), dtype, with_bias=True, gen=gen)
        cfg = LaunchConfig("gemm_t", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(bk, G), SPLIT_K=max(split, 1),
                           num_warps=warps, num_stages=stages)
        if scheme == "int4":
            packed = tuple(t.to(device) for t in quantize_int4_grouped(w, G))
            out, ref = _launch(x, *packed, bias, n, G, cfg), int4_weight_only_linear_ref(x, *packed, G, bias)
        else:
            packed = tuple(t.to(device) for t in quantize_int8_per_channel(w))
            out, ref = _launch(x, *packed, None, bias, n, None, cfg), int8_weight_only_linear_ref(x, *packed, bias)
        _assert_close_to_ref(out, ref, dtype)


def test_public_path_takes_gemm_t_for_batches(device, monkeypatch):
    """_kernel_linear (the CUDA path) below DEQUANT_GEMM_MIN_M launches pick_config's gemm_t for bf16 x (9 rows: with
    the small-M kernel off, which takes 2-16 rows by default)."""
    monkeypatch.setattr(quant_linear, "USE_GEMM_T", True)
    monkeypatch.setattr(quant_linear, "USE_WO_SMALL_M", False)
    seen = []
    real = quant_linear._launch
    monkeypatch.setattr(quant_linear, "_launch", lambda *a: seen.append(
        pick_config(a[0].shape[0], a[5], a[0].shape[1], a[6], a[0].device, a[0].element_size())) or real(*a))
    monkeypatch.setitem(GEMM_T_TABLE, ("int8", 16, "square"), (16, 32, 32, 1, 4, 2))
    gen = torch.Generator().manual_seed(12)
    x, w, bias = _inputs(9, 40, 64, torch.bfloat16, with_bias=True, gen=gen)
    q, s = (t.to(device) for t in quantize_int8_per_channel(w))
    out = quant_linear._kernel_linear(x, q, s, None, bias, 40, None)
    assert [c.kind for c in seen] == ["gemm_t"]
    _assert_close_to_ref(out, int8_weight_only_linear_ref(x, q, s, bias), torch.bfloat16)


def test_sweep_gemm_table_sums_a_class_and_prints_a_pasteable_literal(capsys):
    """bench_quant_linear.py --sweep-gemm / --merge, on made-up timings (no GPU): per (scheme, class, M bucket) the
    entry with the least time summed over the class's layers wins, an entry one layer lacks cannot; the crossover is
    the smallest M from which dequantize + cuBLAS wins at every larger M; the printed GEMM_T_TABLE evaluates to the
    table with the swept keys replaced."""
    import ast
    import runpy
    from pathlib import Path

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks/kernels/bench_quant_linear.py"),
                           run_name="bench_quant_linear")
    a, b, c = [16, 128, 128, 0, 4, 4], [32, 128, 64, 0, 4, 3], [16, 64, 64, 1, 4, 3]

    def row(layer, M, cands, dq_us):
        shape = "square" if layer in ("qkv", "o") else "wide"
        best = min(cands, key=lambda e: e[1])
        return dict(layer=layer, M=M, scheme="int4", shape_class=shape, bf16_us=50.0, dq_cublas_us=dq_us,
                    table_us=60.0, candidates=cands, best_entry=best[0], best_us=best[1])

    rows = [row("qkv", 16, [[a, 10.0], [b, 30.0], [c, 1.0]], 99.0),   # c is fastest here but o lacks it
            row("o", 16, [[a, 40.0], [b, 15.0]], 99.0),                # sums: a 50, b 45 -> b
            row("qkv", 64, [[a, 20.0]], 5.0), row("o", 64, [[a, 20.0]], 99.0),
            row("gate_up", 16, [[a, 30.0]], 1.0), row("gate_up", 64, [[a, 30.0]], 99.0)]
    bench["print_gemm_sweep"](rows)
    out = capsys.readouterr().out
    literal = out[out.index("GEMM_T_TABLE"):]
    table = ast.literal_eval(literal[literal.index("{"):])
    assert table[("int4", 16, "square")] == tuple(b) and table[("int4", 64, "square")] == tuple(a)
    assert table[("int4", 16, "wide")] == tuple(a)
    assert table[("int8", 16, "square")] == GEMM_T_TABLE[("int8", 16, "square")]        # not swept: kept
    assert set(table) == set(GEMM_T_TABLE)
    crossover = {line.split()[2]: line.split(None, 3)[3] for line in out.splitlines() if line.startswith("#   ")}
    assert crossover == {"qkv": "64", "o": "never (up to M = 64)", "gate_up": "never (up to M = 64)"}
