"""On a Hopper GPU (sm90+): programmatic dependent launch (kernels/pdl.py, HAYABUSA_PDL) changes when kernels are
scheduled, never what they compute: a decode chain of the PDL-aware kernels captured in a CUDA graph gives the same
bits with PDL on and off, and greedy decoding (stories260K, tiny Qwen2; bf16, CUDA graphs; with the small-M linear
on, so the whole layer is PDL-aware, and off) gives identical token ids and logprobs."""

from __future__ import annotations

import gc

import pytest
import torch

import hayabusa.kernels.pdl as pdl

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a Hopper GPU (compute capability >= 9.0) for PDL")]


def _chain(x, w_qkv, w_o, w_up, w_down, norm_w):
    """norm -> qkv -> SiLU-and-mul -> o -> norm -> gate_up -> SiLU-and-mul -> down: PDL kernels back to back."""
    from hayabusa.kernels.activation import silu_and_mul
    from hayabusa.kernels.fused_norm import fused_add_rms_norm
    from hayabusa.kernels.small_m_linear import small_m_linear

    h, res = fused_add_rms_norm(x, torch.zeros_like(x), norm_w, 1e-6)
    a = silu_and_mul(small_m_linear(h, w_qkv))
    h2, res = fused_add_rms_norm(small_m_linear(a, w_o), res, norm_w, 1e-6)
    return small_m_linear(silu_and_mul(small_m_linear(h2, w_up)), w_down) + res


@pytest.mark.parametrize("M", [1, 4, 16])
def test_graph_of_pdl_kernels_equals_the_same_graph_without(monkeypatch, M):
    g = torch.Generator(device="cuda").manual_seed(M)
    D, I = 1024, 2816

    def mk(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    ws = (mk(2 * D, D), mk(D, D), mk(2 * I, D), mk(D, I),
          (torch.rand(D, device="cuda", generator=g) + 0.5).to(torch.bfloat16))
    inputs = [torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16) * s for s in (1, 2, 3)]
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "USE_PDL", on)
        static_x = inputs[0].clone()
        _chain(static_x, *ws)                       # compile (the PDL variant is its own kernel) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = _chain(static_x, *ws)
        outs[on] = []
        for x in inputs:
            static_x.copy_(x)
            graph.replay()
            outs[on].append(y.clone())
        outs[on].append(_chain(inputs[0], *ws))     # eager too
        del graph
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


PROMPTS = ["Once upon a time, there was a little girl named", "The cat sat on the", "Tom and his dog went to the",
           "One day, a big bird", "Lily wanted to play with her", "The sun was shining and"]


def _generate(model_dir: str, quantization: str | None) -> list:
    from hayabusa import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_bytes=1 << 28, max_num_seqs=8, max_model_len=256,
              quantization=quantization)
    assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3),
                        use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("small_m,quantization", [("0", None), ("1", None), ("1", "fp8")])
@pytest.mark.parametrize("model", ["stories_dir", "tiny_qwen2"])
def test_engine_greedy_identical_with_pdl_on_and_off(monkeypatch, request, model, small_m, quantization):
    """bf16 with cuBLAS linears (the norms, RoPE + KV write, attention and SiLU-and-mul PDL-aware), with the small-M
    linears (the whole layer), and FP8 (its quantizing producers and small-M kernels too)."""
    model_dir = request.getfixturevalue(model)
    monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", small_m)
    monkeypatch.setattr(pdl, "USE_PDL", True)
    on = _generate(model_dir, quantization)
    monkeypatch.setattr(pdl, "USE_PDL", False)
    off = _generate(model_dir, quantization)
    assert on == off
