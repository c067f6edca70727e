"""store_kv (Triton) vs store_kv_ref (torch): dtypes, head counts, strided views, padding slots."""

import pytest
import torch

from hayabusa.kernels.store_kv import store_kv, store_kv_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _fused_kv(T, H, H_kv, D, dtype, device, gen):
    """k, v [T, H_kv, D] as views into a fused qkv output [T, (H + 2 H_kv) D] (dim-0 stride > H_kv D)."""
    qkv = torch.randn(T, (H + 2 * H_kv) * D, generator=gen).to(dtype).to(device)
    k = qkv[:, H * D:(H + H_kv) * D].view(T, H_kv, D)
    v = qkv[:, (H + H_kv) * D:].view(T, H_kv, D)
    return k, v


def _slots(T, num_slots, num_pad, gen):
    """Distinct random slots for T - num_pad tokens; the last num_pad tokens (and one in the middle) get -1."""
    slots = torch.randperm(num_slots, generator=gen)[:T].to(torch.int64)
    slots[T - num_pad:] = -1
    slots[T // 2] = -1
    return slots


def _run_both(k, v, slots, num_blocks, block_size, cache_dtype, device, gen):
    H_kv, D = k.shape[1:]
    init = torch.randn(num_blocks, block_size, H_kv, D, generator=gen).to(cache_dtype).to(device)
    caches = [init.clone() for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    return init, caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,H_kv,D", [(4, 4, 64), (4, 2, 128), (14, 2, 80)])
def test_store_kv_matches_ref(device, dtype, H, H_kv, D):
    gen = torch.Generator().manual_seed(0)
    T, num_blocks, block_size = 13, 5, 16
    k, v = _fused_kv(T, H, H_kv, D, dtype, device, gen)
    slots = _slots(T, num_blocks * block_size, num_pad=3, gen=gen).to(device)
    init, (kc, vc, kc_ref, vc_ref) = _run_both(k, v, slots, num_blocks, block_size, dtype, device, gen)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    keep = slots >= 0
    assert torch.equal(kc.view(-1, H_kv, D)[slots[keep]], k[keep])  # the ref is not trivially wrong either
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert torch.equal(kc.view(-1, H_kv, D)[untouched], init.view(-1, H_kv, D)[untouched])


def test_store_kv_head_strided_input_and_cast(device):
    """k with a non-contiguous head dim ([H_kv, T, D] transposed) into an fp32 cache from bf16 rows."""
    gen = torch.Generator().manual_seed(1)
    T, H_kv, D, num_blocks, block_size = 9, 3, 96, 4, 32
    k = torch.randn(H_kv, T, D, generator=gen).to(torch.bfloat16).to(device).transpose(0, 1)
    v = torch.randn(H_kv, T, D, generator=gen).to(torch.bfloat16).to(device).transpose(0, 1)
    slots = _slots(T, num_blocks * block_size, num_pad=1, gen=gen).to(device)
    _, (kc, vc, kc_ref, vc_ref) = _run_both(k, v, slots, num_blocks, block_size, torch.float32, device, gen)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_store_kv_all_padding_and_empty(device):
    gen = torch.Generator().manual_seed(2)
    k, v = _fused_kv(4, 2, 2, 64, torch.float16, device, gen)
    slots = torch.full((4,), -1, dtype=torch.int64, device=device)
    init, (kc, vc, _, _) = _run_both(k, v, slots, 2, 16, torch.float16, device, gen)
    assert torch.equal(kc, init) and torch.equal(vc, init)
    store_kv(k[:0], v[:0], kc, vc, slots[:0])  # T = 0 launches nothing
    assert torch.equal(kc, init)


def test_store_kv_rejects_bad_input(device):
    k = torch.randn(4, 2, 64, device=device)
    cache = torch.zeros(2, 16, 2, 64, device=device)
    with pytest.raises(ValueError, match="int64"):
        store_kv(k, k, cache, cache.clone(), torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="cache rows"):
        store_kv(k, k, torch.zeros(2, 16, 4, 64, device=device), torch.zeros(2, 16, 4, 64, device=device),
                 torch.zeros(4, dtype=torch.int64, device=device))
