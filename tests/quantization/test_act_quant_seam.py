"""Activations quantized by the kernel that makes them (quantization/act_quant.py, issues #24 / #25) on CPU: which
linears ask for it (``input_quant`` / ``input_quant_of``), a W8A8 linear gives the same bits from a
QuantizedActivation as from x, and greedy token ids of a tiny Llama and Qwen2 under ``w8a8_int8`` and ``fp8`` are
the same with the fusion on and off (and the fusion really ran: every qkv, gate_up and down input arrived
quantized)."""

from __future__ import annotations

import pytest
import torch

from hayabusa import LLM, SamplingParams
from hayabusa.errors import HayabusaValidationError
from hayabusa.model.layers.activation import silu_and_mul
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import RMSNorm
from hayabusa.quantization import act_quant, set_quantization_config
from hayabusa.quantization import fp8 as fp8_module
from hayabusa.quantization.act_quant import QuantizedActivation, input_quant_of, quantize_ref
from hayabusa.quantization.base import UnquantizedLinearMethod
from hayabusa.quantization.fp8 import Fp8Config, Fp8LinearMethod
from hayabusa.quantization.w8a8_int8 import Int8W8A8LinearMethod, W8A8Int8Config

CPU = torch.device("cpu")


def _layer(method, K: int, N: int, bias: bool, dtype=torch.bfloat16, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    with set_quantization_config(W8A8Int8Config()):
        layer = Linear(K, [N], bias, dtype, CPU)
    layer.create_weights(method)
    layer.weight.weight_loader(layer.weight, (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype), None)
    if bias:
        layer.bias.weight_loader(layer.bias, torch.randn(N, generator=g).to(dtype), None)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_gives_the_same_bits_from_a_quantized_activation(kind, bias):
    method = Int8W8A8LinearMethod(checkpoint_int8=False) if kind == "int8" else Fp8LinearMethod(False)
    layer = _layer(method, 96, 40, bias)
    x = torch.randn(7, 96).to(torch.bfloat16) * 3
    qa = quantize_ref(x, kind)
    assert qa.kind == kind and qa.shape == (7, 96) and qa.dtype == torch.bfloat16 and qa.scale.shape == (7, 1)
    y, y_q = layer(x), layer(qa)
    assert y_q.dtype == torch.bfloat16 and y_q.shape == (7, 40)
    assert torch.equal(y, y_q)


def test_which_linears_ask_for_a_quantized_input(monkeypatch):
    int8 = _layer(Int8W8A8LinearMethod(checkpoint_int8=False), 64, 32, False)
    int8_b = _layer(Int8W8A8LinearMethod(checkpoint_int8=False), 64, 16, False, seed=1)
    fp8 = _layer(Fp8LinearMethod(False), 64, 32, False)
    plain = Linear(64, [32], False, torch.bfloat16, CPU)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert input_quant_of([int8, int8_b], 3, x) == "int8"
    assert input_quant_of([fp8], 3, x) == "fp8"
    assert input_quant_of([int8, fp8], 3, x) is None          # consumers disagree
    assert input_quant_of([int8, plain], 3, x) is None        # an unquantized consumer needs the plain x
    assert input_quant_of([None], 3, x) is None
    assert isinstance(plain.quant_method, UnquantizedLinearMethod) and plain.quant_method.input_quant(plain, 3) is None
    static = Int8W8A8LinearMethod(checkpoint_int8=True, static_input=True)
    assert static.input_quant(int8, 3) is None and Fp8LinearMethod(True, "tensor", True).input_quant(fp8, 3) is None
    # FP8 on the _scaled_mm path: one row goes to the small-M GEMV, which takes it quantized (its XQ launch) or,
    # with that launch off, quantizes inside itself; a K-padded weight needs x's padding
    fp8.fp8_scaled_mm = True
    assert fp8.quant_method.input_quant(fp8, 1) == "fp8" and fp8.quant_method.input_quant(fp8, 2) == "fp8"
    monkeypatch.setattr(fp8_module, "FP8_PREQUANT_ENGINE_MAX", 0)
    assert fp8.quant_method.input_quant(fp8, 1) is None and fp8.quant_method.input_quant(fp8, 2) == "fp8"
    fp8.in_features = 60
    assert fp8.quant_method.input_quant(fp8, 2) is None
    monkeypatch.setattr(act_quant, "USE_FUSED_ACT_QUANT", False)
    assert input_quant_of([int8], 3, x) is None


def test_unset_switch_quantizes_where_the_consumers_prefer_it(monkeypatch):
    """The CUDA default (switch None): the producer quantizes only for consumers whose kernel was measured to prefer
    quantized rows at that M and dtype: FP8 on the _scaled_mm path, bf16, 1..FP8_PREQUANT_ENGINE_MAX rows. INT8
    W8A8, fp16, more rows, a mixed consumer list: plain."""
    int8 = _layer(Int8W8A8LinearMethod(checkpoint_int8=False), 64, 32, False)
    fp8 = _layer(Fp8LinearMethod(False), 64, 32, False)
    fp8_b = _layer(Fp8LinearMethod(False), 64, 16, False, seed=1)
    fp8.fp8_scaled_mm = fp8_b.fp8_scaled_mm = True
    monkeypatch.setattr(act_quant, "USE_FUSED_ACT_QUANT", None)       # CPU reads this one; the same rule
    one = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert input_quant_of([fp8, fp8_b], 1, one) == "fp8"
    assert input_quant_of([int8], 1, one) is None
    assert input_quant_of([fp8, int8], 1, one) is None
    assert input_quant_of([fp8], 1, one.half()) is None
    monkeypatch.setattr(fp8_module, "FP8_PREQUANT_ENGINE_MAX", 1)
    two = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert input_quant_of([fp8], 2, two) is None
    monkeypatch.setattr(fp8_module, "FP8_PREQUANT_ENGINE_MAX", 16)
    assert input_quant_of([fp8], 2, two) == "fp8"
    assert input_quant_of([fp8], 17, torch.zeros(17, 64, dtype=torch.bfloat16)) is None   # the kernels' 16
    fp8.fp8_scaled_mm = False                                          # the CPU emulation: no small-M kernel
    assert input_quant_of([fp8], 1, one) is None


def test_producers_return_quantized_activations_with_the_plain_bits():
    norm = RMSNorm(64, 1e-5, torch.bfloat16, CPU)
    norm.weight.data = torch.rand(64).to(torch.bfloat16) + 0.5
    x, r = torch.randn(4, 64).to(torch.bfloat16), torch.randn(4, 64).to(torch.bfloat16)
    out, res = norm(x, r)
    qa, res_q = norm(x, r, quant="int8")
    assert isinstance(qa, QuantizedActivation) and torch.equal(res, res_q)
    want = quantize_ref(out, "int8")
    assert torch.equal(qa.xq, want.xq) and torch.equal(qa.scale, want.scale)
    h = torch.randn(4, 128).to(torch.bfloat16)
    qa = silu_and_mul(h, quant="fp8")
    want = quantize_ref(silu_and_mul(h), "fp8")
    assert torch.equal(qa.xq.view(torch.uint8), want.xq.view(torch.uint8)) and torch.equal(qa.scale, want.scale)
    with pytest.raises(ValueError, match="kind"):
        quantize_ref(h, "int4")


@pytest.mark.parametrize("value, cpu, cuda", [(None, True, None), ("1", True, True), ("0", False, False),
                                              ("maybe", None, None)])
def test_switch_is_one_env_flag_read_at_import(value, cpu, cuda):
    """Unset: on for CPU, None for CUDA (where the consumers prefer it); set: both; a bad value is refused naming the
    variable. In a fresh
    interpreter: reloading the module here would give the engine's QuantizedActivation a second class."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HAYABUSA_FUSED_ACT_QUANT"}
    if value is not None:
        env["HAYABUSA_FUSED_ACT_QUANT"] = value
    code = "import hayabusa.quantization.act_quant as a; print(a.USE_FUSED_ACT_QUANT, a.USE_FUSED_ACT_QUANT_CUDA)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if value == "maybe":
        assert p.returncode != 0 and "HAYABUSA_FUSED_ACT_QUANT" in p.stderr
    else:
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == [str(cpu), str(cuda)]


PROMPTS = ["Once upon a time", "The capital of France is", "東京は日本の首都で、"]


def _greedy(model: str, quantization: str, monkeypatch, fused: bool) -> tuple[list[list[int]], int]:
    """Greedy ids of PROMPTS, and how many linear inputs arrived as a QuantizedActivation."""
    monkeypatch.setattr(act_quant, "USE_FUSED_ACT_QUANT", fused)
    seen = []
    for cls in (Int8W8A8LinearMethod, Fp8LinearMethod):
        original = cls.apply

        def apply(self, layer, x, _original=original):
            seen.append(isinstance(x, QuantizedActivation))
            return _original(self, layer, x)

        monkeypatch.setattr(cls, "apply", apply)
    llm = LLM(model, device="cpu", quantization=quantization, max_model_len=256, max_num_seqs=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], sum(seen), len(seen)


@pytest.mark.parametrize("quantization", ["w8a8_int8", "fp8"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_greedy_ids_are_the_same_with_the_fusion_on_and_off(model, quantization, request, monkeypatch):
    path = request.getfixturevalue(model)
    on, n_fused, n_calls = _greedy(path, quantization, monkeypatch, True)
    off, n_fused_off, n_calls_off = _greedy(path, quantization, monkeypatch, False)
    assert on == off
    assert all(len(ids) == 16 for ids in on)
    # 4 linears a layer, 3 of them (qkv, gate_up, down) fed by a fused producer; o_proj's input is attention's
    assert n_calls == n_calls_off > 0 and n_fused_off == 0
    assert n_fused * 4 == n_calls * 3, (n_fused, n_calls)
