"""Weight-only int8 / int4 linears: the Triton kernels (CUDA, or the interpreter on CPU) against the torch
references, the quantizers' error bounds, int4 packing, input validation; on CUDA also the real Qwen2.5-7B shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hayabusa.kernels import quant_linear
from hayabusa.kernels.quant_linear import (
    DEQUANT_GEMM_MIN_M, LaunchConfig, _kernel_linear, _launch, dequantize_int4, dequantize_int4_to,
    dequantize_int4_to_ref, dequantize_int8, dequantize_int8_to, dequantize_int8_to_ref, int4_weight_only_linear,
    int4_weight_only_linear_ref, int8_weight_only_linear, int8_weight_only_linear_ref, pack_int4, pick_config,
    quantize_int4_grouped, quantize_int8_per_channel, unpack_int4,
)
from tests.kernels.conftest import DEVICE, QWEN_7B

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# interpreter-sized launches that reach every code path: GEMV with and without split-K, GEMM with and without
# split-K, a ragged last K split (int8, K not a multiple of BLOCK_K)
CONFIGS = {
    "gemv": LaunchConfig("gemv", BLOCK_N=64, BLOCK_K=32, SPLIT_K=1),
    "gemv_split": LaunchConfig("gemv", BLOCK_N=32, BLOCK_K=32, SPLIT_K=3),
    "gemm": LaunchConfig("gemm", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1),
    "gemm_split": LaunchConfig("gemm", BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=2),
}


def _inputs(M, N, K, dtype, with_bias, gen, x_scale=1.0):
    x = (torch.randn(M, K, generator=gen) * x_scale).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    return x, w, bias


def _assert_close_to_ref(out, ref, dtype):
    """Same fp32 sums in another order, then one rounding to dtype: within an ulp or two of the output scale."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = ref.float().abs().max().clamp_min(1.0)
    err = (out.float() - ref.float()).abs().max()
    assert err <= tol * scale, f"max |kernel - ref| = {err:.3g} > {tol * scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("M", [1, 5, 17])
def test_int8_kernel_matches_ref(device, dtype, cfg, M):
    gen = torch.Generator().manual_seed(M)
    N, K = 72, 96 if cfg != "gemm_split" else 104   # N not a multiple of BLOCK_N; 104 % 32 != 0: ragged K tile
    x, w, bias = _inputs(M, N, K, dtype, with_bias=M != 5, gen=gen)
    qweight, scales = (t.to(device) for t in quantize_int8_per_channel(w))
    out = _launch(x, qweight, scales, None, bias, N, None, CONFIGS[cfg])
    _assert_close_to_ref(out, int8_weight_only_linear_ref(x, qweight, scales, bias), dtype)


INT4_CASES = [(cfg, M, G) for cfg in CONFIGS for M, G in [(1, 32), (5, 128), (17, 32), (3, 64)]
              if not (cfg.startswith("gemv") and M == 17)]  # GEMV rows are independent programs: 5 is plenty


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg,M,G", INT4_CASES)
def test_int4_kernel_matches_ref(device, dtype, cfg, M, G):
    gen = torch.Generator().manual_seed(100 + M)
    N, K = 40, 256
    x, w, bias = _inputs(M, N, K, dtype, with_bias=M % 2 == 1, gen=gen)
    qweight, scales, zeros = (t.to(device) for t in quantize_int4_grouped(w, G))
    block_k = min(CONFIGS[cfg].BLOCK_K, G)  # a K tile must lie in one group (pick_config ensures it)
    c = CONFIGS[cfg]
    c = LaunchConfig(c.kind, BLOCK_N=c.BLOCK_N, BLOCK_K=block_k, SPLIT_K=c.SPLIT_K, BLOCK_M=c.BLOCK_M)
    out = _launch(x, qweight, scales, zeros, bias, N, G, c)
    _assert_close_to_ref(out, int4_weight_only_linear_ref(x, qweight, scales, zeros, G, bias), dtype)


@pytest.mark.parametrize("K", [64, 24])
def test_int4_group_equal_to_k_and_auto_config(device, K):
    """G == K (one group per column), through pick_config's own launch at a decode and a batch M. K = 24: the
    largest K tile inside a group is 8, one packed row (too short for tl.dot, so the GEMV serves every M)."""
    gen = torch.Generator().manual_seed(7)
    N = 24
    for M in (1, 9):
        x, w, bias = _inputs(M, N, K, torch.float16, with_bias=True, gen=gen)
        qweight, scales, zeros = (t.to(device) for t in quantize_int4_grouped(w, K))
        out = _launch(x, qweight, scales, zeros, bias, N, K, None)
        _assert_close_to_ref(out, int4_weight_only_linear_ref(x, qweight, scales, zeros, K, bias), torch.float16)


def test_kernels_accept_strided_x_and_empty_m(device):
    gen = torch.Generator().manual_seed(8)
    N, K = 32, 64
    x_big, w, _ = _inputs(3, N, 2 * K, torch.float32, with_bias=False, gen=gen)
    x = x_big[:, ::2]                                  # stride (2K, 2)
    qweight, scales = (t.to(device) for t in quantize_int8_per_channel(w[:, :K].contiguous()))
    out = _launch(x, qweight, scales, None, None, N, None, CONFIGS["gemv"])
    _assert_close_to_ref(out, int8_weight_only_linear_ref(x, qweight, scales), torch.float32)
    assert _launch(x[:0], qweight, scales, None, None, N, None, None).shape == (0, N)


def test_split_k_is_deterministic(device):
    gen = torch.Generator().manual_seed(9)
    x, w, bias = _inputs(2, 48, 256, torch.float32, with_bias=True, gen=gen, x_scale=10.0)
    qweight, scales, zeros = (t.to(device) for t in quantize_int4_grouped(w, 32))
    cfg = LaunchConfig("gemv", BLOCK_N=32, BLOCK_K=32, SPLIT_K=4)
    first = _launch(x, qweight, scales, zeros, bias, 48, 32, cfg)
    assert all(torch.equal(first, _launch(x, qweight, scales, zeros, bias, 48, 32, cfg)) for _ in range(2))


def test_pick_config_is_sane():
    dev = torch.device("cpu")  # 4 "SMs"
    assert pick_config(1, 4608, 3584, 128, dev).kind == "gemv"
    gemm = pick_config(2048, 4608, 3584, 128, dev)
    assert gemm.kind == "gemm" and gemm.BLOCK_M == 128 and gemm.SPLIT_K == 1
    assert pick_config(8, 64, 3584, None, dev).SPLIT_K > 1            # few tiles: split K
    assert pick_config(1, 64, 3584, 32, dev).BLOCK_K <= 32            # a tile never straddles a group
    assert pick_config(64, 64, 24, 24, dev).kind == "gemv"            # G = 24: no K tile of 16 fits a group


# ------------------------------------------------------------------------- large M: dequantize, then F.linear
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme,G", [("int8", None), ("int4", 128), ("int4", 32), ("int4", 24)])
def test_dequantize_kernel_is_bit_exact(device, dtype, scheme, G):
    """W [N, K] in dtype equals (q - z) * s computed in fp32 and rounded once, bit for bit. N = 72 is not a multiple
    of the N tile; int8 K = 200 is not one of the K tile (128); G = 24 gives 8-wide K tiles (one packed row)."""
    gen = torch.Generator().manual_seed(20)
    N, K = 72, 200 if scheme == "int8" else 384
    w = (torch.randn(N, K, generator=gen) * 0.05).to(dtype)
    if scheme == "int8":
        q, s = (t.to(device) for t in quantize_int8_per_channel(w))
        out, ref = dequantize_int8_to(q, s, dtype), dequantize_int8_to_ref(q, s, dtype)
    else:
        q, s, z = (t.to(device) for t in quantize_int4_grouped(w, G))
        out, ref = dequantize_int4_to(q, s, z, G, dtype), dequantize_int4_to_ref(q, s, z, G, dtype)
    assert out.shape == (N, K) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_rounds_every_product_to_nearest_even(device, dtype):
    """Every (q, zero) pair against every mantissa of the scale's binade [1/256, 1/128): the products need up to
    4 + 11 bits, so they hit both kinds of tie; the kernel must round like torch's fp32 -> dtype cast (RNE)."""
    mant = {torch.float16: 10, torch.bfloat16: 7}[dtype]                    # stored mantissa bits
    s_vals = (1 + torch.arange(2**mant, dtype=torch.float64) / 2**mant) / 256   # [2**mant], exact in dtype
    N = 16 * 2**mant                                                       # n = 16 * mantissa + zero
    scales = s_vals.repeat_interleave(16)[None, :].to(dtype)               # [1, N], G = K = 16
    zeros = torch.arange(16).repeat(2**mant)[None, :].to(dtype)            # [1, N]
    q = torch.arange(16)[:, None].expand(16, N)                            # [K = 16, N]: q = k
    qweight, scales, zeros = pack_int4(q).to(device), scales.to(device), zeros.to(device)
    assert torch.equal(dequantize_int4_to(qweight, scales, zeros, 16, dtype),
                       dequantize_int4_to_ref(qweight, scales, zeros, 16, dtype))
    q8 = torch.arange(-127, 128, dtype=torch.int8)[None, :].expand(2**mant, 255).contiguous().to(device)
    s8 = s_vals.to(dtype).to(device)                                       # [N = 2**mant], all q in -127..127
    assert torch.equal(dequantize_int8_to(q8, s8, dtype), dequantize_int8_to_ref(q8, s8, dtype))


def _spy(monkeypatch, name):
    calls = []
    real = getattr(quant_linear, name)
    monkeypatch.setattr(quant_linear, name, lambda *a, **k: calls.append(name) or real(*a, **k))
    return calls


def test_int4_switches_to_cublas_at_its_own_smaller_threshold(device, monkeypatch):
    """int4 dequantizes from DEQUANT_GEMM_MIN_M_INT4 rows (measured crossover 64 on an H200), int8 only from
    DEQUANT_GEMM_MIN_M (256): at M between the two, int4 takes dequantize + F.linear and int8 the fused kernel.
    (Issue #25: the quantized weights are made on the CPU and must follow x to the device, else the CUDA run
    fails with "Pointer argument (at 0) cannot be accessed from Triton".)"""
    assert quant_linear.DEQUANT_GEMM_MIN_M_INT4 < quant_linear.DEQUANT_GEMM_MIN_M
    monkeypatch.setattr(quant_linear, "DEQUANT_GEMM_MIN_M", 16)
    monkeypatch.setattr(quant_linear, "DEQUANT_GEMM_MIN_M_INT4", 4)
    launches, dequants = _spy(monkeypatch, "_launch"), _spy(monkeypatch, "_dequantize")
    gen = torch.Generator().manual_seed(5)
    N, K, G = 16, 64, 32
    x, w, _ = _inputs(8, N, K, torch.float32, with_bias=False, gen=gen, x_scale=1.0)
    _kernel_linear(x, *(t.to(device) for t in quantize_int4_grouped(w, G)), None, N, G)
    assert dequants == ["_dequantize"] and launches == []
    dequants.clear()
    _kernel_linear(x, *(t.to(device) for t in quantize_int8_per_channel(w)), None, None, N, None)
    assert launches == ["_launch"] and dequants == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_large_m_dequantizes_then_calls_f_linear(device, monkeypatch, dtype, scheme):
    """From DEQUANT_GEMM_MIN_M rows (lowered to 8 so the interpreter stays fast) the path is dequantize + F.linear,
    below it the fused kernel. The large-M result is F.linear of the reference weight rounded to x's dtype (the same
    op on the same operands: equal on CPU), and within a derived bound of the fp32 reference:
        |out - ref| <= (u + 2 K 2**-24) S + u (|out| + |ref|),   S = |x| @ |W|^T + |bias|
    u (x's unit roundoff) for rounding W to x's dtype and for each side's rounding of its output; K 2**-24 for each
    side's fp32 accumulation; on CUDA one more u S for cuBLAS's reduced-precision split-K reduction."""
    monkeypatch.setattr(quant_linear, "DEQUANT_GEMM_MIN_M", 8)
    monkeypatch.setattr(quant_linear, "USE_WO_SMALL_M", False)   # it takes 2-16 rows by default (test_wo_small_m.py)
    launches, dequants = _spy(monkeypatch, "_launch"), _spy(monkeypatch, "_dequantize")
    gen = torch.Generator().manual_seed(21)
    N, K, G = 40, 256, 32
    for M in (7, 8, 13):
        x, w, bias = _inputs(M, N, K, dtype, with_bias=M != 8, gen=gen, x_scale=3.0)
        if scheme == "int8":
            packed = tuple(t.to(device) for t in quantize_int8_per_channel(w))
            w_ref = dequantize_int8(*packed)
            out = _kernel_linear(x, *packed, None, bias, N, None)
            ref = int8_weight_only_linear_ref(x, *packed, bias)
        else:
            packed = tuple(t.to(device) for t in quantize_int4_grouped(w, G))
            w_ref = dequantize_int4(*packed, G)
            out = _kernel_linear(x, *packed, bias, N, G)
            ref = int4_weight_only_linear_ref(x, *packed, G, bias)
        assert out.shape == (M, N) and out.dtype == dtype
        if M < 8:
            assert launches == ["_launch"] and dequants == []
            _assert_close_to_ref(out, ref, dtype)
            launches.clear()
            continue
        assert dequants == ["_dequantize"] and launches == []
        dequants.clear()
        if device == "cpu":
            assert torch.equal(out, torch.nn.functional.linear(x, w_ref.to(dtype).contiguous(), bias))
        u = UNIT_ROUNDOFF[dtype]
        S = x.float().abs() @ w_ref.abs().t() + (bias.float().abs() if bias is not None else 0.0)
        u_w = u * (2 if device == "cuda" else 1)
        bound = (u_w + 2 * K * 2.0**-24) * S + u * (out.float().abs() + ref.float().abs())
        err = (out.float() - ref.float()).abs()
        assert torch.all(err <= bound * 1.001 + 1e-30), f"max err / bound = {(err / bound).max():.3g}"


def test_public_large_m_dispatch_stays_reference_on_cpu(monkeypatch):
    """The CPU path is the torch reference at every M: the threshold only moves the CUDA path."""
    monkeypatch.setattr(quant_linear, "DEQUANT_GEMM_MIN_M", 1)
    dequants = _spy(monkeypatch, "_dequantize")
    x = torch.randn(4, 64)
    q4, s4, z4 = quantize_int4_grouped(torch.randn(16, 64), 32)
    assert torch.equal(int4_weight_only_linear(x, q4, s4, z4, 32), int4_weight_only_linear_ref(x, q4, s4, z4, 32))
    assert dequants == []


# --------------------------------------------------------------------------------------- dispatch, quantizers
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_functions_dispatch_and_match_float_linear(dtype):
    """On CPU the public functions are the references; both stay close to the unquantized linear."""
    gen = torch.Generator().manual_seed(10)
    x, w, bias = _inputs(6, 40, 128, dtype, with_bias=True, gen=gen)
    x, bias = x.cpu(), bias.cpu()
    exact = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    q8 = int8_weight_only_linear(x, *quantize_int8_per_channel(w), bias)
    q4 = int4_weight_only_linear(x, *quantize_int4_grouped(w, 32), 32, bias)
    assert q8.dtype == q4.dtype == dtype and q8.shape == q4.shape == (6, 40)
    rel = lambda y: ((y.float() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert rel(q8) < 0.02 and rel(q4) < 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_quantize_error_bound(dtype):
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(33, 70, generator=gen) * torch.logspace(-3, 1, 33)[:, None]).to(dtype)
    w[5] = 0.0                                                      # an all-zero row is safe
    qweight, scales = quantize_int8_per_channel(w)
    assert qweight.dtype == torch.int8 and scales.dtype == dtype and scales.shape == (33,)
    assert qweight.abs().max() <= 127 and torch.all(qweight[5] == 0) and torch.isfinite(scales).all()
    err = (w.float() - dequantize_int8(qweight, scales)).abs()
    assert torch.all(err <= scales.float()[:, None] * (0.5 + 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [32, 128])
def test_int4_quantize_error_bound(dtype, G):
    gen = torch.Generator().manual_seed(12)
    N, K = 24, 256
    w = (torch.randn(N, K, generator=gen) * 0.1).to(dtype)
    w[3] = 0.0
    w[4] = w[4].abs() + 0.5                                         # one-signed rows: zero point at an end
    w[7] = -w[7].abs()
    qweight, scales, zeros = quantize_int4_grouped(w, G)
    assert qweight.shape == (K // 8, N) and qweight.dtype == torch.int32
    assert scales.shape == zeros.shape == (K // G, N) and scales.dtype == zeros.dtype == dtype
    assert torch.all((zeros >= 0) & (zeros <= 15) & (zeros == zeros.round()))
    err = (w.float() - dequantize_int4(qweight, scales, zeros, G)).abs()          # [N, K]
    bound = scales.float().repeat_interleave(G, dim=0).t() * (0.5 + 1e-6)
    assert torch.all(err <= bound)


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 6), N=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       int_dtype=st.sampled_from([torch.uint8, torch.int32, torch.int64]))
def test_pack_unpack_round_trip(rows, N, seed, int_dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (8 * rows, N), generator=gen).to(int_dtype)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (rows, N)
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))


def test_pack_int4_bit_layout():
    q = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, 2)   # column: k = 0..7 holds value k
    q[7, 1] = 15                                                    # top nibble set: the int32 goes negative
    packed = pack_int4(q)
    assert packed[0, 0].item() == 0x76543210
    assert packed[0, 1].item() == 0xF6543210 - 2**32


# ----------------------------------------------------------------------------------------------- validation
def test_validation_names_the_argument():
    x = torch.randn(2, 64)
    q8, s8 = quantize_int8_per_channel(torch.randn(16, 64))
    q4, s4, z4 = quantize_int4_grouped(torch.randn(16, 64), 32)
    cases = [
        (lambda: int8_weight_only_linear(x.to(torch.int32), q8, s8), "x must be"),
        (lambda: int8_weight_only_linear(x, q8.to(torch.int16), s8), "qweight"),
        (lambda: int8_weight_only_linear(x[:, :32], q8, s8), "qweight"),
        (lambda: int8_weight_only_linear(x, q8, s8.half()), "scales"),
        (lambda: int8_weight_only_linear(x, q8, s8, torch.zeros(15)), "bias"),
        (lambda: int8_weight_only_linear(x, q8.t().contiguous().t(), s8), "qweight must be contiguous"),
        (lambda: int4_weight_only_linear(x, q4.to(torch.int64), s4, z4, 32), "qweight"),
        (lambda: int4_weight_only_linear(x, q4, s4, z4, 48), "group_size"),
        (lambda: int4_weight_only_linear(x, q4, s4[:1], z4, 32), "scales"),
        (lambda: int4_weight_only_linear(x, q4, s4, z4.half(), 32), "zeros"),
        (lambda: int4_weight_only_linear(x, q4, s4, z4, 32, torch.zeros(16, dtype=torch.half)), "bias"),
        (lambda: quantize_int4_grouped(torch.randn(4, 96), 64), "K = 96"),
        (lambda: quantize_int8_per_channel(torch.randn(4)), "w must be"),
        (lambda: pack_int4(torch.full((8, 2), 16)), "0..15"),
        (lambda: pack_int4(torch.zeros(12, 2, dtype=torch.uint8)), "multiple of 8"),
        (lambda: unpack_int4(torch.zeros(2, 2, dtype=torch.int64)), "int32"),
        (lambda: dequantize_int8_to(q8.int(), s8, torch.float32), "qweight"),
        (lambda: dequantize_int8_to(q8, s8[:8], torch.float32), "scales"),
        (lambda: dequantize_int8_to(q8, s8, torch.int8), "dtype"),
        (lambda: dequantize_int4_to(q4, s4, z4, 48, torch.float32), "group_size"),
        (lambda: dequantize_int4_to(q4, s4, z4[:, :8], 32, torch.float32), "zeros"),
        (lambda: dequantize_int4_to(q4.t().contiguous().t(), s4, z4, 32, torch.float32), "qweight must be"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.cuda
def test_validation_rejects_mixed_devices():
    x = torch.randn(2, 64, device="cuda")
    q8, s8 = quantize_int8_per_channel(torch.randn(16, 64))
    with pytest.raises(ValueError, match="qweight is on cpu"):
        int8_weight_only_linear(x, q8, s8.cuda())


# ----------------------------------------------------------------------------------------- real shapes (GPU)
@pytest.mark.cuda
@pytest.mark.parametrize("layer", list(QWEN_7B))
@pytest.mark.parametrize("M", [1, 8, 64, 300])
def test_qwen7b_shapes_match_ref_on_cuda(layer, M):
    K, N = QWEN_7B[layer]
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    bias = torch.randn(N, device="cuda", generator=gen).to(torch.bfloat16) if layer == "qkv" else None
    q8, s8 = quantize_int8_per_channel(w)
    _assert_close_to_ref(int8_weight_only_linear(x, q8, s8, bias),
                         int8_weight_only_linear_ref(x, q8, s8, bias), torch.bfloat16)
    q4, s4, z4 = quantize_int4_grouped(w, 128)
    _assert_close_to_ref(int4_weight_only_linear(x, q4, s4, z4, 128, bias),
                         int4_weight_only_linear_ref(x, q4, s4, z4, 128, bias), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, DEQUANT_GEMM_MIN_M])
def test_cuda_graph_capture_and_replay(M):
    """The launch captures (no host sync, grid from shapes only) and a replay sees new activations; at
    DEQUANT_GEMM_MIN_M rows the captured work is the dequantization kernel and cuBLAS."""
    K, N = 3584, 4608
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    q4, s4, z4 = quantize_int4_grouped(w, 128)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    int4_weight_only_linear(x, q4, s4, z4, 128)                    # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_weight_only_linear(x, q4, s4, z4, 128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _assert_close_to_ref(out, int4_weight_only_linear_ref(x, q4, s4, z4, 128), torch.bfloat16)
