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
    with pytest.raises(ValueError, match="x must be .* got list"):   # a non-tensor x is named, not x.device
        silu_and_mul_quant([[1.0, 2.0]], "int8")
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
