"""kernels/fused_act_quant.py: RMSNorm(+residual) and SiLU-and-mul that quantize their output per token, bit for
bit against the separate path they replace (the producer's kernel, then per_token_quant_int8 / _fp8), and their
torch references against the torch producer + the quantizer's reference (Triton: CUDA or the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels.activation import silu_and_mul
from hayabusa.kernels.fp8_quant import FP8_DTYPE, per_token_quant_fp8
from hayabusa.kernels.fused_act_quant import (rms_norm_quant, rms_norm_quant_ref, silu_and_mul_quant,
                                              silu_and_mul_quant_ref)
from hayabusa.kernels.fused_norm import fused_add_rms_norm
from hayabusa.kernels.int8_quant import per_token_quant_int8

QUANT = {"int8": per_token_quant_int8, "fp8": per_token_quant_fp8}
QDTYPE = {"int8": torch.int8, "fp8": FP8_DTYPE}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _assert_same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape == (q.shape[0], 1)
    assert torch.equal(_bits(q), _bits(q_ref)), "quantized rows differ"
    assert torch.equal(s, s_ref), "scales differ"


def _rows(T: int, N: int, dtype, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, N, generator=g) * torch.logspace(-2, 1, T)[:, None]).to(dtype).to(device)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [64, 200, 1024])
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("T", [5, 20])     # up to COLUMN_PARALLEL_MAX_T: norm + column-parallel quantize; above: one
def test_rms_norm_quant_is_norm_then_quantizer_bit_for_bit(device, kind, dtype, N, with_res, T):
    x, res = _rows(T, N, dtype, N, device), _rows(T, N, dtype, N + 1, device) if with_res else None
    w = (1 + 0.3 * _rows(1, N, torch.float32, 7, device)[0]).to(dtype)
    xq, s, res_out = rms_norm_quant(x, res, w, 1e-5, kind)
    out, res_want = fused_add_rms_norm(x, res, w, 1e-5)
    _assert_same((xq, s), QUANT[kind](out))
    assert xq.dtype == QDTYPE[kind]
    if with_res:
        assert torch.equal(res_out, res_want)
    else:
        assert res_out is None
    # the reference is the torch norm + the quantizer's reference
    q_ref, s_ref, r_ref = rms_norm_quant_ref(x.cpu(), None if res is None else res.cpu(), w.cpu(), 1e-5, kind)
    assert q_ref.dtype == QDTYPE[kind] and s_ref.shape == (T, 1)
    assert (r_ref is None) == (not with_res)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [48, 300, 5000])       # 5000 > MAX_BLOCK: the two-pass path (above 16 rows)
@pytest.mark.parametrize("T", [4, 19])                # 4: the column-parallel launches (5 column blocks at 5000)
def test_silu_and_mul_quant_is_activation_then_quantizer_bit_for_bit(device, kind, dtype, D, T):
    x = _rows(T, 2 * D, dtype, D, device) * 3
    x[1] = 0.0                                          # an all-zero row: the scale floor, q = 0
    xq, s = silu_and_mul_quant(x, kind)
    _assert_same((xq, s), QUANT[kind](silu_and_mul(x)))
    assert torch.all(_bits(xq[1]) == 0)
    big = torch.zeros(T, 3 * D, dtype=dtype, device=device)   # a row stride > 2D
    big[:, :2 * D] = x
    _assert_same(silu_and_mul_quant(big[:, :2 * D], kind), (xq, s))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_references_are_the_torch_producers_then_the_quantizer_refs(kind):
    from hayabusa.kernels.activation import silu_and_mul_ref
    from hayabusa.kernels.fp8_quant import per_token_quant_fp8_ref
    from hayabusa.kernels.fused_norm import fused_add_rms_norm_ref
    from hayabusa.kernels.int8_quant import per_token_quant_int8_ref

    ref = {"int8": per_token_quant_int8_ref, "fp8": per_token_quant_fp8_ref}[kind]
    x, r = _rows(6, 96, torch.bfloat16, 1, "cpu"), _rows(6, 96, torch.bfloat16, 2, "cpu")
    w = torch.rand(96).to(torch.bfloat16) + 0.5
    q, s, res = rms_norm_quant_ref(x, r, w, 1e-6, kind)
    out, res_want = fused_add_rms_norm_ref(x, r, w, 1e-6)
    _assert_same((q, s), ref(out))
    assert torch.equal(res, res_want)
    g = _rows(6, 192, torch.bfloat16, 3, "cpu")
    _assert_same(silu_and_mul_quant_ref(g, kind), ref(silu_and_mul_ref(g)))


def test_column_parallel_bound_is_the_one_documented():
    """Decode-sized inputs (1-16 rows) take the column-parallel launches, the tests above cover both sides."""
    from hayabusa.kernels.fused_act_quant import COL_BLOCK, COLUMN_PARALLEL_MAX_T

    assert COLUMN_PARALLEL_MAX_T == 16 and 5 <= COLUMN_PARALLEL_MAX_T < 19 and 48 < COL_BLOCK < 5000


def test_empty_and_bad_inputs_are_refused_by_name(device):
    x = torch.randn(0, 64, device=device)
    q, s, r = rms_norm_quant(x, None, torch.ones(64, device=device), 1e-5, "int8")
    assert q.shape == (0, 64) and s.shape == (0, 1) and r is None
    assert silu_and_mul_quant(torch.randn(0, 64, device=device), "fp8")[0].shape == (0, 32)
    w = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="kind"):
        rms_norm_quant(torch.randn(2, 64, device=device), None, w, 1e-5, "int4")
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant(torch.randn(2, 64, device=device), None, w[:32], 1e-5, "int8")
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quant(torch.randn(2, 64, device=device), torch.randn(2, 32, device=device), w, 1e-5, "int8")
    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul_quant(torch.randn(2, 63, device=device), "int8")
    with pytest.raises(ValueError, match="kind"):
        silu_and_mul_quant(torch.randn(2, 64, device=device), "e5m2")


def test_rms_norm_quant_refuses_a_bad_eps_and_other_devices_by_name(device):
    """Found by a fresh user: eps = -1 or NaN ran (rsqrt of a negative: NaN rows, quantized), eps as a string
    failed inside the interpreter with an AttributeError, and a weight on another device failed in a copy. Each
    is now a ValueError naming the argument; an int eps (0) is a number like any other."""
    x, w = torch.randn(2, 64, device=device), torch.ones(64, device=device)
    for eps in (-1.0, float("nan"), float("inf"), "1e-6", None, True):
        with pytest.raises(ValueError, match="eps"):
            rms_norm_quant(x, None, w, eps, "fp8")
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant(x, None, w.to("meta"), 1e-6, "fp8")
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quant(x, torch.randn(2, 64, device="meta"), w, 1e-6, "fp8")
    with pytest.raises(ValueError, match="x must be"):
        rms_norm_quant([[1.0]], None, w, 1e-6, "fp8")
    q, s, _ = rms_norm_quant(x, None, w, 0, "int8")
    assert q.shape == (2, 64) and bool(torch.isfinite(s).all())


# ------------------------------------------------------------- deferred quantization (the consumer quantizes)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_amax_forms_then_quantize_cols_are_the_one_call(device, T):
    """rms_norm_amax / silu_and_mul_amax (the column-parallel first launch alone) then quantize_cols give the bits
    of rms_norm_quant / silu_and_mul_quant; the normed rows and the new residual are fused_add_rms_norm's."""
    from hayabusa.kernels.fused_act_quant import quantize_cols, rms_norm_amax, silu_and_mul_amax

    g = torch.Generator().manual_seed(T)
    bf = torch.bfloat16
    x = torch.randn(T, 200, generator=g).to(bf).to(device)
    res = torch.randn(T, 200, generator=g).to(bf).to(device)
    w = (torch.rand(200, generator=g) + 0.5).to(bf).to(device)
    h, amax, r = rms_norm_amax(x, res, w, 1e-6)
    xq, s, r2 = rms_norm_quant(x, res, w, 1e-6, "fp8")
    out, r3 = fused_add_rms_norm(x, res, w, 1e-6)
    assert amax.shape == (T, 1) and torch.equal(h, out) and torch.equal(r, r2) and torch.equal(r, r3)
    q2, s2 = quantize_cols(h, amax, "fp8")
    assert torch.equal(q2.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(s2, s)
    gu = torch.randn(T, 2 * 2100, generator=g).to(bf).to(device)      # 3 column blocks of 1,024
    h, amax = silu_and_mul_amax(gu)
    assert amax.shape == (T, 3) and torch.equal(h, silu_and_mul(gu))
    xq, s = silu_and_mul_quant(gu, "fp8")
    q2, s2 = quantize_cols(h, amax, "fp8")
    assert torch.equal(q2.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(s2, s)
    with pytest.raises(ValueError, match="1..16 rows"):
        silu_and_mul_amax(torch.cat([gu] * 17)[:17])
    with pytest.raises(ValueError, match="1..16 rows"):
        rms_norm_amax(torch.cat([x] * 17)[:17], None, w, 1e-6)


@pytest.mark.parametrize("T", [1, 5, 16])
def test_fp8_consumer_quantizing_from_amax_partials_is_the_xq_launch(device, T):
    """fp8_small_m_linear(h, x_amax=amax) (the consumer quantizes its own tiles from the producer's amax partials)
    gives the bits of the XQ launch on the producer's quantized rows, for the norm's one partial per row and
    SiLU-and-mul's three, split-K and not."""
    from hayabusa.kernels.fp8_gemv import fp8_small_m_linear
    from hayabusa.kernels.fp8_quant import per_token_quant_fp8_ref
    from hayabusa.kernels.fused_act_quant import quantize_cols, rms_norm_amax, silu_and_mul_amax
    from hayabusa.kernels.quant_linear import LaunchConfig

    g = torch.Generator().manual_seed(T)
    bf = torch.bfloat16
    x = torch.randn(T, 200, generator=g).to(bf).to(device)
    w8 = (torch.rand(200, generator=g) + 0.5).to(bf).to(device)
    gu = torch.randn(T, 2 * 2100, generator=g).to(bf).to(device)
    cases = [rms_norm_amax(x, None, w8, 1e-6)[:2], silu_and_mul_amax(gu)]
    for (h, amax), split in zip(cases, (1, 3)):
        K = h.shape[1]
        wq, sw = per_token_quant_fp8_ref(torch.randn(72, K, generator=g) / 10)
        wq, sw = wq.to(device), sw.view(-1).contiguous().to(device)
        cfg = LaunchConfig("dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split, num_warps=4, num_stages=2)
        xq, s = quantize_cols(h, amax, "fp8")
        ref = fp8_small_m_linear(xq, wq, sw, None, x_scale=s, out_dtype=bf, cfg=cfg)
        y = fp8_small_m_linear(h, wq, sw, None, x_amax=amax, cfg=cfg)
        assert y.dtype == bf and torch.equal(y, ref), float((y.float() - ref.float()).abs().max())
    h, amax = cases[0]
    for bad, match in (({"x_amax": amax[:, :0]}, "x_amax must be"), ({"x_amax": amax.double()}, "x_amax must be"),
                       ({"x_amax": amax, "input_scale": torch.ones(1, device=device)}, "x_amax must be")):
        with pytest.raises(ValueError, match=match):
            fp8_small_m_linear(h, wq[:, :200].contiguous(), sw, None, **bad)


def test_quantize_cols_refuses_what_its_kernel_would_misread_by_name(device):
    """quantize_cols (public: the deferred activation's second launch) reads row t of h at t * D and amax at t * P:
    a strided h or an amax of other rows was quantized silently wrong (or read out of bounds); now refused naming
    h / amax / kind. silu_and_mul_quant names a non-tensor x (it read x.device for the kind first)."""
    from hayabusa.kernels.fused_act_quant import quantize_cols, silu_and_mul_amax

    gu = _rows(3, 2 * 1100, torch.bfloat16, 7, device)
    h, amax = silu_and_mul_amax(gu)
    want = quantize_cols(h, amax, "fp8")
    for args, match in (((h.t().contiguous().t(), amax), "h must be"), (([[1.0]], amax), "h must be"),
                        ((h[:, :0], amax), "h must be"), ((h.to(torch.int32), amax), "h must be"),
                        ((h, amax[:1]), r"amax must be \[3, "), ((h, amax.t().contiguous().t()), "amax must be"),
                        ((h, amax.double()), "amax must be"), ((h, amax[:, :0]), "amax must be")):
        with pytest.raises(ValueError, match=match):
            quantize_cols(*args, "fp8")
    with pytest.raises(ValueError, match="kind must be one of"):
        quantize_cols(h, amax, "fp4")
    _assert_same(quantize_cols(h.clone(), amax.clone(), "fp8"), want)   # a good call still gives the same bits
    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul_quant([[1.0, 2.0]], "fp8")


def test_fp8_consumer_from_amax_partials_gemv_padded_bias_fp16(device):
    """fp8_small_m_linear's x_amax on what the engine's table never sends it but a loaded table or cfg may: the
    "gemv" kind (1 / 4 rows a program, split-K, rows of a tile beyond M), a weight padded to K' > K, a bias, an fp16
    x: the XQ launch's bits on quantize_cols' rows, the same cfg. An e4m3 x or a static scale with x_amax is
    refused, naming which."""
    from hayabusa.kernels.fp8_gemv import fp8_small_m_linear
    from hayabusa.kernels.fp8_quant import per_token_quant_fp8_ref
    from hayabusa.kernels.fused_act_quant import quantize_cols, silu_and_mul_amax
    from hayabusa.kernels.quant_linear import LaunchConfig

    g = torch.Generator().manual_seed(5)
    for dtype, T, cfg in ((torch.bfloat16, 3, LaunchConfig("gemv", BLOCK_M=4, BLOCK_N=16, BLOCK_K=256, SPLIT_K=3,
                                                           num_warps=4, num_stages=1)),
                          (torch.float16, 2, LaunchConfig("gemv", BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, SPLIT_K=1,
                                                          num_warps=4, num_stages=1))):
        gu = (torch.randn(T, 2 * 1100, generator=g) * 3).to(dtype).to(device)   # 2 column blocks of 1,024
        h, amax = silu_and_mul_amax(gu)
        wq, sw = per_token_quant_fp8_ref(torch.randn(24, 1100 + 20, generator=g) / 10)   # K' = K + 20
        wq, sw = wq.to(device), sw.view(-1).contiguous().to(device)
        b = torch.randn(24, generator=g).to(dtype).to(device)
        xq, s = quantize_cols(h, amax, "fp8")
        ref = fp8_small_m_linear(xq, wq, sw, b, x_scale=s, out_dtype=dtype, cfg=cfg)
        y = fp8_small_m_linear(h, wq, sw, b, x_amax=amax, cfg=cfg)
        assert y.dtype == dtype and torch.equal(y, ref), (dtype, float((y.float() - ref.float()).abs().max()))
    with pytest.raises(ValueError, match="x_amax must be None with an e4m3 x"):
        fp8_small_m_linear(xq, wq, sw, None, x_scale=s, x_amax=amax)
    with pytest.raises(ValueError, match="x_amax must be None with input_scale"):
        fp8_small_m_linear(h, wq, sw, None, torch.ones(1, device=device), x_amax=amax)
    y0 = fp8_small_m_linear(h[:0], wq, sw, None, x_amax=amax[:0])
    assert y0.shape == (0, 24)
