"""INT8 W8A8 kernels against their torch references: the per-token / static int8 activation quantizer (bit for bit)
and the int8 x int8 -> int32 GEMM with its fused dequantizing epilogue (Triton: CUDA or the interpreter on CPU;
torch._int_mm: CUDA only)."""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels import int8_gemm
from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels.int8_gemm import (
    INT8_GEMM_TABLE, INT8_M_BUCKETS, INT8_SHAPE_CLASSES, Int8GemmConfig, int8_gemm_int_mm, int8_gemm_triton,
    int8_m_bucket, int8_scaled_mm, int8_scaled_mm_ref, int8_table_launch, int_mm_usable, pick_int8_config,
)
from hayabusa.kernels.int8_quant import MIN_SCALE_INT8, per_token_quant_int8, per_token_quant_int8_ref
from hayabusa.kernels.quant_linear import gemm_shape_class
from tests.kernels.conftest import DEVICE, QWEN_7B

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------------------------ activation quantizer
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 40, 300, 5000])          # 5000 > MAX_BLOCK: the two-pass path
@pytest.mark.parametrize("static", [False, True])
def test_per_token_quant_int8_matches_ref_bit_for_bit(device, dtype, K, static):
    gen = torch.Generator().manual_seed(K)
    x = (torch.randn(5, K, generator=gen) * torch.logspace(-3, 2, 5)[:, None]).to(dtype).to(device)
    x[2] = 0.0                                                  # an all-zero row: scale floor, q = 0
    scale = torch.tensor([0.05], device=device) if static else None
    q, s = per_token_quant_int8(x, scale)
    q_ref, s_ref = per_token_quant_int8_ref(x, scale)
    assert q.dtype == torch.int8 and s.shape == (5, 1) and s.dtype == torch.float32
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    if not static:
        assert float(s[2]) == MIN_SCALE_INT8 and torch.all(q[2] == 0)
        assert int(q.abs().max()) == 127 and int(q.min()) >= -127      # dynamic rows reach +-127, never -128
    elif K > 1:
        assert int(q.min()) == -128 and int(q.max()) == 127             # a static scale saturates


def test_per_token_quant_int8_rounds_ties_to_even(device):
    """Exact halves x / s = k + 1/2 round to the even neighbour (vLLM's float_to_int8_rn, torch.round)."""
    halves = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 3.25, -3.75]], device=device)
    q, _ = per_token_quant_int8(halves, torch.tensor([1.0], device=device))
    assert q.tolist() == [[0, 2, 2, 0, -2, -2, 126, -128, 3, -4]]


def test_per_token_quant_int8_strided_and_empty(device):
    x = torch.randn(3, 128, device=device)[:, ::2].contiguous()[:, :64]
    big = torch.randn(4, 256, device=device)
    xs = big[:, :64]                                            # row stride 256
    assert torch.equal(per_token_quant_int8(xs)[0], per_token_quant_int8_ref(xs)[0])
    assert per_token_quant_int8(x[:0])[0].shape == (0, 64)   # its input checks: test_fp8_quant.py (shared)


# ------------------------------------------------------------------------------------------------------ GEMM
def _fma_atol(ref: torch.Tensor) -> float:
    """On the GPU the epilogue's `acc * sx * sw + bias` may be one fused multiply-add: the product is not rounded
    to fp32 before the bias is added, an ulp of fp32 at the product's size. Where the bias cancels the product the
    result is small and that ulp is large relative to it (the device run of 5dab8c1 failed atol=0 exactly there,
    only with a bias), so allow a few fp32 ulps of the output's largest magnitude."""
    return 4 * torch.finfo(torch.float32).eps * ref.float().abs().max().item()


def _operands(M, N, K, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xq, sx = per_token_quant_int8_ref(torch.randn(M, K, generator=gen))
    wq, sw = per_token_quant_int8_ref(torch.randn(N, K, generator=gen) * 0.05)
    bias = torch.randn(N, generator=gen).to(dtype)
    return [t.to(device) for t in (xq, sx, wq, sw.view(-1).contiguous(), bias)]


CONFIGS = {
    "tile": Int8GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1),
    "split": Int8GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=3),
    "big_m": Int8GemmConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("M, K", [(1, 96), (7, 100), (33, 160)])     # K = 100: a ragged last K tile
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_triton_matches_ref(device, dtype, cfg, M, K, with_bias):
    """The int32 accumulation is exact on both sides; the epilogue is the same fp32 ops (on the GPU a multiply-add
    may be fused: an ulp of fp32, below the output's rounding), so the outputs agree to an ulp of the output."""
    N = 72                                                      # not a multiple of BLOCK_N
    xq, sx, wq, sw, bias = _operands(M, N, K, dtype, device, seed=M + K)
    b = bias if with_bias else None
    out = int8_gemm_triton(xq, sx, wq, sw, b, dtype, CONFIGS[cfg])
    ref = int8_scaled_mm_ref(xq, sx, wq, sw, b, dtype)
    assert out.shape == (M, N) and out.dtype == dtype
    if device == "cpu":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=_fma_atol(ref), rtol={torch.float32: 1e-6, torch.float16: 1e-3,
                                                                        torch.bfloat16: 8e-3}[dtype])


def test_int8_gemm_ref_is_the_exact_integer_product():
    """int32 semantics: the float64 sum equals an integer matmul even where fp32 sums would round (K = 4096, all
    products 127 * 127: the sum 66,064,384 needs 26 bits)."""
    K = 4096
    xq = torch.full((2, K), 127, dtype=torch.int8)
    wq = torch.full((3, K), 127, dtype=torch.int8)
    wq[1] = -127
    one = torch.ones(2, 1)
    y = int8_scaled_mm_ref(xq, one, wq, torch.ones(3), None, torch.float32)
    exact = (xq.long() @ wq.long().t()).float()
    assert torch.equal(y, exact) and y[0, 0] == 127 * 127 * K


def test_split_k_is_deterministic(device):
    xq, sx, wq, sw, bias = _operands(3, 40, 256, torch.float32, device, seed=9)
    cfg = Int8GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4)
    first = int8_gemm_triton(xq, sx, wq, sw, bias, torch.float32, cfg)
    assert all(torch.equal(first, int8_gemm_triton(xq, sx, wq, sw, bias, torch.float32, cfg)) for _ in range(2))
    assert int8_gemm_triton(xq[:0], sx[:0], wq, sw, bias, torch.float32).shape == (0, 40)


def test_pick_int8_config_and_int_mm_rules():
    dev = torch.device("cpu")                                   # 4 "SMs"
    assert pick_int8_config(1, 64, 4096, dev).SPLIT_K > 1       # few tiles: split K
    big = pick_int8_config(8192, 4608, 3584, dev)
    assert big.BLOCK_M == 128 and big.SPLIT_K == 1
    assert int_mm_usable(17, 8, 16) and not int_mm_usable(16, 8, 16) and not int_mm_usable(32, 12, 16)
    assert not int_mm_usable(32, 8, 20) and not int_mm_usable(32, 8, 8)


def _launch_before_the_table(M, N, K, sms):
    """pick_int8_config as it was before INT8_GEMM_TABLE (run N2's launch), copied here so that the table's buckets
    the H200 sweep did not measure (512, 8192: M > 256) are checked to reproduce it."""
    if M <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif M <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128, 4, 4
    elif M <= 512:
        bm, bn, bk, warps, stages = 64, 128, 128, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 128, 8, 3
    tiles = -(-M // bm) * -(-N // bn)
    k_tiles = -(-K // bk)
    split = 1 if tiles >= sms or M > 64 else max(1, min(16, k_tiles // 2, -(-2 * sms // tiles)))
    return Int8GemmConfig(bm, bn, bk, split, warps, stages)


@pytest.mark.parametrize("sms", [4, 132])
def test_unswept_buckets_keep_the_launch_before_the_table(monkeypatch, sms):
    """The table covers every (M bucket, shape class); above 256 rows (buckets 512 and 8192, not swept) every shape
    class still gets the launch from before the table; the swept buckets hold the measured (2026-12-03) entries,
    which may differ from it (down at M = 128: 64 x 64 tiles, not 64 x 128)."""
    monkeypatch.setattr(int8_gemm, "_num_sms", lambda device: sms)
    dev = torch.device("cpu")
    assert set(INT8_GEMM_TABLE) == {(b, c) for b in INT8_M_BUCKETS for c in INT8_SHAPE_CLASSES}
    shapes = [(N, K) for K, N in QWEN_7B.values()] + [(72, 96), (64, 4096), (896, 4864)]
    assert {gemm_shape_class(N, K) for N, K in shapes} == set(INT8_SHAPE_CLASSES)
    for M in (257, 300, 511, 512, 513, 1024, 8192, 20000):
        for N, K in shapes:
            assert pick_int8_config(M, N, K, dev) == _launch_before_the_table(M, N, K, sms), (M, N, K)
    K, N = QWEN_7B["down"]
    assert pick_int8_config(128, N, K, dev).BLOCK_N == 64 != _launch_before_the_table(128, N, K, sms).BLOCK_N


def test_pick_int8_config_reads_the_table(monkeypatch):
    """(M bucket, shape class) -> the entry; SPLIT_K 0 resolves to splits only while the tiles do not fill the
    SMs (4 on the interpreter), an explicit SPLIT_K is kept."""
    dev = torch.device("cpu")
    assert [int8_m_bucket(m) for m in (1, 16, 17, 64, 65, 300, 512, 513, 9000)] == \
        [16, 16, 32, 64, 128, 512, 512, 8192, 8192]
    monkeypatch.setitem(INT8_GEMM_TABLE, (128, "deep"), (32, 256, 64, 0, 8, 5))
    monkeypatch.setitem(INT8_GEMM_TABLE, (32, "wide"), (16, 128, 256, 3, 4, 2))
    cfg = pick_int8_config(100, 256, 4096, dev)              # deep: 4 x 1 tiles = 4 "SMs": no split
    assert cfg == Int8GemmConfig(32, 256, 64, 1, 8, 5)
    assert pick_int8_config(70, 128, 4096, dev).SPLIT_K == 3    # 3 x 1 tiles < 4: cdiv(2 * 4, 3) = 3 splits
    assert pick_int8_config(20, 128, 4096, dev).SPLIT_K == 4    # (32, "deep") untouched: 1 x 2 tiles, cdiv(8, 2)
    assert pick_int8_config(20, 37888, 3584, dev) == Int8GemmConfig(16, 128, 256, 3, 4, 2)
    assert int8_table_launch((32, 256, 64, 0, 8, 5), 30, 256, 4096, dev).SPLIT_K == 8     # one tile: 2 x 4 "SMs"
    assert int8_table_launch((32, 256, 64, 0, 8, 5), 30, 256, 128, dev).SPLIT_K == 1      # 2 K tiles: >= 2 each


@pytest.mark.parametrize("entry", [(16, 64, 128, 0, 4), (8, 64, 128, 0, 4, 4), (16, 48, 128, 0, 4, 4),
                                   (16, 64, 128, -1, 4, 4), (16, 64, 128, 0, 3, 4), (16, 64, 128, 0, 4, 0)])
def test_bad_table_entry_is_refused_by_name(entry):
    with pytest.raises(HayabusaValidationError, match="INT8_GEMM_TABLE entry") as e:
        int8_table_launch(entry, 16, 64, 128, torch.device("cpu"))
    assert e.value.parameter == "entry" and e.value.value == entry


# A few entries a tile sweep tries (benchmarks/kernels/bench_quant_linear.py --sweep-w8a8), besides the table's
SWEEP_LIKE = [(16, 128, 256, 0, 4, 3), (32, 256, 128, 0, 8, 3), (128, 64, 128, 2, 4, 4), (32, 64, 256, 1, 4, 4)]


def test_every_table_launch_is_bit_exact(device):
    """Each distinct INT8_GEMM_TABLE entry and a few sweep candidates, at their own tile sizes on a small problem
    (M = BLOCK_M + 1: a ragged row tile; N = BLOCK_N + 8; K not a multiple of BLOCK_K), with a bias, equal the
    reference: the int32 sum is exact whatever the tiles and K splits, so retuning the table cannot change a
    token (on the GPU to the epilogue's fused multiply-add; test_table_launches_agree_bit_for_bit_on_cuda)."""
    for entry in sorted(set(INT8_GEMM_TABLE.values())) + SWEEP_LIKE:
        bm, bn, bk = entry[:3]
        M, N, K = bm + 1, bn + 8, 2 * bk + 32
        xq, sx, wq, sw, bias = _operands(M, N, K, torch.bfloat16, device, seed=bm + bn + bk)
        cfg = int8_table_launch(entry, M, N, K, xq.device)
        out = int8_gemm_triton(xq, sx, wq, sw, bias, torch.bfloat16, cfg)
        ref = int8_scaled_mm_ref(xq, sx, wq, sw, bias, torch.bfloat16)
        if device == "cpu":
            assert torch.equal(out, ref), entry
        else:
            torch.testing.assert_close(out, ref, atol=_fma_atol(ref), rtol=8e-3)


def test_public_dispatch_is_the_reference_on_cpu(monkeypatch):
    monkeypatch.setattr(int8_gemm, "INT_MM_MIN_M", 1)
    xq, sx, wq, sw, bias = _operands(20, 16, 32, torch.float32, "cpu")
    assert torch.equal(int8_scaled_mm(xq, sx, wq, sw, bias, torch.bfloat16),
                       int8_scaled_mm_ref(xq, sx, wq, sw, bias, torch.bfloat16))


def test_validation_names_the_argument():
    xq, sx, wq, sw, bias = _operands(4, 16, 32, torch.float32, "cpu")
    cases = [
        (lambda: int8_scaled_mm(xq.float(), sx, wq, sw, None, torch.float32), "xq must be"),
        (lambda: int8_scaled_mm(xq, sx, wq[:, :16].contiguous(), sw, None, torch.float32), "wq must be"),
        (lambda: int8_scaled_mm(xq, sx.view(-1), wq, sw, None, torch.float32), "sx must be"),
        (lambda: int8_scaled_mm(xq, sx, wq, sw.half(), None, torch.float32), "sw must be"),
        (lambda: int8_scaled_mm(xq, sx, wq, sw, bias[:3], torch.float32), "bias must be"),
        (lambda: int8_scaled_mm(xq, sx, wq, sw, None, torch.int32), "out_dtype"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_sweep_w8a8_table_sums_a_class_and_prints_a_pasteable_literal(capsys):
    """bench_quant_linear.py --sweep-w8a8 / --merge on made-up timings (no GPU): per (shape class, M) the entry
    with the least time summed over the class's layers wins (an entry one layer lacks cannot), and only when it
    beats the current table's launch; the printed INT8_GEMM_TABLE evaluates to the table with those keys replaced;
    the candidates are valid table entries."""
    import ast
    import runpy
    from pathlib import Path

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks/kernels/bench_quant_linear.py"),
                           run_name="bench_quant_linear")
    a, b, c = [16, 128, 256, 0, 4, 4], [32, 256, 128, 0, 8, 3], [16, 64, 128, 0, 4, 4]

    def row(layer, M, cands, table_us=60.0):
        shape = {"qkv": "square", "o": "square", "gate_up": "wide", "down": "deep"}[layer]
        return dict(kind="w8a8_sweep", layer=layer, M=M, shape_class=shape, bf16_us=50.0, table_us=table_us,
                    candidates=cands)

    rows = [row("qkv", 32, [[a, 10.0], [b, 30.0], [c, 1.0]]),   # c is fastest here but o lacks it
            row("o", 32, [[a, 40.0], [b, 15.0]]),                # sums: a 50, b 45 -> b
            row("gate_up", 16, [[a, 30.0]]),                      # 30 < 60: a
            row("down", 256, [[b, 70.0]], table_us=65.0)]        # slower than the table: kept
    bench["print_w8a8_sweep"](rows)
    out = capsys.readouterr().out
    literal = out[out.index("INT8_GEMM_TABLE"):]
    table = ast.literal_eval(literal[literal.index("{"):])
    assert table[(32, "square")] == tuple(b) and table[(16, "wide")] == tuple(a)
    assert table[(256, "deep")] == INT8_GEMM_TABLE[(256, "deep")]
    assert {k: v for k, v in table.items() if k not in ((32, "square"), (16, "wide"))} == \
        {k: v for k, v in INT8_GEMM_TABLE.items() if k not in ((32, "square"), (16, "wide"))}
    dev = torch.device("cpu")
    for M in bench["SWEEP_W8A8_M"]:
        cands = bench["w8a8_candidates"](M)
        assert 5 <= len(cands) <= 17 and len(set(cands)) == len(cands)
        assert all(int8_table_launch(e, M, 4608, 3584, dev).BLOCK_M <= max(16, M) for e in cands)
        assert all(e[5] * (e[0] + e[1]) * e[2] <= 200 * 1024 for e in cands)

# ------------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, N, K", [(17, 72, 96), (300, 4608, 3584), (1024, 3584, 18944)])
def test_int_mm_path_matches_ref_on_cuda(dtype, M, N, K):
    xq, sx, wq, sw, bias = _operands(M, N, K, dtype, "cuda", seed=M)
    assert int_mm_usable(M, N, K)
    out = int8_gemm_int_mm(xq, sx, wq, sw, bias, dtype)
    ref = int8_scaled_mm_ref(xq, sx, wq, sw, bias, dtype)
    torch.testing.assert_close(out, ref, atol=_fma_atol(ref), rtol={torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("layer", list(QWEN_7B))
@pytest.mark.parametrize("M", [1, 16, 64, 300])
def test_qwen7b_shapes_triton_and_dispatch_match_ref_on_cuda(layer, M):
    K, N = QWEN_7B[layer]
    xq, sx, wq, sw, bias = _operands(M, N, K, torch.bfloat16, "cuda", seed=M)
    ref = int8_scaled_mm_ref(xq, sx, wq, sw, bias, torch.bfloat16)
    for out in (int8_gemm_triton(xq, sx, wq, sw, bias, torch.bfloat16),
                int8_scaled_mm(xq, sx, wq, sw, bias, torch.bfloat16)):
        torch.testing.assert_close(out, ref, atol=_fma_atol(ref), rtol=8e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 256])
def test_w8a8_cuda_graph_capture_and_replay(M):
    """Quantize + GEMM capture (no host sync; split-K's workspace zeroing included) and a replay sees new x."""
    K, N = 3584, 4608
    _, _, wq, sw, _ = _operands(1, N, K, torch.bfloat16, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)

    def run():
        xq, sx = per_token_quant_int8(x)
        return int8_scaled_mm(xq, sx, wq, sw, None, torch.bfloat16)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    xq, sx = per_token_quant_int8_ref(x)
    torch.testing.assert_close(out, int8_scaled_mm_ref(xq, sx, wq, sw, None, torch.bfloat16), atol=0, rtol=8e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("layer", list(QWEN_7B))
@pytest.mark.parametrize("M", [16, 64, 256])
def test_table_launches_agree_bit_for_bit_on_cuda(layer, M):
    """At the 7b shapes, the table's launch and other tile / split choices (what bench_quant_linear.py --sweep-w8a8
    may paste into INT8_GEMM_TABLE) give the same output bits, with a bias: the int32 sum is exact, and the fused
    epilogue and the split-K epilogue kernel must round alike, so retuning the table cannot change a greedy
    token. About 10 launches compile once (a few seconds)."""
    K, N = QWEN_7B[layer]
    xq, sx, wq, sw, bias = _operands(M, N, K, torch.bfloat16, "cuda", seed=M)
    expect = int8_gemm_triton(xq, sx, wq, sw, bias, torch.bfloat16)
    for entry in [(16, 64, 128, 0, 4, 4), (32, 128, 256, 0, 4, 4), (64, 128, 128, 1, 4, 4), (64, 128, 128, 4, 4, 4),
                  (128, 256, 128, 0, 8, 3)]:
        out = int8_gemm_triton(xq, sx, wq, sw, bias, torch.bfloat16, int8_table_launch(entry, M, N, K, xq.device))
        assert torch.equal(out, expect), entry
