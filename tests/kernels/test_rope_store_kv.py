"""rope_and_store_kv (one launch) against rotary_embedding + store_kv (two launches): the same bits in q, k_cache and
v_cache for every activation dtype, block size and cache dtype (fp8 e4m3 / e5m2 with scales), on fused-qkv views
with padding rows; and the Attention layer's choice between the two paths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hayabusa.kernels.rope_store_kv import rope_and_store_kv, rope_and_store_kv_ref
from hayabusa.kernels.rotary import rotary_embedding
from hayabusa.kernels.store_kv import store_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (H, H_kv, D, block_size): qwen2.5-0.5b and -7b at the default block size; HALF not a power of 2; MQA; 32
CASES = [(14, 2, 64, 16), (28, 4, 128, 16), (4, 4, 80, 1), (8, 1, 16, 8), (14, 2, 64, 32)]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _cos_sin(D: int, P: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's buffers: [P, D] in the model dtype, halves repeated."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(P).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def _case(H, H_kv, D, T, dtype, cache_dtype, num_blocks, block_size, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    P = 64
    mag = torch.logspace(-3, 2.5, T)[:, None]          # rows from small to large: fp8 subnormals to saturation
    qkv = (torch.randn(T, (H + 2 * H_kv) * D, generator=gen) * mag).to(dtype).to(device)
    positions = torch.randint(0, P, (T,), generator=gen).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(torch.int64)
    slots[T // 2] = -1                                  # a skipped row and a CUDA-graph padding tail
    slots[T - 2:] = -1
    init = torch.randn(num_blocks, block_size, H_kv, D, generator=gen).to(cache_dtype).to(device)
    cos, sin = _cos_sin(D, P, dtype, device)
    return dict(qkv=qkv, positions=positions, slots=slots.to(device), init=init, cos=cos, sin=sin)


def _views(qkv, H, H_kv, D):
    """q [T, H, D], k and v [T, H_kv, D] as views into the fused qkv output, as the models pass them."""
    T = qkv.shape[0]
    q, k, v = qkv.split([H * D, H_kv * D, H_kv * D], dim=-1)
    return q.view(T, H, D), k.view(T, H_kv, D), v.view(T, H_kv, D)


def _run(op, c, H, H_kv, D, scales):
    qkv = c["qkv"].clone()
    kc, vc = c["init"].clone(), c["init"].clone()
    q, k, v = _views(qkv, H, H_kv, D)
    if op == "sequential":
        rotary_embedding(c["positions"], q, k, c["cos"], c["sin"])
        store_kv(k, v, kc, vc, c["slots"], *scales)
    else:
        op(c["positions"], q, k, v, kc, vc, c["slots"], c["cos"], c["sin"], *scales)
    return qkv, kc, vc


def _scales(cache_dtype, device, k_scale=0.37, v_scale=2.5):
    if cache_dtype not in FP8:
        return (None, None)
    return torch.tensor([k_scale], device=device), torch.tensor([v_scale], device=device)


@pytest.mark.parametrize("cache", ["model", *FP8], ids=["model", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,H_kv,D,block_size", CASES)
def test_fused_equals_rotary_then_store_kv(device, cache, dtype, H, H_kv, D, block_size):
    cache_dtype = dtype if cache == "model" else cache
    T = 11
    c = _case(H, H_kv, D, T, dtype, cache_dtype, -(-2 * T // block_size), block_size, device)
    scales = _scales(cache_dtype, device)
    seq_qkv, seq_kc, seq_vc = _run("sequential", c, H, H_kv, D, scales)
    fused_qkv, fused_kc, fused_vc = _run(rope_and_store_kv, c, H, H_kv, D, scales)
    assert torch.equal(fused_qkv[:, :H * D], seq_qkv[:, :H * D])                # q rotated alike, padding rows too
    assert torch.equal(_bits(fused_kc), _bits(seq_kc)) and torch.equal(_bits(fused_vc), _bits(seq_vc))
    assert torch.equal(fused_qkv[:, H * D:], c["qkv"][:, H * D:])               # k and v are only read
    assert not torch.equal(seq_qkv[:, :H * D], c["qkv"][:, :H * D])             # (q did rotate)
    keep = c["slots"] >= 0
    untouched = torch.ones(c["init"].shape[0] * block_size, dtype=torch.bool, device=device)
    untouched[c["slots"][keep]] = False
    flat = lambda x: _bits(x).reshape(-1, H_kv, D)  # noqa: E731
    assert torch.equal(flat(fused_kc)[untouched], flat(c["init"])[untouched])
    assert torch.equal(flat(fused_vc)[untouched], flat(c["init"])[untouched])


@pytest.mark.parametrize("cache", ["model", *FP8], ids=["model", "e4m3", "e5m2"])
def test_fused_scales_are_read_on_the_device(device, cache):
    """Unit scales (None) and scales != 1, K and V apart; a changed scale tensor changes what the next call stores
    (a captured CUDA graph sees it)."""
    H, H_kv, D, T = 4, 2, 64, 6
    cache_dtype = torch.float32 if cache == "model" else cache
    c = _case(H, H_kv, D, T, torch.float32, cache_dtype, 2, 16, device, seed=1)
    for scales in ((None, None), _scales(cache_dtype, device, 0.05, 4.0)):
        seq = _run("sequential", c, H, H_kv, D, scales)
        fused = _run(rope_and_store_kv, c, H, H_kv, D, scales)
        assert torch.equal(seq[0][:, :H * D], fused[0][:, :H * D])
        assert torch.equal(_bits(seq[1]), _bits(fused[1])) and torch.equal(_bits(seq[2]), _bits(fused[2]))
    if cache != "model":
        ks, vs = _scales(cache_dtype, device, 1.0, 1.0)
        _, kc1, _ = _run(rope_and_store_kv, c, H, H_kv, D, (ks, vs))
        ks.fill_(8.0)
        _, kc8, _ = _run(rope_and_store_kv, c, H, H_kv, D, (ks, vs))
        assert not torch.equal(_bits(kc1), _bits(kc8))


@pytest.mark.parametrize("cache", ["model", *FP8], ids=["model", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_reference(device, cache, dtype):
    """rope_and_store_kv_ref: rotary_embedding_ref then store_kv_ref. The rotation is one rounding of fp32 math in
    both, yet a GPU may contract x1 cos - x2 sin into an FMA (and the interpreter rounds bf16 its own way): q and
    float caches to the rotary test's tolerance, fp8 caches to one fp8 step."""
    H, H_kv, D, T = 14, 2, 64, 9
    cache_dtype = dtype if cache == "model" else cache
    c = _case(H, H_kv, D, T, dtype, cache_dtype, 2, 16, device, seed=2)
    scales = _scales(cache_dtype, device)
    got = _run(rope_and_store_kv, c, H, H_kv, D, scales)
    want = _run(rope_and_store_kv_ref, c, H, H_kv, D, scales)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    if cache == "model":
        torch.testing.assert_close(got[1], want[1], **tol)
        torch.testing.assert_close(got[2], want[2], **tol)
    else:
        for a, b in zip(got[1:], want[1:]):
            a, b = a.float(), b.float()
            assert ((a - b).abs() <= 2.0 ** -2 * b.abs() + 2.0 ** -9).all()   # within one step of e5m2 / e4m3
    assert torch.equal(_bits(got[2]), _bits(want[2]))   # v is not rotated: exactly store_kv's bits


def test_fused_empty_and_bad_input(device):
    H, H_kv, D = 4, 2, 64
    c = _case(H, H_kv, D, 4, torch.float32, torch.float32, 2, 16, device)
    q, k, v = _views(c["qkv"].clone(), H, H_kv, D)
    kc, vc = c["init"].clone(), c["init"].clone()
    rope_and_store_kv(c["positions"][:0], q[:0], k[:0], v[:0], kc, vc, c["slots"][:0], c["cos"], c["sin"])
    assert torch.equal(kc, c["init"])                                            # T = 0 launches nothing
    args = dict(positions=c["positions"], q=q, k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=c["slots"],
                cos=c["cos"], sin=c["sin"])
    with pytest.raises(ValueError, match="full-width"):                         # partial rotary: cos narrower
        rope_and_store_kv(**{**args, "cos": c["cos"][:, :32], "sin": c["sin"][:, :32]})
    with pytest.raises(ValueError, match="positions"):
        rope_and_store_kv(**{**args, "positions": c["positions"].to(torch.int32)})
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_and_store_kv(**{**args, "slot_mapping": c["slots"][:3]})
    with pytest.raises(ValueError, match="q must be"):
        rope_and_store_kv(**{**args, "q": q[:3]})
    with pytest.raises(ValueError, match="k_scale"):
        rope_and_store_kv(**args, k_scale=torch.tensor([1.0, 2.0], device=device))


# ------------------------------------------------------------------------------------------------ Attention layer
def _triton_backend(fused: bool):
    """The CUDA backend's kernels on this device (the interpreter on CPU), with or without the fused op."""
    from hayabusa.attention.backends import AttentionBackend
    from hayabusa.kernels.paged_attention import paged_attention

    return AttentionBackend("triton", store_kv, paged_attention, rope_and_store_kv if fused else None)


def _layer_case(device, partial: float = 1.0):
    """A Qwen2.5-0.5b-shaped attention layer (H=14, H_kv=2, D=64) and a step: a 5-token prefill of request 0 and a
    decode of request 1 (7 tokens cached), plus a padding row."""
    from types import SimpleNamespace

    from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
    from hayabusa.model.layers.attention import Attention
    from hayabusa.model.layers.rotary import RotaryEmbedding

    H, H_kv, D, bs = 14, 2, 64, 16
    cfg = SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=partial)
    rotary = RotaryEmbedding(cfg, D, 64, torch.float32, torch.device(device))
    attn = Attention(H, H_kv, D, D ** -0.5, layer_idx=0).to(device)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, (H + 2 * H_kv) * D, generator=gen).to(device)
    positions = torch.tensor([0, 1, 2, 3, 4, 7, 0], device=device)
    slots = torch.tensor([0, 1, 2, 3, 4, 16 + 7, -1], device=device)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32, device=device),
                             seq_lens=torch.tensor([5, 8], dtype=torch.int32, device=device),
                             block_table=torch.tensor([[0], [1]], dtype=torch.int32, device=device),
                             slot_mapping=slots, num_reqs=2, max_query_len=5, max_seq_len=8)
    k_cache = torch.randn(2, bs, H_kv, D, generator=gen).to(device)

    def ctx(backend):
        return ForwardContext(meta, [(k_cache.clone(), k_cache.clone())], backend)

    return attn, rotary, qkv, positions, ctx, (H, H_kv, D)


def test_attention_layer_fuses_rope_into_the_cache_write(device):
    """Attention(..., positions, rotary) on the Triton backend: the fused op, and the same output and caches as the
    kernels in sequence (rotary_embedding, store_kv, paged_attention)."""
    from hayabusa.kernels.paged_attention import paged_attention

    attn, rotary, qkv, positions, ctx, (H, H_kv, D) = _layer_case(device)
    fused_ctx, seq_ctx = ctx(_triton_backend(True)), ctx(_triton_backend(True))
    out = attn(*_views(qkv.clone(), H, H_kv, D), fused_ctx, positions=positions, rotary=rotary)

    q, k, v = _views(qkv.clone(), H, H_kv, D)
    rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    kc, vc = seq_ctx.kv_caches[0]
    meta = seq_ctx.attn_metadata
    store_kv(k, v, kc, vc, meta.slot_mapping)
    want = torch.empty(q.shape[0], H, D, device=device)
    paged_attention(q, kc, vc, want, meta.query_start_loc, meta.seq_lens, meta.block_table, attn.scale,
                    meta.max_query_len, num_seqs=meta.num_reqs)
    assert torch.equal(out[:6], want.view(-1, H * D)[:6])                      # row 6 is padding
    assert torch.equal(fused_ctx.kv_caches[0][0], kc) and torch.equal(fused_ctx.kv_caches[0][1], vc)


@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full", "partial"])
def test_attention_layer_falls_back_without_the_fused_op(device, partial):
    """No fused op (the CPU backend), or partial rotary (the kernels rotate whole heads only): RotaryEmbedding then
    store_kv, exactly what the layer did before the fused path existed."""
    attn, rotary, qkv, positions, ctx, (H, H_kv, D) = _layer_case(device, partial)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused op must not run for partial rotary")

    backend = _triton_backend(False) if partial == 1.0 else dataclasses.replace(_triton_backend(True),
                                                                                rope_and_store_kv=refuse)
    got_ctx, want_ctx = ctx(backend), ctx(backend)
    out = attn(*_views(qkv.clone(), H, H_kv, D), got_ctx, positions=positions, rotary=rotary)
    q, k, v = _views(qkv.clone(), H, H_kv, D)
    q, k = rotary(positions, q, k)
    want = attn(q, k, v, want_ctx)
    assert torch.equal(out[:6], want[:6])                                       # row 6 is padding
    assert torch.equal(got_ctx.kv_caches[0][0], want_ctx.kv_caches[0][0])


def test_cpu_backend_has_no_fused_op():
    from hayabusa.attention.backends import get_attention_backend

    assert get_attention_backend(torch.device("cpu")).rope_and_store_kv is None
