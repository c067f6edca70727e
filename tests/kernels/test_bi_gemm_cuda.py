"""On a GPU, with the real tile configurations (bi_gemm_config at the device's SM count): the split-K
batch-invariant GEMM gives one row the same bits alone and among other rows at M = 1 .. 2048 (split launches for
decode-sized M, unsplit for prefill-sized M), the two launches agree bit for bit at any M, a CUDA-graph replay equals
the eager call, and the result matches F.linear within bf16 / fp16 tolerance; the MLP's one-launch gate_up +
SiLU-and-mul has the bits of the two launches; the persistent TMA kernel has the pointer kernel's bits. Shapes: the
qwen2.5-0.5b and 7b linears (bench/models.linear_shapes: qkv, o, gate_up, down, lm_head) and a 128 x 896 weight
(one k_proj).

Run: pytest -q tests/kernels/test_bi_gemm_cuda.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hayabusa.bench.models import linear_shapes
from hayabusa.kernels.bi_gemm import bi_gemm, bi_gemm_config, bi_gemm_splits, num_sms, reserve_tile_counters

pytestmark = pytest.mark.cuda

SIZES = (1, 2, 3, 7, 16, 33, 64, 130, 256, 2048)
SHAPES = {f"{model[:-6]}-{name}": shape for model in ("qwen2.5-0.5b-shape", "qwen2.5-7b-shape")
          for name, shape in linear_shapes(model).items()}
SHAPES["k_proj-128x896"] = (128, 896, True)


def _weights(N: int, K: int, has_bias: bool, dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=gen).to(dtype) if has_bias else None
    row = torch.randn(K, device="cuda", generator=gen).to(dtype)
    return w, b, row, gen


@pytest.mark.parametrize("shape", list(SHAPES))
def test_row_bits_do_not_depend_on_m(shape):
    N, K, has_bias = SHAPES[shape]
    w, b, row, gen = _weights(N, K, has_bias, torch.bfloat16)
    alone = bi_gemm(row[None], w, b)[0]
    sms = num_sms(torch.device("cuda"))
    for M in SIZES[1:]:
        cfg = bi_gemm_config(N, K, sms, M, w.device)   # M's bucket: its tiles, the shape's BLOCK_K and CHUNK_K
        x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
        for at in sorted({0, M // 2, M - 1}):
            saved = x[at].clone()
            x[at] = row
            assert torch.equal(bi_gemm(x, w, b)[at], alone), \
                (shape, M, at, cfg, "split" if bi_gemm_splits(M, N, K, cfg, sms) else "unsplit")
            x[at] = saved
    ref = F.linear(row[None].float(), w.float(), None if b is None else b.float())[0]
    torch.testing.assert_close(alone.float(), ref, rtol=1.6e-2, atol=1.6e-2 * ref.abs().max().item())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_and_unsplit_launches_agree(shape, dtype):
    """Forced both ways at the real configuration (S chunks from the weight shape): the same bits, whatever M; also
    with SUM_IN_KERNEL (the tile's last chunk program sums: arrival counters, acq_rel atomics), three times in a
    row (a memory-ordering slip would show as a differing or flaky result)."""
    N, K, has_bias = SHAPES[shape]
    w, b, _, gen = _weights(N, K, has_bias, dtype, seed=1)
    fused = dataclasses.replace(bi_gemm_config(N, K, num_sms(w.device)), SUM_IN_KERNEL=True)
    for M in (1, 64, 300):
        x = torch.randn(M, K, device="cuda", generator=gen, dtype=dtype)
        split, unsplit = bi_gemm(x, w, b, split=True), bi_gemm(x, w, b, split=False)
        assert torch.equal(split, unsplit), (shape, M, (split.float() - unsplit.float()).abs().max().item())
        for _ in range(3):
            assert torch.equal(bi_gemm(x, w, b, config=fused, split=True), unsplit), (shape, M, "SUM_IN_KERNEL")
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
        torch.testing.assert_close(split.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("sum_in_kernel", [False, True])
@pytest.mark.parametrize("shape", ["qwen2.5-0.5b-down", "qwen2.5-7b-qkv"])
def test_cuda_graph_replay_equals_eager(shape, sum_in_kernel):
    """The engine runs decode steps as CUDA-graph replays: the split launch (partials allocated in the graph's pool;
    or, SUM_IN_KERNEL, the tile counters reserved before capture) captures, and replays on new inputs give the
    eager bits."""
    N, K, has_bias = SHAPES[shape]
    w, b, _, gen = _weights(N, K, has_bias, torch.bfloat16, seed=2)
    x = torch.randn(8, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    cfg = dataclasses.replace(bi_gemm_config(N, K, num_sms(x.device)), SUM_IN_KERNEL=sum_in_kernel)
    assert bi_gemm_splits(8, N, K, cfg, num_sms(x.device))
    reserve_tile_counters(x.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bi_gemm(x, w, b, config=cfg)                        # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bi_gemm(x, w, b, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn(8, K, device="cuda", generator=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, bi_gemm(x, w, b, split=False))


@pytest.mark.parametrize("shape", ["qwen2.5-0.5b-gate_up", "qwen2.5-7b-gate_up"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_bi_has_the_two_launches_bits(shape, dtype):
    """The mode's MLP launch (gate_up + SiLU-and-mul, its BLOCK_N halved per half) against bi_gemm + the activation
    kernel at every M where it applies (an unsplit launch; on the 0.5b gate_up, K in one chunk, that is every M):
    the same bits, a row alone included."""
    from hayabusa.kernels.activation import silu_and_mul
    from hayabusa.kernels.bi_gemm import silu_and_mul_bi

    N, K, _ = SHAPES[shape]
    w, _, row, gen = _weights(N, K, False, dtype, seed=2)
    alone = silu_and_mul_bi(row[None], w)
    if alone is None:                          # M = 1 splits K on this shape: the two launches
        alone = silu_and_mul(bi_gemm(row[None], w))
    ran = 0
    for M in (1, 7, 16, 33, 64, 256, 2048):
        x = torch.randn(M, K, device="cuda", generator=gen, dtype=dtype)
        x[M // 2] = row
        fused = silu_and_mul_bi(x, w)
        if fused is None:
            continue
        ran += 1
        two = silu_and_mul(bi_gemm(x, w))
        assert torch.equal(fused, two), (shape, M, (fused.float() - two.float()).abs().max().item())
        assert torch.equal(alone, fused[M // 2: M // 2 + 1]), (shape, M)
    assert ran >= (7 if shape == "qwen2.5-0.5b-gate_up" else 1)


def _tma_tiles(cfg) -> list:
    # two TMA launches of the shape's arithmetic: 64 x 64 (mma of 64 rows), 128 x 128 of 8 warps (its stages fitting
    # the shared memory with BLOCK_K 128)
    return [dataclasses.replace(cfg, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=True),
            dataclasses.replace(cfg, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3 if cfg.BLOCK_K <= 64 else 2,
                                TMA=True)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_kernel_has_the_pointer_kernels_bits(shape, dtype):
    """The persistent TMA kernel (TMA loads and stores, a grid of min(tiles, SMs) programs, the tile loop flattened
    when K is one chunk) against the pointer kernel's unsplit launch: the same bits at M = 1 .. 2048, bias included;
    on the gate_up shapes the MLP's SiLU launch through it too."""
    from hayabusa.kernels.bi_gemm import silu_and_mul_bi

    N, K, has_bias = SHAPES[shape]
    w, b, _, gen = _weights(N, K, has_bias, dtype, seed=4)
    base = bi_gemm_config(N, K, num_sms(w.device))
    for M in (1, 33, 300, 2048):
        x = torch.randn(M, K, device="cuda", generator=gen, dtype=dtype)
        want = bi_gemm(x, w, b, split=False, tma=False)
        for cfg in _tma_tiles(base):
            got = bi_gemm(x, w, b, config=cfg, split=False, tma=True)
            assert torch.equal(got, want), (shape, M, cfg, (got.float() - want.float()).abs().max().item())
            if shape.endswith("gate_up"):
                unsplit = dataclasses.replace(cfg, SPLIT_BELOW_TILES=1)
                got = silu_and_mul_bi(x, w, config=unsplit, tma=True)
                assert torch.equal(got, silu_and_mul_bi(x, w, config=unsplit, tma=False)), (shape, M, cfg, "silu")


def test_tma_kernel_in_a_cuda_graph():
    """The TMA launch's descriptors are kernel arguments captured by value: replays on new inputs (same buffers)
    give the eager bits."""
    N, K, has_bias = SHAPES["qwen2.5-0.5b-qkv"]
    w, b, _, gen = _weights(N, K, has_bias, torch.bfloat16, seed=5)
    x = torch.randn(300, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    cfg = _tma_tiles(bi_gemm_config(N, K, num_sms(x.device)))[1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bi_gemm(x, w, b, config=cfg, split=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bi_gemm(x, w, b, config=cfg, split=False)
    for _ in range(3):
        x.copy_(torch.randn(300, K, device="cuda", generator=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, bi_gemm(x, w, b, split=False, tma=False))
