"""Short-query steps (speculative decoding's verify steps, q_len 2..SHORT_QUERY_MAX): paged_attention with split-KV
and the short-query tile config vs paged_attention_ref and vs the unsplit prefill-tile kernel (issue #21).

Causal: each query token of a request sees one more key than the previous one, so with many splits the last
splits hold no key for the early tokens (and, for short contexts, no key at all): those partials must weigh 0.
Cases come from test_paged_attention.make_case (shuffled block table with holes, NaN in unowned cache slots,
q a strided view, padding tokens).
"""

import pytest
import torch

from hayabusa.kernels import paged_attention as pa
from hayabusa.kernels.paged_attention import (SHORT_QUERY_MAX, _auto_num_splits, _tile_config, is_short_query,
                                              paged_attention)
from tests.kernels.test_paged_attention import SENTINEL, TOL, check, make_case

# (cached, new): verify rows of 1 + k tokens next to plain decode rows and an empty row; contexts from one key
# tile to several, some not a multiple of the block size; (3, 5): 5 queries over 8 keys, every split but the first
# empty for all tokens at TILE_N 128
VERIFY = [(700, 5), (3, 5), (130, 4), (0, 0), (255, 1), (40, 2)]


@pytest.mark.parametrize("q_len", [2, 3, 4, 5])
@pytest.mark.parametrize("H,H_kv", [(9, 3), (28, 4)])             # SmolLM2 (group 3), Qwen2.5-7B (group 7)
@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_short_query_split_matches_ref(device, q_len, H, H_kv, num_kv_splits, monkeypatch):
    # the kernel's math with wide (64-row) tiles too, whatever the grid-size rule would pick for these 6 requests
    monkeypatch.setattr(pa, "SHORT_QUERY_WIDE_MAX_PROGRAMS", 1 << 30)
    reqs = [(c, min(n, q_len)) if n > 1 else (c, n) for c, n in VERIFY]
    case = make_case(reqs, H, H_kv, 64, 16, torch.float32, device, seed=q_len)
    assert case["max_query_len"] == q_len and is_short_query(q_len, H // H_kv)
    check(case, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_short_query_dtypes_and_block_sizes(device, dtype, block_size):
    """D 128 (Qwen2.5-7B), the model dtypes, the engine's block sizes; 32 splits (the most _auto picks)."""
    case = make_case(VERIFY, 28, 4, 128, block_size, dtype, device, seed=block_size)
    check(case, num_kv_splits=32)


@pytest.mark.parametrize("window", [None, 50])
def test_short_query_split_equals_unsplit_prefill_tiles(device, monkeypatch, window):
    """The new path (short-query tile, 4 splits) equals the old one (prefill tile, one pass) within tolerance."""
    case = make_case(VERIFY, 9, 3, 64, 16, torch.float32, device, seed=7)
    outs = []
    for on, splits in ((True, 4), (False, 1)):
        monkeypatch.setattr(pa, "SHORT_QUERY_SPLIT", on)
        out = torch.full(case["q"].shape, SENTINEL, dtype=case["q"].dtype, device=case["q"].device)
        paged_attention(out=out, **case, sliding_window=window, num_kv_splits=splits)
        outs.append(out)
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=rtol)
    valid = int(case["query_start_loc"][-1])
    assert torch.isfinite(outs[0][:valid]).all() and (outs[0][valid:] == SENTINEL).all()


def test_graph_padding_short_query(device):
    """A verify graph's shape: max_query_len Q above some rows' lengths, trailing rows without queries."""
    case = make_case(VERIFY + [(0, 0), (0, 0)], 9, 3, 64, 16, torch.float32, device, seed=11)
    assert case["max_query_len"] == 5
    check(case, num_kv_splits=16)


def test_short_query_choice():
    """Which steps are short-query, their tiles and split counts: host ints only (capture and replay agree)."""
    assert is_short_query(5, 3) and is_short_query(5, 7) and is_short_query(SHORT_QUERY_MAX, 8)
    assert not is_short_query(1, 3)                       # decode keeps its own config
    assert not is_short_query(SHORT_QUERY_MAX + 1, 3)     # prefill
    assert not is_short_query(5, 16)                      # 80 rows: more than one 64-row tile
    # 64-row tiles (group 7 at 5 tokens) only for tiny grids (measured: slower than the prefill tile from R = 4)
    assert is_short_query(5, 7, num_programs=4) and not is_short_query(5, 7, num_programs=16)
    assert is_short_query(5, 3, num_programs=16 * 3)     # 16-row tiles at any grid
    assert _tile_config(5, 3, 64, 2, True) == dict(BLOCK_M=16, BLOCK_Q=5, TILE_N=128, num_warps=4, num_stages=2)
    assert _tile_config(5, 7, 128, 2, True) == dict(BLOCK_M=64, BLOCK_Q=9, TILE_N=128, num_warps=4, num_stages=2)
    # prefill is unchanged
    assert _tile_config(5, 3, 64, 2, False) == dict(BLOCK_M=64, BLOCK_Q=21, TILE_N=32, num_warps=4, num_stages=2)
    assert _tile_config(600, 7, 128, 2) == dict(BLOCK_M=64, BLOCK_Q=9, TILE_N=32, num_warps=4, num_stages=2)
    cpu = torch.device("cpu")
    assert _auto_num_splits(3, 5, cpu, True) == 1         # the interpreter never splits on its own

