"""On a GPU, at the qwen2.5-0.5b attention shape (14 q heads, 2 KV heads, D 64, block 16, bf16 and fp16): the
batch-invariant attention with split-KV (kernels/paged_attention_bi.py, the real BI_SPLIT_TILES / BI_MAX_SPLITS)
gives one request's rows the same bits at lengths 1 .. 4,000:
- a decode row alone, among 15 / 127 other requests of other lengths (split grid S from a longer max_seq_len, or the
  inline launch when the grid is large), at forced split bounds (max_seq_len 8,192 / 65,536: S capped), split and
  inline forced;
- prefill chunks of 1 / 7 / 64 / 300 rows ending at or passing that position, alone and batched: every row equal
  to the decode step of its own position;
- a CUDA-graph replay (captured at max_seq_len 4,096) equal to the eager call;
and matches paged_attention_ref within bf16 / fp16 tolerance.

Run: pytest -q tests/kernels/test_paged_attention_bi_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels.paged_attention import paged_attention, paged_attention_ref

pytestmark = pytest.mark.cuda

H, H_KV, D, BS = 14, 2, 64, 16
LENGTHS = (1, 17, 255, 256, 257, 640, 1500, 4000)


class _Pool:
    """Requests with K/V for positions 0 .. len - 1 in a shared paged cache (blocks shuffled) and one query per
    position; a step reads a request at any seq_len <= its length."""

    def __init__(self, lens: list[int], dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        need = [-(-n // BS) for n in lens]
        num_blocks = sum(need)
        self.k_cache = torch.randn(num_blocks, BS, H_KV, D, device="cuda", generator=gen).to(dtype)
        self.v_cache = torch.randn(num_blocks, BS, H_KV, D, device="cuda", generator=gen).to(dtype)
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
        self.table = torch.zeros(len(lens), max(need), dtype=torch.int32, device="cuda")
        off = 0
        for i, n in enumerate(need):
            self.table[i, :n] = perm[off:off + n]
            off += n
        self.q = [torch.randn(n, H, D, device="cuda", generator=gen).to(dtype) for n in lens]
        self.lens = lens

    def step(self, entries: list[tuple[int, int, int]], fn=paged_attention, **kw) -> list[torch.Tensor]:
        """entries: (request, seq_len, n) = its queries at positions seq_len - n .. seq_len - 1. Returns each
        entry's output rows [n, H, D]."""
        q = torch.cat([self.q[i][s - n:s] for i, s, n in entries])
        qsl = torch.tensor([0] + [n for _, _, n in entries], device="cuda").cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([s for _, s, _ in entries], dtype=torch.int32, device="cuda")
        table = self.table[[i for i, _, _ in entries]].contiguous()
        out = torch.zeros_like(q)
        if fn is paged_attention:
            kw = dict(batch_invariant=True, **kw)
        fn(q, self.k_cache, self.v_cache, out, qsl, seq_lens, table, D ** -0.5, max(n for _, _, n in entries),
           **kw)
        return [out[int(qsl[j]):int(qsl[j + 1])] for j in range(len(entries))]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def pool(request) -> _Pool:
    others = torch.randint(1, 4097, (127,), generator=torch.Generator().manual_seed(1)).tolist()
    return _Pool(list(LENGTHS) + others, request.param)


def _others(pool: _Pool, k: int) -> list[tuple[int, int, int]]:
    return [(len(LENGTHS) + j, pool.lens[len(LENGTHS) + j], 1) for j in range(k)]


@pytest.mark.parametrize("L", LENGTHS)
def test_decode_row_bits_do_not_depend_on_batch_or_bound(pool, L):
    t = LENGTHS.index(L)
    alone = pool.step([(t, L, 1)])[0]
    o15, o127 = _others(pool, 15), _others(pool, 127)
    cases = {
        "15 others": pool.step(o15[:7] + [(t, L, 1)] + o15[7:])[7],
        "15 others inline": pool.step([(t, L, 1)] + o15, split=False)[0],
        "127 others": pool.step(o127[:64] + [(t, L, 1)] + o127[64:])[64],
        "127 others split": pool.step(o127 + [(t, L, 1)], split=True)[127],
        "bound 8192": pool.step([(t, L, 1)], max_seq_len=8192)[0],
        "bound 65536": pool.step([(t, L, 1)], max_seq_len=65536, split=True)[0],
        "alone inline": pool.step([(t, L, 1)], split=False)[0],
    }
    for name, rows in cases.items():
        assert torch.equal(rows, alone), name
    ref = pool.step([(t, L, 1)], fn=paged_attention_ref)[0]
    torch.testing.assert_close(alone.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("L", [L for L in LENGTHS if L > 1])
@pytest.mark.parametrize("chunk", [7, 64, 300])
def test_prefill_chunk_rows_equal_their_decode_steps(pool, L, chunk):
    t = LENGTHS.index(L)
    n = min(chunk, L)
    alone = pool.step([(t, L, n)])[0]
    other = len(LENGTHS)                            # another request's prefill chunk in the same step
    s_o = min(2000, pool.lens[other])
    batched = pool.step([(other, s_o, min(100, s_o)), (t, L, n)] + _others(pool, 15)[1:])[1]
    assert torch.equal(batched, alone)
    for j in sorted({0, n // 2, n - 1}):          # rows of the chunk against their own decode steps
        p = L - n + j
        assert torch.equal(alone[j:j + 1], pool.step([(t, p + 1, 1)])[0]), (L, chunk, j)
    ref = pool.step([(t, L, n)], fn=paged_attention_ref)[0]
    torch.testing.assert_close(alone.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_graph_replay_equals_eager(pool):
    """A decode launch captured once (R = 4, max_seq_len 4,096 as the runner's graphs use max_model_len), replayed
    with new lengths and block tables: the bits of the eager call at each step's own max_seq_len."""
    R = 4
    q = torch.zeros(R, H, D, dtype=pool.q[0].dtype, device="cuda")
    out = torch.zeros_like(q)
    qsl = torch.arange(R + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones(R, dtype=torch.int32, device="cuda")
    table = torch.zeros(R, pool.table.shape[1], dtype=torch.int32, device="cuda")

    def launch():
        paged_attention(q, pool.k_cache, pool.v_cache, out, qsl, seq_lens, table, D ** -0.5, 1,
                        batch_invariant=True, max_seq_len=4096)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for step in ([0, 1, 2, 3], [7, 3, 5, 8], [6, 7, 4, 0]):
        entries = [(i, pool.lens[i] if i < len(LENGTHS) else min(pool.lens[i], 4096), 1) for i in step]
        for j, (i, s, _) in enumerate(entries):
            q[j] = pool.q[i][s - 1]
            seq_lens[j] = s
            table[j] = pool.table[i]
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.cat(pool.step(entries))
        assert torch.equal(out, eager), step
