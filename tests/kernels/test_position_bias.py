"""paged_attention's ``position_bias`` (T5's relative position bias: bias[h, query_pos - key_pos] added to the
scores): the Triton kernel vs the torch reference (Triton's interpreter on CPU), and the reference vs dense
attention with the bias."""

import pytest
import torch

from hayabusa.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.test_paged_attention import MIXED, check, make_case


def _bias(H: int, L: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(H, L, generator=torch.Generator().manual_seed(seed)) * 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [8, 512])   # 8: most distances clamp to the last column (T5's far bucket)
def test_kernel_matches_ref_mixed(device, dtype, L):
    case = make_case(MIXED, 4, 4, 64, 16, dtype, device)
    check(case, position_bias=_bias(4, L).to(device))


@pytest.mark.parametrize("num_kv_splits", [None, 4])
def test_kernel_matches_ref_decode(device, num_kv_splits):
    """Decode rows (the CUDA-graph shape), with and without split-KV, T5-small's head count and head dim."""
    reqs = [(0, 1), (15, 1), (300, 1), (0, 0), (33, 1)]
    case = make_case(reqs, 8, 8, 64, 16, torch.float32, device, seed=5)
    check(case, position_bias=_bias(8, 512, seed=1).to(device), num_kv_splits=num_kv_splits)


def test_bias_changes_the_output(device):
    case = make_case(MIXED, 4, 4, 32, 16, torch.float32, "cpu")
    a, b = torch.zeros_like(case["q"]), torch.zeros_like(case["q"])
    paged_attention_ref(out=a, **case)
    paged_attention_ref(out=b, **case, position_bias=_bias(4, 64))
    assert (a - b).abs().max() > 1e-2


def test_ref_matches_dense_attention_with_bias():
    S, H, D, bs, L = 70, 4, 16, 16, 40
    case = make_case([(0, S)], H, H, D, bs, torch.float32, "cpu", num_pad_tokens=0)
    bias = _bias(H, L)
    q = case["q"]
    pos = torch.arange(S)
    slots = case["block_table"][0, pos // bs].long() * bs + pos % bs
    k = case["k_cache"].view(-1, H, D)[slots]
    v = case["v_cache"].view(-1, H, D)[slots]
    s = torch.einsum("qhd,khd->hqk", q, k) * case["scale"]
    dist = (pos[:, None] - pos[None, :]).clamp(0, L - 1)
    s = s + bias[:, dist]
    s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    out = torch.empty_like(q)
    paged_attention_ref(out=out, **case, position_bias=bias)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_rejects_bad_bias(device):
    case = make_case(MIXED, 4, 4, 32, 16, torch.float32, device)
    out = torch.empty_like(case["q"])
    with pytest.raises(ValueError, match="position_bias"):
        paged_attention(out=out, **case, position_bias=torch.zeros(3, 8, device=device))
