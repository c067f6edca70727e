"""Batch-invariant kernels: one input's rows are bit-identical alone and inside batches of other inputs of several
sizes (and, for attention, however its prompt is chunked), and match the default kernels within dtype tolerance.

Triton kernels run under TRITON_INTERPRET on CPU (tiny shapes); the CPU references (the mode's CPU path) are
checked the same way.
"""

import pytest
import torch
import torch.nn.functional as F

from hayabusa.kernels.batch_invariant import (log_softmax_bi, log_softmax_bi_ref, matmul_bi, matmul_bi_ref,
                                              matmul_bi_unsplit, paged_attention_bi_ref)
from hayabusa.kernels.fused_norm import fused_add_rms_norm, fused_add_rms_norm_ref
from hayabusa.kernels.paged_attention import paged_attention, paged_attention_ref
from hayabusa.kernels.store_kv import store_kv_ref

BATCH_SIZES = (1, 3, 64, 65, 130)      # 64 / 65 / 130 straddle the GEMM's 64-row tiles
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def _embed(row: torch.Tensor, n: int, at: int, gen: torch.Generator) -> torch.Tensor:
    """[n, ...] random rows with ``row`` at index ``at``."""
    batch = torch.randn(n, *row.shape, generator=gen).to(row.dtype)
    batch[at] = row
    return batch


def _row_everywhere(fn, row: torch.Tensor, sizes=BATCH_SIZES) -> list[torch.Tensor]:
    """fn(batch)[at] for the same row placed in batches of each size at several positions."""
    gen = torch.Generator().manual_seed(1)
    outs = []
    for n in sizes:
        for at in sorted({0, n // 2, n - 1}):
            outs.append(fn(_embed(row, n, at, gen))[at])
    return outs


def _assert_all_equal(outs: list[torch.Tensor]) -> None:
    for i, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"variant {i} differs: max |diff| {(o.float() - outs[0].float()).abs().max()}"


# ------------------------------------------------------------------------------------------------------ matmul
@pytest.mark.parametrize("gemm", [matmul_bi, matmul_bi_unsplit])    # the mode's GEMM; its first one (benchmarks)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_bi_kernel_row_invariant(device, dtype, gemm):
    gen = torch.Generator().manual_seed(0)
    N, K = 72, 80                                          # both cross a 64 tile: masked tails in N and K
    w = torch.randn(N, K, generator=gen).to(dtype).to(device)
    b = torch.randn(N, generator=gen).to(dtype).to(device)
    row = torch.randn(K, generator=gen).to(dtype)
    outs = _row_everywhere(lambda x: gemm(x.to(device), w, b).cpu(), row)
    _assert_all_equal(outs)
    ref = F.linear(row[None].float(), w.float().cpu(), b.float().cpu())[0]
    torch.testing.assert_close(outs[0].float(), ref, rtol=TOL[dtype], atol=TOL[dtype] * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_bi_ref_row_invariant(dtype):
    gen = torch.Generator().manual_seed(0)
    N, K = 300, 896
    w = torch.randn(N, K, generator=gen).to(dtype) / K ** 0.5
    row = torch.randn(K, generator=gen).to(dtype)
    outs = _row_everywhere(lambda x: matmul_bi_ref(x, w, None), row, sizes=(1, 2, 7, 64, 200))
    _assert_all_equal(outs)
    torch.testing.assert_close(outs[0].float(), F.linear(row[None].float(), w.float())[0],
                               rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("gemm", [matmul_bi, matmul_bi_unsplit])
def test_matmul_bi_rejects_mismatched_weight(device, gemm):
    with pytest.raises(ValueError, match="weight"):
        gemm(torch.zeros(2, 8, device=device), torch.zeros(4, 9, device=device))


# ------------------------------------------------------------------------------------------------- log_softmax
def test_log_softmax_bi_kernel_row_invariant(device):
    gen = torch.Generator().manual_seed(0)
    row = 4 * torch.randn(2500, generator=gen)              # three 1024-wide chunks, the last one masked
    kernel = log_softmax_bi if device == "cuda" else _log_softmax_interpreted
    outs = _row_everywhere(lambda x: kernel(x.to(device)).cpu(), row, sizes=(1, 3, 17))
    _assert_all_equal(outs)
    torch.testing.assert_close(outs[0], torch.log_softmax(row, -1), rtol=1e-5, atol=1e-5)


def _log_softmax_interpreted(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel itself under the interpreter (log_softmax_bi takes the torch path on CPU)."""
    from hayabusa.kernels.batch_invariant import _log_softmax_bi_kernel

    y = torch.empty_like(x, dtype=torch.float32)
    _log_softmax_bi_kernel[(x.shape[0],)](x, y, x.shape[1], x.stride(0), y.stride(0), BLOCK_V=1024)
    return y


def test_log_softmax_bi_ref_row_invariant():
    gen = torch.Generator().manual_seed(0)
    row = 4 * torch.randn(151_936 // 8, generator=gen)
    _assert_all_equal(_row_everywhere(log_softmax_bi_ref, row, sizes=(1, 2, 9, 33)))


# ------------------------------------------------------------------------------------------------------ norms
def test_rms_norm_kernels_are_row_invariant(device):
    """RMSNorm needs nothing new in the mode: the Triton kernel is one program per row (its block depends on N
    only) and the CPU path a per-row torch mean over the last dim."""
    gen = torch.Generator().manual_seed(0)
    N = 96
    w = torch.randn(N, generator=gen).to(torch.bfloat16)
    row, res = torch.randn(2, N, generator=gen).to(torch.bfloat16)

    def kernel(x):
        out, new_res = fused_add_rms_norm(x.to(device), torch.roll(x, 1, 0).to(device), w.to(device), 1e-6)
        return out.cpu()

    # the residual of the row is its neighbour in the batch: put the same (row, res) pair everywhere
    gen2 = torch.Generator().manual_seed(2)
    outs, outs_ref = [], []
    for n in (2, 5, 33):
        x = torch.randn(n, N, generator=gen2).to(torch.bfloat16)
        x[0], x[n - 1] = row, res                           # roll(x, 1)[0] = x[n - 1]
        outs.append(kernel(x)[0])
        outs_ref.append(fused_add_rms_norm_ref(x, torch.roll(x, 1, 0), w, 1e-6)[0][0])
    _assert_all_equal(outs)
    _assert_all_equal(outs_ref)
    torch.testing.assert_close(outs[0].float(), outs_ref[0].float(), rtol=2e-2, atol=2e-2)


# -------------------------------------------------------------------------------------------------- attention
H, H_KV, D, BS = 4, 2, 16, 8
S = 100                                                     # the target request's length (2 tiles of 64 keys)


def _target_case(dtype, gen):
    """The target request's K/V [S, H_kv, D] and queries [S, H, D] (one per position)."""
    k, v = torch.randn(2, S, H_KV, D, generator=gen).to(dtype)
    q = torch.randn(S, H, D, generator=gen).to(dtype)
    return q, k, v


def _run_step(fn, target, chunk: tuple[int, int], others: list[tuple[int, int]], dtype, device, gen, **kw):
    """One attention call: the target's queries at positions chunk = (start, end) (its K/V for 0..end in the
    cache), among ``others`` (cached, new) requests of random K/V placed before and after it. Returns the
    target's rows [end - start, H, D] (on CPU)."""
    q_t, k_t, v_t = target
    reqs = others[: len(others) // 2] + [None] + others[len(others) // 2:]
    lens = [(c + n) if r is not None else chunk[1] for r in reqs for c, n in [r or (0, 0)]]
    need = [-(-s // BS) for s in lens]
    num_blocks = sum(need) + 1
    k_cache = torch.full((num_blocks, BS, H_KV, D), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    table = torch.full((len(reqs), max(need)), num_blocks - 1, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32)
    qs, off = [], 0
    for i, (r, s) in enumerate(zip(reqs, lens)):
        table[i, :need[i]] = perm[off:off + need[i]]
        off += need[i]
        pos = torch.arange(s)
        slots = table[i, pos // BS].long() * BS + pos % BS
        if r is None:
            store_kv_ref(k_t[:s], v_t[:s], k_cache, v_cache, slots)
            qs.append(q_t[chunk[0]:chunk[1]])
        else:
            kv = torch.randn(2, s, H_KV, D, generator=gen).to(dtype)
            store_kv_ref(kv[0], kv[1], k_cache, v_cache, slots)
            qs.append(torch.randn(r[1], H, D, generator=gen).to(dtype))
    q_lens = [x.shape[0] for x in qs]
    q = torch.cat(qs)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    out = torch.zeros_like(q).to(device)
    fn(q.to(device), k_cache.to(device), v_cache.to(device), out, qsl.to(device),
       torch.tensor(lens, dtype=torch.int32, device=device), table.to(device), D ** -0.5, max(q_lens), **kw)
    t = reqs.index(None)
    return out[int(qsl[t]):int(qsl[t + 1])].cpu()


def _chunkings_and_batches():
    """(chunks of the target's 100 positions, other requests) scenarios; all give the rows of every position.
    The last chunking ends in a one-token step (a decode of the last position)."""
    alone = [[(0, S)]]
    chunked = [[(0, 64), (64, 100)], [(0, 37), (37, 99), (99, 100)]]
    others = [[], [(30, 1), (0, 20), (12, 1)]]
    return [(c, o) for c in alone + chunked for o in others]


def _positions_rows(fn, dtype, device, **kw):
    gen = torch.Generator().manual_seed(0)
    target = _target_case(dtype, gen)
    results = []
    for chunks, others in _chunkings_and_batches():
        rows = torch.cat([_run_step(fn, target, c, others, dtype, device, gen, **kw) for c in chunks])
        results.append(rows)  # [positions covered, H, D]
    return results


@pytest.mark.parametrize("window", [None, 40])
def test_paged_attention_batch_invariant_kernel(device, window):
    dtype = torch.bfloat16
    results = _positions_rows(paged_attention, dtype, device, sliding_window=window, batch_invariant=True)
    full = [r for r in results if r.shape[0] == S]
    _assert_all_equal(full)
    ref = _positions_rows(paged_attention_ref, dtype, "cpu", sliding_window=window)[0]
    torch.testing.assert_close(full[0].float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_paged_attention_default_config_differs_by_step_shape(device):
    """Why the mode pins the configuration: by default a decode step (max_query_len 1) and a prefill step use
    different tiles, so the last position's bits may depend on how it was scheduled. This checks only that the
    two configurations differ (the bits may coincide on a given input)."""
    from hayabusa.kernels.paged_attention import _tile_config, batch_invariant_tile_config

    assert _tile_config(1, 2, 16, 2) != _tile_config(64, 2, 16, 2)
    assert batch_invariant_tile_config(2, 16, 2) == batch_invariant_tile_config(2, 16, 2)


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 5.0)])
def test_paged_attention_bi_ref_invariant(window, softcap):
    dtype = torch.bfloat16
    results = _positions_rows(paged_attention_bi_ref, dtype, "cpu", sliding_window=window, softcap=softcap)
    full = results[0]
    for r in results:
        assert torch.equal(r, full[: r.shape[0]])
    ref = _positions_rows(paged_attention_ref, dtype, "cpu", sliding_window=window, softcap=softcap)[0]
    torch.testing.assert_close(full.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_cpu_attention_rows_identical_at_every_chunk_split():
    """The CPU reference of the mode: a prompt split into two chunks at every point gives each query row the bits
    of the unchunked run (grouped-query heads, G = 2; a fresh tester found row 25 of 27 differing in the last bit
    when rows of a chunk were computed together: torch's SIMD body and scalar tail round exp2 / sums apart)."""
    from hayabusa.kernels.batch_invariant import paged_attention_bi_ref

    torch.manual_seed(0)
    H, H_kv, D, bs = 8, 4, 8, 16
    kc, vc = torch.randn(8, bs, H_kv, D), torch.randn(8, bs, H_kv, D)
    q = torch.randn(31, H, D)
    bt = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)

    def run(qs, seq_len):
        out = torch.empty(len(qs), H, D)
        paged_attention_bi_ref(qs, kc, vc, out, torch.tensor([0, len(qs)]), torch.tensor([seq_len]), bt,
                               D ** -0.5, len(qs))
        return out

    full = run(q, 31)
    for cut in range(1, 31):
        assert torch.equal(torch.cat([run(q[:cut], cut), run(q[cut:], 31)]), full), cut


def test_bi_decode_tile_rule():
    """Which steps take the mode's small decode tile: decode-only steps with at least BI_DECODE_MIN_PROGRAMS_PER_SM
    programs per SM, heads of d_pad <= 64, GQA groups up to 16; everything else the one mode tile."""
    from hayabusa.kernels import paged_attention as pa

    sms, need = 132, 132 * pa.BI_DECODE_MIN_PROGRAMS_PER_SM
    mode = pa.batch_invariant_tile_config(7, 64, 2)
    assert (mode["BLOCK_M"], mode["num_warps"]) == (64, 4)
    small = pa.batch_invariant_tile_config(7, 64, 2, need, sms)
    assert (small["BLOCK_M"], small["BLOCK_Q"], small["num_warps"]) == (16, 2, 1)
    assert small["TILE_N"] == mode["TILE_N"]           # the key tiles (the online softmax's steps) stay
    assert pa.batch_invariant_tile_config(7, 64, 2, need - 1, sms) == mode
    for group, d_pad in ((7, 128), (8, 64), (32, 64), (7, 32)):   # not measured: the mode's tile
        assert pa.batch_invariant_tile_config(group, d_pad, 2, 10 * need, sms) == \
            pa.batch_invariant_tile_config(group, d_pad, 2)
    assert pa.batch_invariant_tile_config(7, 64, 2, 10 * need, 0) == mode   # no SM count (CPU): never
    assert pa.batch_invariant_tile_config(7, 64, 4, 10 * need, sms) == pa.batch_invariant_tile_config(7, 64, 4)  # fp32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the small tile is chosen on CUDA only)")
@pytest.mark.parametrize("heads", [(14, 2, 64), (8, 2, 64), (9, 3, 64), (16, 16, 64), (28, 4, 128)])
@pytest.mark.parametrize("dtype,kv_fp8", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)])
def test_bi_decode_tile_rows_equal_mixed_step_rows(heads, dtype, kv_fp8, monkeypatch):
    """The mode's large decode steps take a smaller tile (BI_DECODE_MIN_PROGRAMS_PER_SM); a decode row must keep
    the bits it gets when the same query runs in a step with a prefill (the mode's one tile): R requests of random
    contexts (1-1,500 keys) as a decode-only step, then the same R queries with one 20-token prompt after them.
    The tile paged_attention picked is recorded: the small one exactly where the rule says (64-dim heads, a model
    dtype cache); an fp8 cache (kv_cache_dtype="fp8", which the mode accepts) keeps the mode's tile."""
    from hayabusa.kernels import paged_attention as pa

    chosen = []
    rule = pa.batch_invariant_tile_config
    monkeypatch.setattr(pa, "batch_invariant_tile_config", lambda *a: chosen.append(rule(*a)) or chosen[-1])
    H, H_kv, D = heads
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    R = -(-sms * pa.BI_DECODE_MIN_PROGRAMS_PER_SM // H_kv) + 5
    gen = torch.Generator().manual_seed(H * D)
    seq_lens = torch.randint(1, 1500, (R,), generator=gen).tolist() + [20]
    need = [-(-s // BS) for s in seq_lens]
    table = torch.zeros(R + 1, max(need), dtype=torch.int32)
    perm = torch.randperm(sum(need), generator=gen).to(torch.int32)
    off = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[off:off + n]
        off += n
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    k_cache = torch.randn(sum(need), BS, H_kv, D, generator=gen).to(cache_dtype).cuda()
    v_cache = torch.randn(sum(need), BS, H_kv, D, generator=gen).to(cache_dtype).cuda()
    q = torch.randn(R + 20, H, D, generator=gen).to(dtype).cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    table = table.cuda()

    def run(num_seqs: int, max_query_len: int) -> torch.Tensor:
        q_lens = [1] * R + [20][: num_seqs - R]
        qsl = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
        out = torch.zeros(sum(q_lens), H, D, dtype=dtype, device="cuda")
        pa.paged_attention(q[: sum(q_lens)], k_cache, v_cache, out, qsl, lens[:num_seqs], table[:num_seqs],
                           D ** -0.5, max_query_len, batch_invariant=True)
        return out[:R]

    decode, mixed = run(R, 1), run(R + 1, 20)
    small = D == 64 and H // H_kv <= 7 and not kv_fp8
    assert [c["BLOCK_M"] for c in chosen] == [16 if small else 64, 64], chosen
    differ = (decode != mixed).flatten(1).any(1)
    assert not differ.any(), f"{int(differ.sum())} of {R} decode rows differ from the mixed step's ({chosen[0]})"
    ref = torch.empty_like(decode)
    pa.paged_attention_ref(q[:R], k_cache, v_cache, ref, torch.arange(R + 1, dtype=torch.int32, device="cuda"),
                           lens[:R], table[:R], D ** -0.5, 1)
    torch.testing.assert_close(decode.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
