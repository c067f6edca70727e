"""Each linear method against a float reference (CPU), shard-by-shard loading of quantized parameters into merged
layers, and load_weights' dtype rules. Bounds are stated next to each assertion with the value measured."""

from __future__ import annotations

import pytest
import torch

from hayabusa.errors import HayabusaValidationError
from hayabusa.model.layers.linear import Linear
from hayabusa.model.loader import load_weights
from hayabusa.quantization import set_quantization_config
from hayabusa.quantization.base import LinearMethod, make_param
from hayabusa.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Config,
    Fp8LinearMethod,
    fp8_matmul_emulated,
    quantize_fp8_rows,
)
from hayabusa.quantization.weight_only import Int4WeightOnlyLinearMethod, Int8WeightOnlyLinearMethod


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error |a - b| / |b|."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def _linear(method: LinearMethod, K: int, sizes: list[int], bias: bool, dtype=torch.float32, shards=None,
            w: torch.Tensor | None = None, b: torch.Tensor | None = None) -> Linear:
    """A Linear under ``method``, loaded with w [N, K] (and bias b) as one checkpoint tensor, processed."""
    with set_quantization_config(Fp8Config.online()):      # any config: the layer defers its weights
        layer = Linear(K, sizes, bias, dtype, torch.device("cpu"), shard_names=shards)
    layer.create_weights(method)
    if w is not None:
        layer.weight.weight_loader(layer.weight, w.to(dtype), None)
    if b is not None:
        layer.bias.weight_loader(layer.bias, b.to(dtype), None)
    method.process_weights_after_loading(layer)
    return layer


def _data(M: int, K: int, N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g)
    return x, w, b


# ---------------------------------------------------------------------------------------------- fp8
def test_fp8_row_quantization_error_is_half_a_step():
    """e4m3 keeps 3 mantissa bits: round-to-nearest is off by at most 2^-4 of the value for normal numbers, and
    by half the smallest subnormal step (2^-10 x scale) below them."""
    t = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]          # rows spanning 6 decades
    q, s = quantize_fp8_rows(t)
    assert q.dtype == FP8_DTYPE and s.shape == (64, 1) and s.dtype == torch.float32
    back = q.float() * s
    assert torch.all((back - t).abs() <= 2.0 ** -4 * t.abs() + 2.0 ** -10 * s)
    assert torch.allclose(t.abs().amax(1, keepdim=True), back.abs().amax(1, keepdim=True))  # amax -> 448 exactly
    assert float(q.float().abs().max()) == FP8_MAX


def test_fp8_emulation_is_the_dequantized_product():
    """The CPU path computes exactly (x_q s_x)(w_q s_w)^T up to fp32 summation order."""
    x, w, _ = _data(7, 96, 40)
    xq, sx = quantize_fp8_rows(x)
    wq, sw = quantize_fp8_rows(w)
    ref = (xq.float() * sx) @ (wq.float() * sw).t()
    assert _rel(fp8_matmul_emulated(xq, sx, wq, sw.view(-1), torch.float32), ref) < 1e-6


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_online_linear_vs_float(bias):
    """W8A8 e4m3 on K=256 random data: relative error 0.036 measured without the bias, 0.024 with it (two e4m3
    roundings of ~2.5 % RMS each); bound 0.06. The bias is added in full precision (bias-only difference: 0)."""
    x, w, b = _data(16, 256, 48)
    layer = _linear(Fp8LinearMethod(checkpoint_fp8=False), 256, [48], bias, w=w, b=b if bias else None)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (48,)
    y = layer(x)
    ref = x @ w.t() + (b if bias else 0)
    assert y.shape == (16, 48) and y.dtype == torch.float32
    assert _rel(y, ref) < 0.06
    if bias:   # exactly the bias-free product plus the bias
        nobias = _linear(Fp8LinearMethod(checkpoint_fp8=False), 256, [48], False, w=w)
        assert torch.allclose(y, nobias(x) + b, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_online_linear_half_precision(dtype):
    """bf16/fp16 activations in, same dtype out; error 0.028-0.029 measured, bound 0.06."""
    x, w, b = _data(5, 128, 32, seed=1)
    layer = _linear(Fp8LinearMethod(checkpoint_fp8=False), 128, [32], True, dtype=dtype, w=w, b=b)
    y = layer(x.to(dtype))
    assert y.dtype == dtype
    assert _rel(y.float(), x @ w.t() + b) < 0.06


def test_fp8_checkpoint_per_tensor_merged_scales_become_per_channel():
    """A merged q/k/v with one fp8 scale per checkpoint tensor: each shard keeps its own scale (no
    requantization), so the layer equals the three shards run separately."""
    K, sizes, names = 64, [32, 16, 16], ["q", "k", "v"]
    x, _, _ = _data(9, K, 1)
    method = Fp8LinearMethod(checkpoint_fp8=True, weight_strategy="tensor")
    with set_quantization_config(Fp8Config(True)):
        layer = Linear(K, sizes, False, torch.float32, torch.device("cpu"), shard_names=names)
    layer.create_weights(method)
    assert layer.weight_scale.shape == (3,)
    ref = []
    for i, (name, n) in enumerate(zip(names, sizes)):
        w = torch.randn(n, K, generator=torch.Generator().manual_seed(i)) * 10.0 ** (i - 1)  # scales 0.1 .. 10
        s = w.abs().max() / FP8_MAX
        wq = (w / s).to(FP8_DTYPE)
        layer.weight.weight_loader(layer.weight, wq, name)
        layer.weight_scale.weight_loader(layer.weight_scale, s.reshape(1), name)   # [1] or [] both load
        ref.append((wq, s))
    method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight_scale, torch.cat([s.expand(n) for (_, s), n in zip(ref, sizes)]))
    xq, sx = quantize_fp8_rows(x)
    expected = torch.cat([fp8_matmul_emulated(xq, sx, wq, s.expand(wq.shape[0]), torch.float32)
                          for wq, s in ref], dim=1)
    assert torch.equal(layer(x), expected)


def test_fp8_static_input_scale_takes_the_largest_shard_scale():
    K, sizes = 32, [16, 16]
    method = Fp8LinearMethod(checkpoint_fp8=True, weight_strategy="channel", static_input=True)
    with set_quantization_config(Fp8Config(True, "static")):
        layer = Linear(K, sizes, False, torch.float32, torch.device("cpu"), shard_names=["gate", "up"])
    layer.create_weights(method)
    w = torch.randn(32, K)
    wq, sw = quantize_fp8_rows(w)
    for name, sl, si in (("gate", slice(0, 16), 0.01), ("up", slice(16, 32), 0.02)):
        layer.weight.weight_loader(layer.weight, wq[sl], name)
        layer.weight_scale.weight_loader(layer.weight_scale, sw[sl], name)
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor(si), name)
    method.process_weights_after_loading(layer)
    assert float(layer.input_scale) == pytest.approx(0.02)
    x = torch.randn(4, K)
    xq = (x / 0.02).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)       # one static scale for every token
    expected = fp8_matmul_emulated(xq, torch.full((4, 1), 0.02), wq, sw.view(-1), torch.float32)
    assert torch.equal(layer(x), expected)


# ---------------------------------------------------------------------------------------------- weight-only
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weight_only_vs_float(bias):
    """Per-channel symmetric int8 weights, fp32 activations: 0.0068 measured without the bias, 0.0046 with it;
    bound 0.012."""
    x, w, b = _data(16, 256, 48)
    layer = _linear(Int8WeightOnlyLinearMethod(), 256, [48], bias, w=w, b=b if bias else None)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (48, 256) and layer.weight is None
    assert _rel(layer(x), x @ w.t() + (b if bias else 0)) < 0.012


@pytest.mark.parametrize("K", [256, 172, 64])
def test_int4_weight_only_vs_float_and_padding(K):
    """W4A16 g128 asymmetric RTN: 0.064-0.068 measured, bound 0.12. K=172 and K=64 (stories260K's shapes) are
    padded to a multiple of 128 with zero columns: the result equals x @ dequant(W)^T over the real columns."""
    from hayabusa.kernels.quant_linear import unpack_int4

    x, w, b = _data(16, K, 48)
    layer = _linear(Int4WeightOnlyLinearMethod(128), K, [48], True, w=w, b=b)
    Kp = -(-K // 128) * 128
    assert layer.int4_pad == Kp - K and layer.qweight.shape == (Kp // 8, 48) and layer.scales.shape == (Kp // 128, 48)
    y = layer(x)
    assert y.shape == (16, 48)
    assert _rel(y, x @ w.t() + b) < 0.12
    q = unpack_int4(layer.qweight).float()                                   # [Kp, N]
    g = torch.arange(Kp) // 128
    deq = (q - layer.zeros[g]) * layer.scales[g]                             # [Kp, N]
    assert torch.allclose(y, x @ deq[:K] + b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- loader hooks
class _PackedLinearMethod(LinearMethod):
    """An AWQ-shaped layout (qweight [K, N/8] int32 packed along the outputs, scales [K/G, N], g_idx [K] shared by
    all shards): only here to exercise the loader hooks a packed-checkpoint method relies on."""

    def create_weights(self, layer, in_features, output_sizes, dtype, device):
        N = sum(output_sizes)
        make_param(layer, "qweight", torch.zeros(in_features, N // 8, dtype=torch.int32), output_dim=1,
                   packed_factor=8)
        make_param(layer, "scales", torch.zeros(in_features // 16, N, dtype=dtype), output_dim=1)
        make_param(layer, "g_idx", torch.zeros(in_features, dtype=torch.int32), output_dim=None)
        make_param(layer, "input_scale", torch.zeros(len(output_sizes)), output_dim=None, shard_indexed=True,
                   optional=True)

    def apply(self, layer, x):
        raise NotImplementedError


class _TinyModel(torch.nn.Module):
    stacked_params_mapping = [(".qkv.", ".q.", "q"), (".qkv.", ".k.", "k"), (".qkv.", ".v.", "v")]

    def __init__(self, method: LinearMethod):
        super().__init__()
        with set_quantization_config(Fp8Config.online()):
            self.layer = torch.nn.Module()
            self.layer.qkv = Linear(32, [16, 8, 8], False, torch.float16, torch.device("cpu"),
                                    shard_names=["q", "k", "v"])
        self.layer.qkv.create_weights(method)

    def ignored_checkpoint_key(self, name: str) -> bool:
        return False


def test_packed_params_load_shard_by_shard_without_casts():
    model = _TinyModel(_PackedLinearMethod())
    ck = {}
    for s, n in (("q", 16), ("k", 8), ("v", 8)):
        ck[f"layer.{s}.qweight"] = torch.randint(-2**31, 2**31 - 1, (32, n // 8), dtype=torch.int32)
        ck[f"layer.{s}.scales"] = torch.rand(2, n, dtype=torch.float32)                # fp32 -> fp16 (cast)
        ck[f"layer.{s}.g_idx"] = torch.arange(32, dtype=torch.int64) // 16             # int64 -> int32 (cast)
    load_weights(model, iter(ck.items()))                                                # input_scale optional
    lin = model.layer.qkv
    assert torch.equal(lin.qweight, torch.cat([ck[f"layer.{s}.qweight"] for s in "qkv"], dim=1))
    assert lin.scales.dtype == torch.float16
    assert torch.equal(lin.scales, torch.cat([ck[f"layer.{s}.scales"] for s in "qkv"], dim=1).half())
    assert torch.equal(lin.g_idx, torch.arange(32, dtype=torch.int32) // 16)


def test_optional_param_once_present_is_required_for_every_shard():
    model = _TinyModel(_PackedLinearMethod())
    ck = {f"layer.{s}.{p}": t for s, n in (("q", 16), ("k", 8), ("v", 8)) for p, t in (
        ("qweight", torch.zeros(32, n // 8, dtype=torch.int32)), ("scales", torch.zeros(2, n)),
        ("g_idx", torch.zeros(32, dtype=torch.int32)))}
    ck["layer.q.input_scale"] = torch.tensor(0.5)
    with pytest.raises(HayabusaValidationError, match=r"layer\.qkv\.input_scale#k"):
        load_weights(model, iter(ck.items()))


def test_load_weights_refuses_dtype_changes_that_lose_meaning():
    """Packed ints never become floats; fp8 never becomes another float without its scale."""
    model = _TinyModel(_PackedLinearMethod())
    with pytest.raises(HayabusaValidationError, match=r"layer\.q\.qweight is float32"):
        load_weights(model, iter([("layer.q.qweight", torch.zeros(32, 2))]))
    with set_quantization_config(None):
        plain = Linear(8, [4], False, torch.bfloat16, torch.device("cpu"))
    holder = torch.nn.Module()
    holder.proj = plain
    holder.ignored_checkpoint_key = lambda name: False
    with pytest.raises(HayabusaValidationError, match=r"proj\.weight is float8_e4m3fn.*bfloat16.*scales"):
        load_weights(holder, iter([("proj.weight", torch.zeros(4, 8, dtype=FP8_DTYPE))]))


def test_linear_without_a_config_is_the_plain_layer():
    """Outside build_model's context a Linear allocates weight [N, K] (and bias) at once and is F.linear."""
    lin = Linear(16, [8, 4], True, torch.float32, torch.device("cpu"), shard_names=["a", "b"])
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    assert lin.weight.shape == (12, 16) and type(lin.quant_method).__name__ == "UnquantizedLinearMethod"
    lin.weight.weight_loader(lin.weight, torch.ones(4, 16), "b")
    lin.weight.weight_loader(lin.weight, torch.zeros(8, 16), "a")
    lin.bias.weight_loader(lin.bias, torch.arange(4.0), "b")
    lin.bias.weight_loader(lin.bias, torch.zeros(8), "a")
    y = lin(torch.ones(1, 16))
    assert y.tolist() == [[0.0] * 8 + [16.0, 17.0, 18.0, 19.0]]


def test_replace_param_swaps_removes_and_restores():
    from hayabusa.quantization.base import replace_param

    m = torch.nn.Module()
    m.register_parameter("w", torch.nn.Parameter(torch.zeros(2), requires_grad=False))
    replace_param(m, "w", None)
    assert m.w is None and "w" not in dict(m.named_parameters())
    replace_param(m, "w", torch.ones(3))
    assert m.w.shape == (3,) and not m.w.requires_grad and "w" in dict(m.named_parameters())
