"""per_token_quant_fp8 (Triton; CUDA, or the interpreter on CPU) against the torch quantize_fp8_rows that the CPU
engine runs: the same e4m3 bits and fp32 scales, dynamic and static, with zero-padded columns, strided rows, all-zero
rows (the MIN_SCALE floor) and saturating rows; and its input checks (shared with per_token_quant_int8's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hayabusa.kernels.fp8_quant import MIN_SCALE, per_token_quant_fp8, per_token_quant_fp8_ref
from hayabusa.kernels.int8_quant import per_token_quant_int8
from hayabusa.quantization.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 64: one block; 100: one block, masked tail; 4104: two passes (> MAX_BLOCK = 4096), a ragged last chunk
KS = [64, 100, 4104]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _rows(M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[M, K] on CPU: rows from 1e-6 (fp8 subnormals after scaling) to 1e4, row 1 all zeros (half of them -0.0),
    the last row near the dtype's largest value (saturates under a small static scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-6, 4, M)[:, None]
    if M > 1:
        x[1] = 0.0
        x[1, ::2] = -0.0
    if M > 2:
        x[-1] = torch.randn(K, generator=g).sign() * (6e4 if dtype == torch.float16 else 1e30)
    return x.to(dtype)


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (qr, sr) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == qr.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == sr.shape and s.is_contiguous()
    assert torch.equal(s, sr)
    assert torch.equal(_bits(q), _bits(qr))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_quant_fp8_matches_torch(device, dtype, M, K, static):
    """Bit-identical to quantize_fp8_rows (same device); when K is not a multiple of 16 also with out_cols = K
    rounded up to 16 (what Fp8LinearMethod asks for), against quantize_fp8_rows zero-padded."""
    x = _rows(M, K, dtype, seed=M * K).to(device)
    scale = torch.tensor(0.02, device=device) if static else None
    want = quantize_fp8_rows(x, scale)
    _assert_same(per_token_quant_fp8(x, scale), want)
    if K % 16:
        cols = -(-K // 16) * 16
        padded = (F.pad(_bits(want[0]), (0, cols - K)).view(FP8_DTYPE), want[1])
        _assert_same(per_token_quant_fp8(x, scale, out_cols=cols), padded)
    if M > 1 and not static:
        assert float(want[1][1]) == pytest.approx(MIN_SCALE, rel=1e-7)      # the all-zero row: the floor
    if M > 2:
        assert _bits(want[0][-1]).eq(0x7E).logical_or(_bits(want[0][-1]).eq(0xFE)).all()   # +-448, never NaN


def test_per_token_quant_fp8_every_e4m3_value_and_tie(device):
    """Every finite e4m3 value, every midpoint between neighbours (ties go to the even mantissa) and values past
    448, times a static scale of 0.75 (exact in fp32), and unscaled with dynamic scales (each row holds 448, so
    its scale is exactly 1): the kernel's bits equal torch's round-to-nearest-even cast."""
    allv = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    pos = torch.unique(allv[torch.isfinite(allv) & (allv >= 0)])          # sorted, 0 .. 448
    mids = (pos[1:] + pos[:-1]) / 2
    xs = torch.cat([pos, mids, -pos, -mids])
    W = 63                                                                # values per row; column 63 is 448
    body = torch.full((-(-xs.numel() // W) * W,), FP8_MAX)
    body[:xs.numel()] = xs
    body = body.view(-1, W)
    x = torch.cat([body, torch.full((body.shape[0], 1), FP8_MAX)], dim=1).to(device)
    scale = torch.tensor([0.75], device=device)
    _assert_same(per_token_quant_fp8(x * 0.75, scale), quantize_fp8_rows(x * 0.75, scale))
    _assert_same(per_token_quant_fp8(x * 0.75 * 4, scale), quantize_fp8_rows(x * 0.75 * 4, scale))   # saturates
    q, s = per_token_quant_fp8(x)
    _assert_same((q, s), quantize_fp8_rows(x))
    assert torch.equal(s, torch.ones_like(s))
    assert torch.equal(q[:, :W].float().reshape(-1)[:pos.numel()], pos.to(device))          # exact stays exact


@pytest.mark.parametrize("static", [False, True])
def test_per_token_quant_fp8_strided_rows(device, static):
    """x a column slice of a wider tensor (row stride K + 24): the kernel reads rows by their stride."""
    base = _rows(5, 124, torch.bfloat16, seed=7).to(device)
    x = base[:, 8:108]
    assert not x.is_contiguous() and x.stride() == (124, 1)
    scale = torch.tensor([0.5], device=device) if static else None
    _assert_same(per_token_quant_fp8(x, scale), quantize_fp8_rows(x.contiguous(), scale))
    q, s = per_token_quant_fp8(x, scale, out_cols=128)
    assert torch.equal(_bits(q[:, 100:]), torch.zeros(5, 28, dtype=torch.uint8, device=device))


def test_per_token_quant_fp8_static_scale_is_read_on_the_device(device):
    """The scale is a pointer, not a host value: writing the tensor in place (as a CUDA graph replay would see)
    changes the next result."""
    x = _rows(3, 64, torch.float32, seed=1).to(device)
    scale = torch.tensor([1.0], device=device)
    per_token_quant_fp8(x, scale)
    scale.fill_(0.25)
    q, s = per_token_quant_fp8(x, scale)
    assert torch.equal(s, torch.full((3, 1), 0.25, device=device))
    _assert_same((q, s), quantize_fp8_rows(x, scale))


def test_per_token_quant_fp8_no_rows(device):
    q, s = per_token_quant_fp8(torch.empty(0, 96, dtype=torch.bfloat16, device=device), out_cols=112)
    assert q.shape == (0, 112) and q.dtype == FP8_DTYPE and s.shape == (0, 1) and s.dtype == torch.float32


def test_reference_on_cpu_is_the_float_division():
    """On CPU, dividing the amax by a 448 tensor (what the reference does so that CUDA gets IEEE division too)
    gives the bits of the former `amax / 448.0`: the CPU engine's results are unchanged."""
    x = torch.randn(4096, 33) * torch.logspace(-8, 8, 4096)[:, None]
    q, s = per_token_quant_fp8_ref(x)
    s_old = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    assert torch.equal(s, s_old)
    assert torch.equal(_bits(q), _bits((x / s_old).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)))


@pytest.mark.parametrize("quant", [per_token_quant_fp8, per_token_quant_int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("make, match", [
    (lambda d: dict(x=torch.randn(4, 8, 2, device=d)), "x must be"),
    (lambda d: dict(x=torch.randn(4, 8, device=d).to(torch.float64)), "x must be"),
    (lambda d: dict(x=torch.zeros(4, 8, dtype=torch.int32, device=d)), "x must be"),
    (lambda d: dict(x=torch.randn(4, 8, device=d).to(FP8_DTYPE)), "x must be"),
    (lambda d: dict(x=torch.randn(4, 0, device=d)), "K = 0"),
    (lambda d: dict(x=torch.randn(8, 4, device=d).t()), "unit stride"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), static_scale=torch.tensor([1.0, 2.0], device=d)), "static_scale"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), static_scale=torch.tensor([1.0], dtype=torch.float64,
                                                                               device=d)), "static_scale"),
    (lambda d: dict(x=torch.randn(4, 8, device=d), static_scale=0.5), "static_scale"),
])
def test_per_token_quantizers_reject_bad_input_alike(device, quant, make, match):
    """The int8 and fp8 activation quantizers share their input checks (kernels/per_token_quant.py)."""
    with pytest.raises(ValueError, match=match):
        quant(**make(device))


@pytest.mark.parametrize("out_cols", [7, 16.0])
def test_per_token_quant_fp8_rejects_bad_out_cols(device, out_cols):
    with pytest.raises(ValueError, match="out_cols"):
        per_token_quant_fp8(torch.randn(4, 8, device=device), out_cols=out_cols)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CPU and a CUDA tensor")
@pytest.mark.parametrize("quant", [per_token_quant_fp8, per_token_quant_int8], ids=["fp8", "int8"])
def test_per_token_quant_rejects_scale_on_another_device(quant):
    with pytest.raises(ValueError, match="static_scale"):
        quant(torch.randn(4, 8, device="cuda"), torch.tensor([1.0]))
