"""Fused RMSNorm(+residual), SiLU-and-mul and RoPE kernels against their torch references (CUDA, or the Triton
interpreter on CPU), and the references against HF's modules."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("N", [64, 96, 896])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fused_add_rms_norm(dtype, with_residual, N, gemma):
    from hayabusa.kernels.fused_norm import fused_add_rms_norm, fused_add_rms_norm_ref

    torch.manual_seed(0)
    x = torch.randn(7, N, dtype=dtype, device=DEVICE)
    r = torch.randn(7, N, dtype=dtype, device=DEVICE) if with_residual else None
    w = torch.randn(N, dtype=dtype, device=DEVICE)
    out, res = fused_add_rms_norm(x, r, w, 1e-6, gemma=gemma)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-6, gemma=gemma)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    if with_residual:
        torch.testing.assert_close(res, ref_res, **_tol(dtype))
    else:
        assert res is None


def test_gemma_rms_norm_ref_equals_hf_and_the_module():
    """The (1 + w) reference is HF Gemma2RMSNorm bit for bit, and GemmaRMSNorm's CPU path is the same function."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from hayabusa.kernels.fused_norm import fused_add_rms_norm_ref
    from hayabusa.model.layers.norm import GemmaRMSNorm

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        hf = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
        hf.weight.data.normal_()
        ours = GemmaRMSNorm(64, 1e-6, dtype, torch.device("cpu"))
        ours.weight.data.copy_(hf.weight.data)
        x, r = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
        out, _ = fused_add_rms_norm_ref(x, None, hf.weight.data, 1e-6, gemma=True)
        assert torch.equal(out, hf(x)) and torch.equal(ours(x), out)
        out, res = fused_add_rms_norm_ref(x, r, hf.weight.data, 1e-6, gemma=True)
        o2, r2 = ours(x, r)
        assert torch.equal(out, hf(x + r)) and torch.equal(o2, out) and torch.equal(r2, res)


def test_rms_norm_ref_equals_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hayabusa.kernels.fused_norm import fused_add_rms_norm_ref

    torch.manual_seed(0)
    hf = LlamaRMSNorm(64, eps=1e-5)
    hf.weight.data.normal_()
    x = torch.randn(5, 64)
    out, _ = fused_add_rms_norm_ref(x, None, hf.weight.data, 1e-5)
    assert torch.equal(out, hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 172, 2000])
def test_silu_and_mul(dtype, D):
    from hayabusa.kernels.activation import silu_and_mul, silu_and_mul_ref

    torch.manual_seed(0)
    x = torch.randn(5, 2 * D, dtype=dtype, device=DEVICE)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **_tol(dtype))


def test_rotary_refuses_what_the_kernel_cannot_read():
    """rotary_embedding checks its arguments as rope_and_store_kv does (one check_rotary_inputs)."""
    from hayabusa.kernels.rotary import rotary_embedding

    q, k = torch.zeros(3, 4, 16, device=DEVICE), torch.zeros(3, 2, 16, device=DEVICE)
    cos = sin = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding(torch.zeros(3, dtype=torch.int32, device=DEVICE), q, k, cos, sin)
    with pytest.raises(ValueError, match="full-width"):
        rotary_embedding(torch.zeros(3, dtype=torch.int64, device=DEVICE), q, k, cos[:, :8], sin[:, :8])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,H_kv,D", [(4, 2, 16), (7, 1, 64), (14, 2, 64)])
def test_rotary_in_place_on_fused_qkv_views(dtype, H, H_kv, D):
    from hayabusa.kernels.rotary import rotary_embedding, rotary_embedding_ref

    torch.manual_seed(0)
    T, P = 6, 32
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(P).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    qkv = torch.randn(T, (H + 2 * H_kv) * D, dtype=dtype, device=DEVICE)
    pos = torch.tensor([0, 3, 31, 7, 7, 1], device=DEVICE)

    def views(t):
        q, k, _ = t.split([H * D, H_kv * D, H_kv * D], dim=-1)
        return q.view(T, H, D), k.view(T, H_kv, D)

    a, b = qkv.clone(), qkv.clone()
    rotary_embedding(pos, *views(a), cos, sin)
    rotary_embedding_ref(pos, *views(b), cos, sin)
    torch.testing.assert_close(a, b, **_tol(dtype))
    assert torch.equal(a[:, (H + H_kv) * D:], qkv[:, (H + H_kv) * D:])   # v untouched


def test_host_cdiv_and_next_power_of_2_are_tritons():
    """kernels/_triton.cdiv / next_power_of_2 (the launch wrappers' host arithmetic, without Triton's
    constexpr-function call) give triton.cdiv's and triton.next_power_of_2's values."""
    triton = pytest.importorskip("triton")
    from hayabusa.kernels._triton import cdiv, next_power_of_2

    for a in (*range(0, 300), 4095, 4096, 4097, 151936, 2 ** 31 - 1, 2 ** 40 + 3):
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
