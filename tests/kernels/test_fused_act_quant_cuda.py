"""On a GPU: kernels/fused_act_quant.py at Qwen2.5-7B's shapes bit for bit against the separate path it replaces
(fused_add_rms_norm / silu_and_mul, then per_token_quant_int8 / _fp8), CUDA-graph replay, and greedy decoding of a
tiny Llama and Qwen2 under w8a8_int8 and fp8 (CUDA graphs) with HAYABUSA_FUSED_ACT_QUANT on and off: the same ids.
Seconds on an H200."""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels.activation import silu_and_mul
from hayabusa.kernels.fp8_quant import per_token_quant_fp8
from hayabusa.kernels.fused_act_quant import rms_norm_quant, silu_and_mul_quant
from hayabusa.kernels.fused_norm import fused_add_rms_norm
from hayabusa.kernels.int8_quant import per_token_quant_int8

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HIDDEN, INTER = 3584, 18944          # Qwen2.5-7B
QUANT = {"int8": per_token_quant_int8, "fp8": per_token_quant_fp8}
KINDS = ["int8", pytest.param("fp8", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs sm89+"))]


def _same(a, b) -> bool:
    (q, s), (q2, s2) = a, b
    return torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16, 64, 256])
def test_rms_norm_quant_7b_bits(kind, dtype, M):
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, HIDDEN, device="cuda", generator=g).to(dtype)
    res = torch.randn(M, HIDDEN, device="cuda", generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(HIDDEN, device="cuda", generator=g)).to(dtype)
    for r in (res, None):
        xq, s, res_out = rms_norm_quant(x, r, w, 1e-6, kind)
        out, res_want = fused_add_rms_norm(x, r, w, 1e-6)
        assert _same((xq, s), QUANT[kind](out)), (kind, dtype, M, r is None)
        assert (res_out is None) if r is None else torch.equal(res_out, res_want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16, 64, 256])
def test_silu_and_mul_quant_7b_bits(kind, dtype, M):
    g = torch.Generator(device="cuda").manual_seed(M)
    h = (torch.randn(M, 2 * INTER, device="cuda", generator=g) * 3).to(dtype)
    assert _same(silu_and_mul_quant(h, kind), QUANT[kind](silu_and_mul(h))), (kind, dtype, M)
    small = h[:, : 2 * 1024].contiguous()                     # one-block rows (D <= MAX_BLOCK)
    assert _same(silu_and_mul_quant(small, kind), QUANT[kind](silu_and_mul(small))), (kind, dtype, M)


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replay(kind):
    """Captured once, replayed on new inputs: the eager result, bit for bit."""
    M = 8
    x = torch.randn(M, HIDDEN, device="cuda").bfloat16()
    res = torch.randn(M, HIDDEN, device="cuda").bfloat16()
    w = torch.rand(HIDDEN, device="cuda").bfloat16() + 0.5
    h = torch.randn(M, 2 * INTER, device="cuda").bfloat16()
    rms_norm_quant(x, res, w, 1e-6, kind), silu_and_mul_quant(h, kind)          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nq, ns, nres = rms_norm_quant(x, res, w, 1e-6, kind)
        aq, as_ = silu_and_mul_quant(h, kind)
    for t in (x, res, h):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    eq, es, eres = rms_norm_quant(x, res, w, 1e-6, kind)
    assert _same((nq, ns), (eq, es)) and torch.equal(nres, eres)
    assert _same((aq, as_), silu_and_mul_quant(h, kind))


PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "東京は日本の首都で、"]


@pytest.mark.parametrize("quantization", ["w8a8_int8", pytest.param("fp8", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs sm89+"))])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_engine_greedy_ids_equal_with_fusion_on_and_off(monkeypatch, request, model, quantization):
    """CUDA graphs on (as in production): greedy ids with the fused producers (HAYABUSA_FUSED_ACT_QUANT=1's
    switch) equal those of the separate quantizer, and the fused path really ran (linear inputs that arrived as a
    QuantizedActivation, counted at capture and in eager prefills)."""
    import gc

    from hayabusa import LLM, SamplingParams
    from hayabusa.quantization import act_quant
    from hayabusa.quantization.fp8 import Fp8LinearMethod
    from hayabusa.quantization.w8a8_int8 import Int8W8A8LinearMethod

    path = request.getfixturevalue(model)
    seen: list[bool] = []
    for cls in (Int8W8A8LinearMethod, Fp8LinearMethod):
        def apply(self, layer, x, _original=cls.apply):
            seen.append(isinstance(x, act_quant.QuantizedActivation))
            return _original(self, layer, x)
        monkeypatch.setattr(cls, "apply", apply)

    def run(fused: bool) -> list[list[int]]:
        monkeypatch.setattr(act_quant, "USE_FUSED_ACT_QUANT_CUDA", fused)
        llm = LLM(path, quantization=quantization, dtype="bfloat16", kv_cache_memory_bytes=1 << 28,
                  max_num_seqs=8, max_model_len=256)
        assert llm.llm_engine.runner.graphs is not None
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
        return ids

    on = run(True)
    n_fused = sum(seen)
    seen.clear()
    off = run(False)
    assert n_fused > 0 and sum(seen) == 0
    assert on == off
