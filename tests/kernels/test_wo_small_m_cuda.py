"""On a GPU: wo_small_m_linear at Qwen2.5-7B's linear shapes (int4 group 128 and int8, bf16 and fp16 x) against
quant_ref's references with the table's launch and every int4 kind, CUDA-graph capture and replay, run-to-run
determinism, and quant_linear's HAYABUSA_WO_SMALL_M routing (the public int4 / int8 linears); the inline-PTX kinds:
"lop3" gives "slab"'s bits, "lop3j" at 17-256 rows (HAYABUSA_WO_MID_M) dequantize + cuBLAS's value."""

from __future__ import annotations

import pytest
import torch

import hayabusa.kernels.quant_linear as ql
from hayabusa.kernels.quant_linear import (
    LaunchConfig, int4_weight_only_linear, int4_weight_only_linear_ref, int8_weight_only_linear,
    int8_weight_only_linear_ref, quantize_int4_grouped, quantize_int8_per_channel,
)
from hayabusa.kernels.wo_small_m import pick_wo_small_m_config, wo_small_m_linear
from tests.kernels.conftest import QWEN_7B

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}   # 1 ulp at 1.0
G = 128


@pytest.fixture(scope="module")
def weights():
    """Per 7B layer: (w [N, K] bf16 on CUDA, int4 (q, s, z), int8 (q, s)), bf16 scales; fp16 copies made per test."""
    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer, (K, N) in QWEN_7B.items():
        w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        out[layer] = (quantize_int4_grouped(w, G), quantize_int8_per_channel(w))
    return out


def _ops(weights, layer, scheme, dtype):
    int4, int8 = weights[layer]
    if scheme == "int4":
        q, s, z = int4
        return q, s.to(dtype), z.to(dtype), G
    q, s = int8
    return q, s.to(dtype), None, None


def _x(layer, M, dtype, seed):
    K, N = QWEN_7B[layer]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    return x, b


def _ref(x, q, s, z, group, b):
    if group is None:
        return int8_weight_only_linear_ref(x, q, s, b)
    return int4_weight_only_linear_ref(x, q, s, z, group, b)


def _ulps_of_scale(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max()) / (EPS[y.dtype] * float(ref.float().abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 5, 16, 32, 64, 256])
@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("layer", list(QWEN_7B))
def test_matches_reference(weights, layer, scheme, M, dtype):
    """The table's launch, with and without bias: within 2 ulps of the output scale of the reference (fp32 sums in
    another order, one rounding)."""
    q, s, z, group = _ops(weights, layer, scheme, dtype)
    x, b = _x(layer, M, dtype, seed=M)
    cfg = pick_wo_small_m_config(M, *reversed(QWEN_7B[layer]), group, x.device)
    for bias in (None, b):
        y = wo_small_m_linear(x, q, s, z, group, bias)
        assert y.shape == (M, QWEN_7B[layer][1]) and y.dtype == dtype and y.is_contiguous()
        assert _ulps_of_scale(y, _ref(x, q, s, z, group, bias)) <= 2, cfg


@pytest.mark.parametrize("scheme,kind,bk,split", [
    ("int4", "slab", 128, 1), ("int4", "slab", 128, 4), ("int4", "join", 128, 1), ("int4", "join", 64, 4),
    ("int8", "slab", 128, 1), ("int8", "slab", 64, 4), ("int8", "dot", 128, 1), ("int8", "dot", 64, 4),
    ("int4", "lop3", 128, 1), ("int4", "lop3", 128, 4), ("int4", "lop3j", 128, 1), ("int4", "lop3j", 128, 4)])
@pytest.mark.parametrize("layer", ["qkv", "down"])
def test_kinds(weights, layer, scheme, kind, bk, split):
    """Every tile build of both schemes, with and without a K split, at 16 rows: the reference's value within 2
    ulps."""
    q, s, z, group = _ops(weights, layer, scheme, torch.bfloat16)
    x, b = _x(layer, 16, torch.bfloat16, seed=3)
    cfg = LaunchConfig(kind, BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=3)
    assert _ulps_of_scale(wo_small_m_linear(x, q, s, z, group, b, cfg=cfg), _ref(x, q, s, z, group, b)) <= 2


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("layer", ["qkv", "gate_up", "down"])
def test_cuda_graph_replay_and_determinism(weights, monkeypatch, layer, scheme):
    """Captured once per M, replayed on new rows: the eager bits (the split-K counters are zero again after each
    launch); two eager runs agree; the two-launch split-K reduction gives the same bits."""
    import hayabusa.kernels.fp8_gemv as fg

    q, s, z, group = _ops(weights, layer, scheme, torch.bfloat16)
    for M in (5, 16):
        x, b = _x(layer, M, torch.bfloat16, seed=M)
        static_x = x.clone()
        wo_small_m_linear(static_x, q, s, z, group, b)     # compile and allocate the counters outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = wo_small_m_linear(static_x, q, s, z, group, b)
        for seed in (100, 200):
            new_x = _x(layer, M, torch.bfloat16, seed=M + seed)[0]
            static_x.copy_(new_x)
            graph.replay()
            eager = wo_small_m_linear(new_x, q, s, z, group, b)
            assert torch.equal(static_y, eager), (layer, M, seed)
            assert torch.equal(wo_small_m_linear(new_x, q, s, z, group, b), eager)
        monkeypatch.setattr(fg, "USE_FUSED_REDUCE", False)
        assert torch.equal(wo_small_m_linear(new_x, q, s, z, group, b), eager), (layer, M)
        monkeypatch.setattr(fg, "USE_FUSED_REDUCE", True)
        del graph


@pytest.mark.parametrize("layer", ["o", "gate_up"])
def test_public_linears_route_with_the_switch(weights, monkeypatch, layer):
    """USE_WO_SMALL_M on: int4 / int8_weight_only_linear at 8 rows give wo_small_m_linear's bits; off: today's
    path, which agrees with it within 2 ulps of the output scale."""
    x, b = _x(layer, 8, torch.bfloat16, seed=9)
    (q4, s4, z4), (q8, s8) = weights[layer]
    monkeypatch.setattr(ql, "USE_WO_SMALL_M", True)
    on4 = int4_weight_only_linear(x, q4, s4, z4, G, b)
    on8 = int8_weight_only_linear(x, q8, s8, b)
    assert torch.equal(on4, wo_small_m_linear(x, q4, s4, z4, G, b))
    assert torch.equal(on8, wo_small_m_linear(x, q8, s8, None, None, b))
    monkeypatch.setattr(ql, "USE_WO_SMALL_M", False)
    assert _ulps_of_scale(int4_weight_only_linear(x, q4, s4, z4, G, b), on4) <= 2
    assert _ulps_of_scale(int8_weight_only_linear(x, q8, s8, b), on8) <= 2


@pytest.mark.parametrize("layer", ["qkv", "down"])
def test_lop3_gives_the_slab_kernels_bits(weights, layer):
    """The PTX-made slabs are the Triton-made ones: the same launch of both kinds gives the same bits (bf16, fp16,
    with a K split)."""
    for dtype in (torch.bfloat16, torch.float16):
        q, s, z, group = _ops(weights, layer, "int4", dtype)
        x, b = _x(layer, 16, dtype, seed=4)
        for split in (1, 4):
            cfg = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=split, num_warps=8, num_stages=3)
            assert torch.equal(wo_small_m_linear(x, q, s, z, group, b, cfg=LaunchConfig("lop3", **cfg)),
                               wo_small_m_linear(x, q, s, z, group, b, cfg=LaunchConfig("slab", **cfg)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [17, 64, 128, 256])
@pytest.mark.parametrize("layer", list(QWEN_7B))
def test_lop3j_matches_dequantize_and_cublas(weights, monkeypatch, layer, M, dtype):
    """The table's 17-256-row int4 launches ("lop3j": round((q - zero) * scale) in x's dtype, as dequantize_int4_to
    makes the weights cuBLAS multiplies) within 1 ulp of the output scale of F.linear on those weights; replayed
    from a CUDA graph they give the eager bits; with HAYABUSA_WO_MID_M the public int4 linear gives them too (at
    every key: WO_MID_M_WINS, which limits the routing to the keys that won, is patched to all of them here)."""
    from hayabusa.kernels.quant_linear import dequantize_int4_to

    q, s, z, group = _ops(weights, layer, "int4", dtype)
    x, b = _x(layer, M, dtype, seed=M)
    cfg = pick_wo_small_m_config(M, *reversed(QWEN_7B[layer]), group, x.device)
    assert cfg.kind == "lop3j", cfg
    y = wo_small_m_linear(x, q, s, z, group, b)
    want = torch.nn.functional.linear(x, dequantize_int4_to(q, s, z, group, dtype), b)
    assert _ulps_of_scale(y, want) <= 1, cfg
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = wo_small_m_linear(static_x, q, s, z, group, b)
    static_x.copy_(_x(layer, M, dtype, seed=M + 1)[0])
    graph.replay()
    assert torch.equal(static_y, wo_small_m_linear(static_x, q, s, z, group, b))
    del graph
    import hayabusa.kernels.wo_small_m as wsm

    monkeypatch.setattr(ql, "USE_WO_SMALL_M", True)
    monkeypatch.setattr(wsm, "USE_WO_MID_M", True)
    monkeypatch.setattr(wsm, "WO_MID_M_WINS", frozenset(wsm.WO_SMALL_M_TABLE))
    assert torch.equal(int4_weight_only_linear(x, q, s, z, group, b), y)
