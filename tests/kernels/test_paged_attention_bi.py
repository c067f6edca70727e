"""Batch-invariant attention with split-KV (kernels/paged_attention_bi.py) under the Triton interpreter: a query
row's bits are the same alone or among longer / shorter requests (so the padded split count differs), in a decode
step or a prefill chunk, in split or inline mode, at any forced split bound; and they match the torch reference.

Splits are made short (BI_SPLIT_TILES = 1: 64 keys) so that a few hundred keys give several splits."""

import pytest
import torch

from hayabusa.kernels import paged_attention_bi as pab
from hayabusa.kernels.paged_attention import paged_attention, paged_attention_ref
from hayabusa.kernels.store_kv import store_kv_ref

H, H_KV, D, BS = 4, 2, 16, 8
L_T = 150                       # the target request's length: splits of 64 keys -> 0..63, 64..127, 128..149


@pytest.fixture
def short_splits(monkeypatch):
    monkeypatch.setattr(pab, "BI_SPLIT_TILES", 1)


def _kv(n, gen):
    k, v = torch.randn(2, n, H_KV, D, generator=gen).to(torch.bfloat16)
    return k, v


def _step(reqs, fn=pab.paged_attention_bi, **kw):
    """One attention call over reqs = [(k [S, H_kv, D], v, q [n, H, D])] (queries at positions S - n .. S - 1);
    blocks in shuffled order. Returns each request's output rows [n, H, D]."""
    gen = torch.Generator().manual_seed(1)
    need = [-(-k.shape[0] // BS) for k, _, _ in reqs]
    num_blocks = sum(need) + 1
    k_cache = torch.full((num_blocks, BS, H_KV, D), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    table = torch.full((len(reqs), max(need)), num_blocks - 1, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32)
    off = 0
    for i, (k, v, _) in enumerate(reqs):
        table[i, :need[i]] = perm[off:off + need[i]]
        off += need[i]
        pos = torch.arange(k.shape[0])
        store_kv_ref(k, v, k_cache, v_cache, table[i, pos // BS].long() * BS + pos % BS)
    q = torch.cat([x for _, _, x in reqs])
    q_lens = [x.shape[0] for _, _, x in reqs]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    out = torch.zeros_like(q)
    fn(q, k_cache, v_cache, out, qsl, torch.tensor([k.shape[0] for k, _, _ in reqs], dtype=torch.int32), table,
       D ** -0.5, max(q_lens), **kw)
    return [out[int(qsl[i]):int(qsl[i + 1])] for i in range(len(reqs))]


def _target(gen, n=L_T):
    k, v = _kv(n, gen)
    return k, v, torch.randn(n, H, D, generator=gen).to(torch.bfloat16)


def _others(gen, lens):
    """Other requests (length, new tokens): random K/V and queries."""
    return [(*_kv(s, gen), torch.randn(n, H, D, generator=gen).to(torch.bfloat16)) for s, n in lens]


@pytest.mark.parametrize("window", [None, 40])
def test_split_rows_identical_alone_batched_decode_prefill(device, short_splits, window):
    gen = torch.Generator().manual_seed(0)
    k, v, q = _target(gen)
    longer, shorter = _others(gen, [(300, 1), (5, 1)])
    kw = dict(sliding_window=window)

    def decode(others, **extra):   # the target's last position as a one-token step
        reqs = [others[0], (k, v, q[-1:]), *others[1:]] if others else [(k, v, q[-1:])]
        return _step(reqs, **kw, **extra)[1 if others else 0]

    alone = decode([])                                              # split mode by default (R * H_kv < 4 "SMs")
    rows = {"alone": alone,
            "batched split": decode([longer, shorter], split=True),          # S = 8 (300 keys) instead of 4
            "batched inline": decode([longer, shorter], split=False),
            "bound 4096": decode([shorter], split=True, max_seq_len=4096),  # S = 32
            "alone inline": decode([], split=False)}
    for name, r in rows.items():
        assert torch.equal(r, alone), name
    # a prefill chunk (positions 120..149) that ends at the decode row, alone and batched, inline and split
    chunk = (k, v, q[120:])
    pre = {"alone inline": _step([chunk], split=False, **kw)[0],
           "batched split": _step([longer, chunk, shorter], split=True, **kw)[1],
           "batched inline": _step([shorter, chunk, longer], split=False, **kw)[1]}
    for name, r in pre.items():
        assert torch.equal(r, pre["alone inline"]), name
    assert torch.equal(pre["alone inline"][-1:], alone)
    # a row in the middle of the chunk, as its own decode step (its query tile then ends a split earlier)
    assert torch.equal(pre["alone inline"][5:6], _step([(k[:126], v[:126], q[125:126])], **kw)[0])
    ref = _step([chunk], fn=paged_attention_ref, **kw)[0]
    torch.testing.assert_close(pre["alone inline"].float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_split_cap_last_split_takes_the_rest(device, short_splits, monkeypatch):
    """Past BI_MAX_SPLITS splits the last one walks every remaining key: still exact and invariant."""
    monkeypatch.setattr(pab, "BI_MAX_SPLITS", 2)
    gen = torch.Generator().manual_seed(2)
    k, v, q = _target(gen, 300)                     # splits 0..63 and 64..299
    other, = _others(gen, [(40, 1)])
    alone = _step([(k, v, q[-1:])], split=True)[0]
    assert torch.equal(_step([other, (k, v, q[-1:])], split=False)[1], alone)
    chunk = _step([(k, v, q[270:]), other], split=False)[0]
    assert torch.equal(chunk[-1:], alone)
    ref = _step([(k, v, q[270:])], fn=paged_attention_ref)[0]
    torch.testing.assert_close(chunk.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_paged_attention_batch_invariant_routes_here(device, short_splits):
    """paged_attention(batch_invariant=True) is paged_attention_bi (same bits), and its bad inputs fail by name."""
    gen = torch.Generator().manual_seed(3)
    k, v, q = _target(gen, 70)
    reqs = [(k, v, q[-3:])]
    assert torch.equal(_step(reqs, fn=paged_attention, batch_invariant=True)[0], _step(reqs, split=False)[0])
    with pytest.raises(ValueError, match="max_seq_len"):
        _step(reqs, max_seq_len=0)
    with pytest.raises(ValueError, match="position_bias"):
        _step(reqs, fn=paged_attention, batch_invariant=True, position_bias=torch.zeros(H, 4))


def test_bi_num_splits_is_a_capped_power_of_two_bucket():
    keys = pab.BI_SPLIT_TILES * 64
    assert [pab.bi_num_splits(n, 64) for n in (1, keys, keys + 1, 3 * keys, 5 * keys)] == [1, 1, 2, 4, 8]
    assert pab.bi_num_splits(10 ** 7, 64) == pab.BI_MAX_SPLITS
