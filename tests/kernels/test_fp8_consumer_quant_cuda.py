"""On a GPU (sm89+): HAYABUSA_FP8_CONSUMER_QUANT, the FP8 small-M consumer quantizing its own x tiles from the
producer's amax partials instead of the producer's second launch: the kernel's bits against the XQ launch on the
producer's quantized rows at Qwen2.5-7B's qkv (after the norm) and down (after SiLU-and-mul) shapes, and greedy ids
and logprobs of stories260K in fp8 with the switch on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")]


@pytest.mark.parametrize("M", [1, 3, 16])
def test_kernel_from_amax_partials_is_the_xq_launch_at_7b_shapes(M):
    from hayabusa.kernels.fp8_gemv import fp8_small_m_linear
    from hayabusa.kernels.fp8_quant import per_token_quant_fp8
    from hayabusa.kernels.fused_act_quant import quantize_cols, rms_norm_amax, silu_and_mul_amax

    g = torch.Generator(device="cuda").manual_seed(M)
    bf = torch.bfloat16
    x = torch.randn(M, 3584, device="cuda", generator=g).to(bf)
    nw = (torch.rand(3584, device="cuda", generator=g) + 0.5).to(bf)
    gu = torch.randn(M, 2 * 18944, device="cuda", generator=g).to(bf)
    for (h, amax), N in ((rms_norm_amax(x, None, nw, 1e-6)[:2], 4608), (silu_and_mul_amax(gu), 3584)):
        wq, sw = per_token_quant_fp8((torch.randn(N, h.shape[1], device="cuda", generator=g) / 10).to(bf))
        sw = sw.view(-1).contiguous()
        xq, s = quantize_cols(h, amax, "fp8")
        ref = fp8_small_m_linear(xq, wq, sw, None, x_scale=s, out_dtype=bf)
        y = fp8_small_m_linear(h, wq, sw, None, x_amax=amax)
        assert torch.equal(y, ref), (N, float((y.float() - ref.float()).abs().max()))


def _generate(model_dir: str) -> list:
    from tests.kernels.test_pdl_cuda import _generate as generate     # greedy ids + logprobs, CUDA graphs on

    return generate(model_dir, "fp8")


def test_engine_greedy_identical_with_the_switch_on_and_off(monkeypatch, stories_dir):
    from hayabusa.quantization import act_quant
    from hayabusa.quantization.fp8 import Fp8LinearMethod

    deferred = []
    original = Fp8LinearMethod.apply

    def apply(self, layer, x):
        deferred.append(bool(getattr(x, "is_deferred", False)))
        return original(self, layer, x)

    monkeypatch.setattr(Fp8LinearMethod, "apply", apply)
    monkeypatch.setattr(act_quant, "FP8_CONSUMER_QUANT", True)
    on = _generate(stories_dir)
    n_on = sum(deferred)
    monkeypatch.setattr(act_quant, "FP8_CONSUMER_QUANT", False)
    deferred.clear()
    off = _generate(stories_dir)
    assert n_on > 0 and sum(deferred) == 0
    assert on == off
