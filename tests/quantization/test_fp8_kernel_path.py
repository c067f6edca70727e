"""Fp8LinearMethod's _scaled_mm branch (CUDA sm89+) quantizes its activations with the one-launch Triton kernel
per_token_quant_fp8, not the torch quantize_fp8_rows. Runs without such a GPU: has_fp8_matmul is forced on and
torch._scaled_mm is replaced by its exact emulation, so the branch (weight padding to 16, the kernel's out_cols,
static scale, slicing N back) runs for real, on CUDA or under the Triton interpreter on CPU. Decode-sized inputs
(M <= FP8_SMALL_M_MAX) take fp8_small_m_linear instead, unless USE_FP8_SMALL_M is off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hayabusa.quantization.fp8 as fp8
from hayabusa.model.layers.linear import Linear
from hayabusa.quantization import set_quantization_config
from tests.kernels.conftest import DEVICE, SKIP_REASON


def _scaled_mm_layer(K: int, N: int, dtype: torch.dtype, monkeypatch, static_scale: float | None = None) -> Linear:
    """An online-fp8 Linear whose process_weights_after_loading believes it runs on an FP8 GPU."""
    monkeypatch.setattr(fp8, "has_fp8_matmul", lambda device: True)
    g = torch.Generator().manual_seed(K * N)
    w, b = torch.randn(N, K, generator=g) / K ** 0.5, torch.randn(N, generator=g)
    dev = torch.device(DEVICE)
    with set_quantization_config(fp8.Fp8Config.online()):
        layer = Linear(K, [N], True, dtype, dev)
    method = fp8.Fp8LinearMethod(checkpoint_fp8=False)
    layer.create_weights(method)
    layer.weight.weight_loader(layer.weight, w.to(dev, dtype), None)
    layer.bias.weight_loader(layer.bias, b.to(dev, dtype), None)
    method.process_weights_after_loading(layer)
    if static_scale is not None:
        layer.input_scale = torch.nn.Parameter(torch.tensor(static_scale, device=dev), requires_grad=False)
    return layer


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("K, N", [(40, 24), (64, 32)])          # K padded to 48 / already a multiple of 16
def test_scaled_mm_branch_quantizes_with_the_triton_kernel(monkeypatch, K, N, static):
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    dtype = torch.bfloat16
    monkeypatch.setattr(fp8, "USE_FP8_SMALL_M", False)        # 6 rows would take fp8_small_m_linear (below)
    layer = _scaled_mm_layer(K, N, dtype, monkeypatch, static_scale=0.01 if static else None)
    assert layer.fp8_scaled_mm and layer.weight.shape == (-(-N // 16) * 16, -(-K // 16) * 16)
    Kp = layer.weight.shape[1]

    calls = []
    kernel = fp8.per_token_quant_fp8

    def kernel_spy(x2, static_scale=None, out_cols=None):
        out = kernel(x2, static_scale, out_cols)
        calls.append((x2, static_scale, out_cols, out))
        return out

    monkeypatch.setattr(fp8, "per_token_quant_fp8", kernel_spy)

    def no_torch_quant(*args, **kwargs):
        raise AssertionError("the _scaled_mm branch must not quantize x with quantize_fp8_rows")

    torch_quant = fp8.quantize_fp8_rows
    monkeypatch.setattr(fp8, "quantize_fp8_rows", no_torch_quant)
    monkeypatch.setattr(fp8, "fp8_matmul_cuda", lambda xq, sx, wq_t, sw_row, out_dtype:
                        fp8.fp8_matmul_emulated(xq, sx, wq_t.t(), sw_row.view(-1), out_dtype))

    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    y = layer(x)
    assert y.shape == (2, 3, N) and y.dtype == dtype

    assert len(calls) == 1                                   # one launch quantizes the whole [T, K] input
    x2, scale, out_cols, (xq, sx) = calls[0]
    assert x2.shape == (6, K) and out_cols == Kp
    assert (scale is layer.input_scale) if static else scale is None
    want_q, want_s = torch_quant(x.reshape(6, K), layer.input_scale)
    assert torch.equal(sx, want_s)
    assert torch.equal(xq.view(torch.uint8), F.pad(want_q.view(torch.uint8), (0, Kp - K)))

    # the product of those bits: the CPU path's numerics on the unpadded weight (bf16 output, then the bias)
    ref = fp8.fp8_matmul_emulated(want_q, want_s, layer.weight[:N, :K], layer.weight_scale[:N], torch.float32)
    ref = ref.to(torch.bfloat16).to(dtype) + layer.bias
    torch.testing.assert_close(y.reshape(6, N), ref, atol=2e-2, rtol=2e-2)


def _forbid(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} must not run on this path")
    return fail


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("M,engine_max", [(1, None), (6, None), (6, 16), (17, 16)])
def test_small_m_rows_take_the_fused_kernel(monkeypatch, M, engine_max, static):
    """Up to FP8_SMALL_M_ENGINE_MAX rows (1 by default; 16 = the kernels' FP8_SMALL_M_MAX set here): one
    fp8_small_m_linear call on the padded weight with the layer's bias, scales and true N, and no separate quantize
    or _scaled_mm; more rows, up to FP8_PREQUANT_ENGINE_MAX with dynamic scales: the quantizer, then one XQ call on
    its rows; beyond (or static): the quantizer + _scaled_mm as before. The output is the CPU emulation's within the
    output's rounding (the emulation adds the bias after its cast)."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    if engine_max is not None:
        monkeypatch.setattr(fp8, "FP8_SMALL_M_ENGINE_MAX", engine_max)
    K, N = 40, 24
    dtype = torch.bfloat16
    layer = _scaled_mm_layer(K, N, dtype, monkeypatch, static_scale=0.01 if static else None)
    calls = []
    fused = fp8.fp8_small_m_linear

    def fused_spy(x2, w, sw, bias, input_scale, n, **kw):
        calls.append((x2.shape, w, sw, bias, input_scale, n, kw))
        return fused(x2, w, sw, bias, input_scale, n, **kw)

    monkeypatch.setattr(fp8, "fp8_small_m_linear", fused_spy)
    small = M <= fp8.FP8_SMALL_M_ENGINE_MAX
    assert small == fp8.use_small_m_kernel(M)
    xq_launch = not small and not static and fp8.use_small_m_kernel(M, prequantized=True)
    if small:
        monkeypatch.setattr(fp8, "per_token_quant_fp8", _forbid("per_token_quant_fp8"))
        monkeypatch.setattr(fp8, "fp8_matmul_cuda", _forbid("_scaled_mm"))
    elif xq_launch:
        monkeypatch.setattr(fp8, "fp8_matmul_cuda", _forbid("_scaled_mm"))
    else:
        monkeypatch.setattr(fp8, "fp8_matmul_cuda", lambda xq, sx, wq_t, sw_row, out_dtype:
                            fp8.fp8_matmul_emulated(xq, sx, wq_t.t(), sw_row.view(-1), out_dtype))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    y = layer(x)
    assert y.shape == (M, N) and y.dtype == dtype
    if small:
        assert len(calls) == 1
        shape, w, sw, bias, scale, n, kw = calls[0]
        assert shape == (M, K) and w is layer.weight and w.shape == (32, 48) and sw is layer.weight_scale
        assert bias is layer.bias and n == N and (scale is layer.input_scale if static else scale is None)
        assert kw == {}
    elif xq_launch:
        assert len(calls) == 1
        shape, w, sw, bias, scale, n, kw = calls[0]
        assert shape == (M, 48) and w is layer.weight and scale is None and n == N and bias is layer.bias
        assert kw["x_scale"].shape == (M, 1) and kw["out_dtype"] == dtype
    else:
        assert calls == []
    xq, sx = fp8.quantize_fp8_rows(x, layer.input_scale)
    ref = fp8.fp8_matmul_emulated(xq, sx, layer.weight[:N, :K], layer.weight_scale[:N], torch.float32) + layer.bias
    err = float((y.float() - ref).abs().max())
    assert err <= 2 * 2.0 ** -7 * float(ref.abs().max()), err


def test_small_m_switch_off_keeps_the_scaled_mm_path(monkeypatch):
    """USE_FP8_SMALL_M = False (HAYABUSA_FP8_SMALL_M=0 at import): one row goes through the quantizer and _scaled_mm."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    layer = _scaled_mm_layer(64, 32, torch.bfloat16, monkeypatch)
    monkeypatch.setattr(fp8, "USE_FP8_SMALL_M", False)
    monkeypatch.setattr(fp8, "fp8_small_m_linear", _forbid("fp8_small_m_linear"))
    used = []
    monkeypatch.setattr(fp8, "fp8_matmul_cuda", lambda xq, sx, wq_t, sw_row, out_dtype: used.append(1) or
                        fp8.fp8_matmul_emulated(xq, sx, wq_t.t(), sw_row.view(-1), out_dtype))
    assert layer(torch.randn(1, 64).to(DEVICE, torch.bfloat16)).shape == (1, 32) and used == [1]


def test_fp16_rows_keep_the_scaled_mm_path(monkeypatch):
    """fp16 activations stay on the quantizer + _scaled_mm at any M (the small-M kernel's fp16 cases failed their
    bound on the H200 in run AF; bf16 passed): one fp16 row goes through _scaled_mm, never fp8_small_m_linear."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    layer = _scaled_mm_layer(64, 32, torch.float16, monkeypatch)
    monkeypatch.setattr(fp8, "fp8_small_m_linear", _forbid("fp8_small_m_linear"))
    used = []
    monkeypatch.setattr(fp8, "fp8_matmul_cuda", lambda xq, sx, wq_t, sw_row, out_dtype: used.append(1) or
                        fp8.fp8_matmul_emulated(xq, sx, wq_t.t(), sw_row.view(-1), out_dtype))
    assert layer(torch.randn(1, 64).to(DEVICE, torch.float16)).shape == (1, 32) and used == [1]


@pytest.mark.parametrize("M,engine_max", [(1, None), (3, None), (3, 4), (0, None)])
def test_prequantized_rows_take_the_xq_launch(monkeypatch, M, engine_max):
    """An activation its producer quantized (QuantizedActivation: rms_norm_quant / silu_and_mul_quant) with M <=
    FP8_PREQUANT_ENGINE_MAX rows: one fp8_small_m_linear call on x_q with its scales and no _scaled_mm; more rows:
    _scaled_mm on the same x_q. input_quant asks the producer to quantize at every M then (at M = 1 too, which
    without the XQ launch keeps the plain x for the kernel that quantizes inside). The result is the plain x's
    within the output's rounding (bias included)."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    from hayabusa.quantization.act_quant import quantize_ref

    if engine_max is not None:
        monkeypatch.setattr(fp8, "FP8_PREQUANT_ENGINE_MAX", engine_max)
    K, N = 64, 32                          # K a multiple of 16: no padding, so the producer may quantize
    layer = _scaled_mm_layer(K, N, torch.bfloat16, monkeypatch)
    M_ = max(M, 1)
    assert layer.quant_method.input_quant(layer, M_) == "fp8"
    small = 0 < M <= fp8.FP8_PREQUANT_ENGINE_MAX
    calls, used = [], []
    kernel = fp8.fp8_small_m_linear

    def spy(x, w, sw, bias, input_scale, n, **kw):
        calls.append((x, w, sw, bias, input_scale, n, kw))
        return kernel(x, w, sw, bias, input_scale, n, **kw)

    monkeypatch.setattr(fp8, "fp8_small_m_linear", spy)
    monkeypatch.setattr(fp8, "fp8_matmul_cuda", lambda xq, sx, wq_t, sw_row, out_dtype: used.append(1) or
                        fp8.fp8_matmul_emulated(xq, sx, wq_t.t(), sw_row.view(-1), out_dtype))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, torch.bfloat16)
    qa = quantize_ref(x, "fp8")
    y = layer(qa)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    if small:
        assert used == [] and len(calls) == 1
        xq, w, sw, bias, scale, n, kw = calls[0]
        assert xq is qa.xq and kw["x_scale"] is qa.scale and kw["out_dtype"] == torch.bfloat16
        assert w is layer.weight and sw is layer.weight_scale and bias is layer.bias and scale is None and n == N
    else:
        assert calls == [] and used == [1]
    if M:
        ref = fp8.fp8_matmul_emulated(qa.xq, qa.scale, layer.weight[:N], layer.weight_scale[:N], torch.float32)
        ref = ref + layer.bias
        err = float((y.float() - ref).abs().max())
        assert err <= 2 * 2.0 ** -7 * float(ref.abs().max()), err


def test_one_row_keeps_the_plain_x_when_the_xq_launch_is_off(monkeypatch):
    """FP8_PREQUANT_ENGINE_MAX = 0: one row is left unquantized for the kernel that quantizes inside (input_quant
    None), as before the XQ launches; two rows are still the producer's to quantize (for _scaled_mm)."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    monkeypatch.setattr(fp8, "FP8_PREQUANT_ENGINE_MAX", 0)
    layer = _scaled_mm_layer(64, 32, torch.bfloat16, monkeypatch)
    assert layer.quant_method.input_quant(layer, 1) is None
    assert layer.quant_method.input_quant(layer, 2) == "fp8"


def test_prequant_switch_off_is_the_path_before(monkeypatch):
    """USE_FP8_PREQUANT = False (HAYABUSA_FP8_PREQUANT=0 at import): no XQ launch at any M, and one row is left
    plain for the kernel that quantizes inside."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    monkeypatch.setattr(fp8, "USE_FP8_PREQUANT", False)
    assert not any(fp8.use_small_m_kernel(M, prequantized=True) for M in range(1, 17))
    layer = _scaled_mm_layer(64, 32, torch.bfloat16, monkeypatch)
    assert layer.quant_method.input_quant(layer, 1) is None
    assert not layer.quant_method.prefers_quantized_input(layer, 1, torch.bfloat16)
    used = []
    monkeypatch.setattr(fp8, "fp8_matmul_cuda", lambda xq, sx, wq_t, sw_row, out_dtype: used.append(1) or
                        fp8.fp8_matmul_emulated(xq, sx, wq_t.t(), sw_row.view(-1), out_dtype))
    assert layer(torch.randn(6, 64).to(DEVICE, torch.bfloat16)).shape == (6, 32) and used == [1]
