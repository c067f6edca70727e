"""On a GPU: the swapped-operand weight-only GEMM (_wo_gemm_t_kernel) at Qwen2.5-7B's linear shapes, M = 16, 64,
200, for every entry of GEMM_T_TABLE (each run on the 7b layers of its shape class, K splits resolved for this
GPU's SM count as pick_config does), int8 and int4 (group 128, and group 32 at M = 64), bf16 and fp16, against the
torch references; the original GEMM at the same launch agrees within the same bound; pick_config's own launch
through the public linears; a CUDA-graph capture replays with new activations.

Run: pytest -q tests/kernels/test_wo_gemm_t_cuda.py
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from hayabusa.kernels.quant_linear import (
    GEMM_T_TABLE, _launch, gemm_shape_class, gemm_t_launch, int4_weight_only_linear, int4_weight_only_linear_ref,
    int8_weight_only_linear, int8_weight_only_linear_ref, pick_config, quantize_int4_grouped,
    quantize_int8_per_channel,
)
from tests.kernels.conftest import QWEN_7B
from tests.kernels.test_quant_linear import _assert_close_to_ref

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _gemm_t_on(monkeypatch):
    """gemm_t is off by default until its table is measured (quant_linear.USE_GEMM_T): these tests turn it on."""
    from hayabusa.kernels import quant_linear
    monkeypatch.setattr(quant_linear, "USE_GEMM_T", True)

MS = (16, 64, 200)
LAYERS_OF_CLASS = {c: [name for name, (K, N) in QWEN_7B.items() if gemm_shape_class(N, K) == c]
                   for c in ("square", "wide", "deep")}


@functools.lru_cache(maxsize=4)
def _weights(layer: str, dtype: torch.dtype, scheme: str, G: int | None):
    """Quantized random weights of one 7b layer (bias for qkv, as Qwen2's): (packed tensors, bias, N, K)."""
    K, N = QWEN_7B[layer]
    gen = torch.Generator(device="cuda").manual_seed(len(layer))
    w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(dtype)
    bias = torch.randn(N, device="cuda", generator=gen).to(dtype) if layer == "qkv" else None
    if scheme == "int8":
        return (*quantize_int8_per_channel(w), None), bias, N, K
    return quantize_int4_grouped(w, G), bias, N, K


def _x(M: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(M)
    return torch.randn(M, K, device="cuda", generator=gen).to(dtype)


def _ref(x, packed, bias, G):
    if G is None:
        return int8_weight_only_linear_ref(x, packed[0], packed[1], bias)
    return int4_weight_only_linear_ref(x, *packed, G, bias)


CASES = [(key, layer, M) for key in GEMM_T_TABLE for layer in LAYERS_OF_CLASS[key[2]] for M in MS]


@pytest.mark.parametrize("key,layer,M", CASES, ids=[f"{k[0]}-m{k[1]}-{k[2]}-{lay}-M{m}" for k, lay, m in CASES])
def test_every_table_entry_matches_ref_at_7b_shapes(key, layer, M):
    """The entry's launch (tiles, warps, stages; K splits for this GPU) at each M, bf16 activations."""
    scheme = key[0]
    G = 128 if scheme == "int4" else None
    packed, bias, N, K = _weights(layer, torch.bfloat16, scheme, G)
    x = _x(M, K, torch.bfloat16)
    cfg = gemm_t_launch(GEMM_T_TABLE[key], M, N, K, G, x.device)
    _assert_close_to_ref(_launch(x, *packed, bias, N, G, cfg), _ref(x, packed, bias, G), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme,G", [("int8", None), ("int4", 128), ("int4", 32)])
@pytest.mark.parametrize("layer", list(QWEN_7B))
def test_pick_config_launch_matches_ref_and_original_gemm(dtype, scheme, G, layer):
    """M = 64 through pick_config (gemm_t) for both half dtypes and group sizes 128 / 32 (BLOCK_K capped), and
    the original GEMM at the same tiles: both within the reference bound."""
    M = 64
    packed, bias, N, K = _weights(layer, dtype, scheme, G)
    x = _x(M, K, dtype)
    cfg = pick_config(M, N, K, G, x.device, x.element_size())
    assert cfg.kind == "gemm_t"
    ref = _ref(x, packed, bias, G)
    _assert_close_to_ref(_launch(x, *packed, bias, N, G, cfg), ref, dtype)
    original = dataclasses.replace(cfg, kind="gemm", num_stages=1)   # its W tile also lives in shared memory
    _assert_close_to_ref(_launch(x, *packed, bias, N, G, original), ref, dtype)


@pytest.mark.parametrize("M", [16, 48])
def test_public_linears_and_cuda_graph_replay(M):
    """The public linears below their dequantize thresholds: a CUDA-graph capture of both replays with new x (16
    rows take kernels/wo_small_m.py on Hopper when it is registered, 48 the GEMM of pick_config)."""
    packed, bias, N, K = _weights("qkv", torch.bfloat16, "int4", 128)
    q8, s8, _ = _weights("qkv", torch.bfloat16, "int8", None)[0]
    x = _x(M, K, torch.bfloat16)
    int4_weight_only_linear(x, *packed, 128, bias)                          # compile outside the capture
    int8_weight_only_linear(x, q8, s8, bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out4 = int4_weight_only_linear(x, *packed, 128, bias)
        out8 = int8_weight_only_linear(x, q8, s8, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _assert_close_to_ref(out4, int4_weight_only_linear_ref(x, *packed, 128, bias), torch.bfloat16)
    _assert_close_to_ref(out8, int8_weight_only_linear_ref(x, q8, s8, bias), torch.bfloat16)
