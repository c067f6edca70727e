"""wo_small_m_linear (Triton; CUDA, or the interpreter on CPU) against quant_ref's int4 / int8 weight-only references:
the int4 kinds ("slab": 8 nibble slabs, 8 dots; "join": the tile rebuilt in k order; "lop3" / "lop3j": their
inline-PTX forms, whose PTX the interpreter cannot run: the same values made in Triton, and the PTX compiled for sm_90
here), HAYABUSA_WO_MID_M's routing, int8, 16- and 32-row
tiles, split-K (fused and two-launch reduction), ragged N and (int8) K, bias, bf16 and fp16; the launch table;
quant_linear's HAYABUSA_WO_SMALL_M routing; bad inputs. The 7B shapes on the GPU: test_wo_small_m_cuda.py."""

from __future__ import annotations

import os

import pytest
import torch

import hayabusa.kernels.pdl as pdl
import hayabusa.kernels.quant_linear as ql
from hayabusa.kernels.quant_linear import (
    LaunchConfig, int4_weight_only_linear_ref, int8_weight_only_linear_ref, quantize_int4_grouped,
    quantize_int8_per_channel,
)
from hayabusa.kernels.wo_small_m import (
    WO_M_BUCKETS, WO_MID_M_WINS, WO_SMALL_M_TABLE, check_wo_entry, pick_wo_small_m_config, wo_small_m_launch,
    wo_small_m_linear,
)

EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}   # 1 ulp at 1.0
INT4_CFGS = {
    "slab": LaunchConfig("slab", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1),
    "slab_split": LaunchConfig("slab", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=2),
    "join": LaunchConfig("join", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1),
    "join_split": LaunchConfig("join", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3),
    "lop3": LaunchConfig("lop3", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1),
    "lop3j": LaunchConfig("lop3j", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1),
    "lop3j_split": LaunchConfig("lop3j", BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=2),
}
INT8_CFGS = {
    "slab": LaunchConfig("slab", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1),
    "slab_split": LaunchConfig("slab", BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2),
    "dot": LaunchConfig("dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1),
    "dot_split": LaunchConfig("dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3),
}


def _w(N: int, K: int, dtype: torch.dtype, device: str, seed: int, M: int = 5, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _int4(N, K, G, dtype, device, seed, M=5, bias=True):
    x, w, b = _w(N, K, dtype, device, seed, M, bias)
    q, s, z = quantize_int4_grouped(w, G)
    return x, q.to(device), s.to(device), z.to(device), b


def _int8(N, K, dtype, device, seed, M=5, bias=True):
    x, w, b = _w(N, K, dtype, device, seed, M, bias)
    q, s = quantize_int8_per_channel(w)
    return x, q.to(device), s.to(device), b


def _assert_few_ulps(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 2 ulps of the output's largest value: fp32 sums in another order (the scale applied per tile), one
    rounding."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    scale = float(ref.float().abs().max())
    err = float((y.float() - ref.float()).abs().max())
    assert err <= 2 * EPS[y.dtype] * scale, f"max |kernel - ref| = {err:.3g}, output scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", list(INT4_CFGS))
@pytest.mark.parametrize("M", [1, 5, 16])
def test_int4_matches_reference(device, dtype, cfg, M):
    """N = 72 fits no N tile; K = 384 is three groups of 128 (slab: one tile each; split 2: a ragged last split)."""
    x, q, s, z, b = _int4(72, 384, 128, dtype, device, seed=M, M=M)
    _assert_few_ulps(wo_small_m_linear(x, q, s, z, 128, b, cfg=INT4_CFGS[cfg]),
                     int4_weight_only_linear_ref(x, q, s, z, 128, b))
    _assert_few_ulps(wo_small_m_linear(x, q, s, z, 128, None, cfg=INT4_CFGS[cfg]),
                     int4_weight_only_linear_ref(x, q, s, z, 128, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", list(INT8_CFGS))
@pytest.mark.parametrize("M", [1, 5, 16])
def test_int8_matches_reference(device, dtype, cfg, M):
    """N = 72 and K = 104 fit no tile: ragged N and K tiles (slab: ragged in whole int32 words); with split-K a
    ragged last split. K = 102 has no int32 words: a slab launch runs the byte tile."""
    x, q, s, b = _int8(72, 104, dtype, device, seed=M, M=M)
    _assert_few_ulps(wo_small_m_linear(x, q, s, None, None, b, cfg=INT8_CFGS[cfg]),
                     int8_weight_only_linear_ref(x, q, s, b))
    if cfg == "slab_split":
        x, q, s, b = _int8(72, 102, dtype, device, seed=M, M=M)
        _assert_few_ulps(wo_small_m_linear(x, q, s, None, None, b, cfg=INT8_CFGS[cfg]),
                         int8_weight_only_linear_ref(x, q, s, b))


@pytest.mark.parametrize("M", [17, 32, 64])
def test_32_and_64_row_tiles(device, M):
    """The table's 32- and 64-row launches (the bench's M = 32, 64) and more than one row tile (M = 17)."""
    x, q, s, z, b = _int4(40, 256, 128, torch.bfloat16, device, seed=7, M=M)
    for bm in (16, 32) if M < 64 else (64,):
        cfg = LaunchConfig("slab", BLOCK_M=bm, BLOCK_N=32, BLOCK_K=128, SPLIT_K=2)
        _assert_few_ulps(wo_small_m_linear(x, q, s, z, 128, b, cfg=cfg),
                         int4_weight_only_linear_ref(x, q, s, z, 128, b))
    x, q8, s8, b = _int8(40, 96, torch.float16, device, seed=8, M=M)
    cfg = LaunchConfig("dot", BLOCK_M=32 if M < 64 else 64, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2)
    _assert_few_ulps(wo_small_m_linear(x, q8, s8, None, None, b, cfg=cfg), int8_weight_only_linear_ref(x, q8, s8, b))


@pytest.mark.parametrize("G", [32, 64])
def test_int4_small_groups_take_join(device, G):
    """Groups under 128 cannot hold a slab tile (8 dots of K >= 16): the table's slab entry becomes a join launch
    with BLOCK_K = G, and the result matches the reference."""
    x, q, s, z, b = _int4(48, 256, G, torch.bfloat16, device, seed=G)
    cfg = pick_wo_small_m_config(5, 48, 256, G, torch.device(device))
    assert cfg.kind == "join" and cfg.BLOCK_K == G
    _assert_few_ulps(wo_small_m_linear(x, q, s, z, G, b), int4_weight_only_linear_ref(x, q, s, z, G, b))


def test_fused_split_reduce_equals_two_launch_reduce(device, monkeypatch):
    """The split-K partials summed by each tile's last program are splitk_reduce's sum, bit for bit; the counters
    are zero again afterwards."""
    import hayabusa.kernels.fp8_gemv as fg

    x, q, s, z, b = _int4(72, 384, 128, torch.bfloat16, device, seed=3, M=16)
    cfg = LaunchConfig("slab", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=3)
    fused = wo_small_m_linear(x, q, s, z, 128, b, cfg=cfg)
    monkeypatch.setattr(fg, "USE_FUSED_REDUCE", False)
    assert torch.equal(fused, wo_small_m_linear(x, q, s, z, 128, b, cfg=cfg))
    assert int(fg._LOCKS[torch.device(device)].abs().sum()) == 0


def test_strided_rows_and_empty(device):
    """x a column slice of a wider tensor (row stride > K), and M = 0."""
    x_wide, q, s, z, b = _int4(40, 256, 128, torch.float16, device, seed=5, M=6)
    x = torch.cat([x_wide, x_wide[:, :64]], dim=1)[:, :256]
    assert x.stride(0) == 320
    y = wo_small_m_linear(x, q, s, z, 128, b, cfg=INT4_CFGS["slab_split"])
    _assert_few_ulps(y, int4_weight_only_linear_ref(x, q, s, z, 128, b))
    empty = wo_small_m_linear(x[:0], q, s, z, 128)
    assert empty.shape == (0, 40) and empty.dtype == torch.float16


def test_table_entries_resolve():
    """Every WO_SMALL_M_TABLE entry is well formed; its launch for the 7B shapes has the bucket's row tile, int4
    BLOCK_K 128 (slab) at G = 128, and SPLIT_K resolved to >= 1."""
    cpu = torch.device("cpu")
    for (scheme, shape, bucket), entry in WO_SMALL_M_TABLE.items():
        check_wo_entry(scheme, entry)
        assert bucket in WO_M_BUCKETS and entry[1] == (min(max(bucket, 64), 128) if entry[0] == "lop3j"
                                                        else min(bucket, 128))   # the bench's row tiles
    for N, K in ((4608, 3584), (37888, 3584), (3584, 18944)):
        for M in (5, 16, 32, 64):
            c4 = pick_wo_small_m_config(M, N, K, 128, cpu)
            c8 = pick_wo_small_m_config(M, N, K, None, cpu)
            assert c4.BLOCK_K == 128 and c4.SPLIT_K >= 1 and c4.BLOCK_M >= min(M, 16)
            assert c8.SPLIT_K >= 1 and c8.BLOCK_K == 128
            if M <= 16:   # the measured launches of the engine's rows (BENCHMARKS.md, twenty-seventh session)
                assert c4.kind in ("slab", "lop3") and c4.BLOCK_N >= 128 and c4.num_warps == 8
                assert (c8.kind, c8.BLOCK_N, c8.num_warps, c8.num_stages) == ("dot", 32, 4, 4)
    assert wo_small_m_launch(("slab", 16, 64, 128, 0, 4, 4), 16, 64, 256, 8, cpu) is None  # G = 8: no 16-k tile
    assert wo_small_m_launch(("slab", 16, 64, 128, 0, 4, 4), 16, 64, 202, None, cpu).kind == "dot"  # no words
    for scheme, bad in (("int4", ("dot", 16, 64, 128, 1, 4, 3)), ("int8", ("join", 16, 64, 128, 1, 4, 3)),
                        ("int8", ("slab", 16, 64, 32, 1, 4, 3)),
                        ("int4", ("slab", 16, 64, 64, 1, 4, 3)), ("int8", ("dot", 16, 48, 128, 1, 4, 3)),
                        ("int8", ("dot", 16, 64, 128, -1, 4, 3))):
        with pytest.raises(ValueError, match="entry"):
            check_wo_entry(scheme, bad)


def _spy_routed_rows(monkeypatch) -> list[int]:
    """The row counts of every call quant_linear's dispatch makes to wo_small_m_linear from now on."""
    import hayabusa.kernels.wo_small_m as wsm

    calls: list[int] = []
    real = wsm.wo_small_m_linear

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(wsm, "wo_small_m_linear", spy)
    return calls


def test_quant_linear_routes_when_switched_on(device, monkeypatch):
    """quant_linear._kernel_linear sends 2-16 bf16 / fp16 rows to wo_small_m_linear only with USE_WO_SMALL_M (on by
    default); 1 row (GEMV), 17 rows, fp32 x and an int4 group of 8 keep the old paths; the routed result matches
    the reference."""
    import hayabusa.kernels.wo_small_m as wsm

    calls = _spy_routed_rows(monkeypatch)
    x, q, s, z, b = _int4(40, 256, 128, torch.bfloat16, device, seed=11, M=16)
    if "HAYABUSA_WO_SMALL_M" not in os.environ:   # unset: on for CUDA devices of compute capability 9.0+ only
        assert ql.USE_WO_SMALL_M is None and not ql.wo_small_m_enabled(torch.device("cpu"))
        monkeypatch.setattr(pdl, "_CAPABILITY", {0: (9, 0), 1: (8, 6)})   # two made-up GPUs
        assert ql.wo_small_m_enabled(torch.device("cuda", 0)) and not ql.wo_small_m_enabled(torch.device("cuda", 1))
        ql._kernel_linear(x[:5], q, s, z, b, 40, 128)                # CPU (interpreter): not routed by default
        assert calls == []
    monkeypatch.setattr(ql, "USE_WO_SMALL_M", False)
    ql._kernel_linear(x[:5], q, s, z, b, 40, 128)
    assert calls == []
    monkeypatch.setattr(ql, "USE_WO_SMALL_M", True)
    for M in (1, 2, 4, 16):
        y = ql._kernel_linear(x[:M], q, s, z, b, 40, 128)
        _assert_few_ulps(y, int4_weight_only_linear_ref(x[:M], q, s, z, 128, b))
    assert calls == [2, 4, 16]
    x8, q8, s8, b8 = _int8(40, 96, torch.float16, device, seed=12, M=17)
    y = ql._kernel_linear(x8[:8], q8, s8, None, b8, 40, None)
    _assert_few_ulps(y, int8_weight_only_linear_ref(x8[:8], q8, s8, b8))
    ql._kernel_linear(x8, q8, s8, None, b8, 40, None)                       # 17 rows: the GEMM
    ql._kernel_linear(x8[:8].float(), q8, s8.float(), None, None, 40, None)  # fp32 x
    x4, q4, s4, z4, _ = _int4(40, 64, 8, torch.bfloat16, device, seed=13, M=8)
    ql._kernel_linear(x4, q4, s4, z4, None, 40, 8)                           # G = 8: no dot tile
    assert calls == [2, 4, 16, 8]


def test_bad_inputs_raise_naming_the_argument(device):
    x, q, s, z, b = _int4(40, 256, 128, torch.bfloat16, device, seed=1)
    cases = [
        (dict(x=x.float()), "x must be"),
        (dict(x=x.t().contiguous().t()), "x must be"),
        (dict(qweight=q.to(torch.int8)), "qweight must be"),
        (dict(qweight=q[:16].contiguous()), "qweight must be"),
        (dict(scales=s.half()), "scales must be"),
        (dict(zeros=z[:1].contiguous()), "zeros must be"),
        (dict(bias=b[:8]), "bias must be"),
        (dict(group_size=48), "group_size"),
        (dict(cfg=LaunchConfig("dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128)), "cfg must be"),
        (dict(cfg=LaunchConfig("slab", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)), "cfg must be"),
    ]
    args = dict(x=x, qweight=q, scales=s, zeros=z, group_size=128, bias=b)
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            wo_small_m_linear(**{**args, **change})
    x8, q8, s8, b8 = _int8(40, 96, torch.bfloat16, device, seed=2)
    with pytest.raises(ValueError, match="qweight must be"):
        wo_small_m_linear(x8, q8[:, :64].contiguous(), s8)
    with pytest.raises(ValueError, match="scales must be"):
        wo_small_m_linear(x8, q8, s8[:8])
    with pytest.raises(ValueError, match="cfg must be"):
        wo_small_m_linear(x8, q8, s8, cfg=INT4_CFGS["join"])


def test_bench_candidates_and_table_literal(capsys):
    """bench_quant_linear.py --small-m, no GPU: every candidate launch is a valid entry with the M bucket's row tile,
    and on made-up timings the printed WO_SMALL_M_TABLE takes per (scheme, class, M bucket) the candidate with the
    least time summed over the class's rows (a row lacking one is charged its slowest), keeping the unswept keys."""
    import ast
    import runpy
    from pathlib import Path

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks/kernels/bench_quant_linear.py"),
                           run_name="bench_quant_linear")
    for scheme in ("int4", "int8"):
        for M, bm in ((1, 16), (8, 16), (16, 16), (32, 32), (64, 64), (100, 128), (256, 128)):
            cands = bench["small_m_candidates"](scheme, M)
            assert 6 <= len(cands) <= 13 and len(set(cands)) == len(cands)
            for e in cands:
                check_wo_entry(scheme, e)
                assert e[1] == (max(bm, 64) if e[0] == "lop3j" else bm)
    a, b = ("slab", 16, 64, 128, 1, 4, 3), ("join", 16, 64, 128, 1, 4, 3)

    def row(layer, M, cand_us):
        K, N = bench["LAYERS"][layer]
        best = min(cand_us, key=cand_us.get)
        return dict(kind="small_m", layer=layer, K=K, N=N, M=M, scheme="int4", bf16_us=70.0, today_us=100.0,
                    table_us=50.0, best=best, best_us=cand_us[best], best_pct_copy=90.0, cand_us=cand_us)

    rows = [row("qkv", 4, {repr(a): 10.0, repr(b): 30.0}),
            row("o", 16, {repr(a): 40.0, repr(b): 15.0}),        # square, bucket 16: a 50, b 45 -> b
            row("gate_up", 8, {repr(a): 30.0})]                   # wide: only a
    bench["print_small_m_table"](rows)
    out = capsys.readouterr().out
    literal = out[out.index("WO_SMALL_M_TABLE"):]
    table = ast.literal_eval(literal[literal.index("{"):literal.index("WO_MID_M_WINS")])
    assert table[("int4", "square", 16)] == b and table[("int4", "wide", 16)] == a
    assert {k: v for k, v in table.items() if k not in {("int4", "square", 16), ("int4", "wide", 16)}} == \
        {k: v for k, v in WO_SMALL_M_TABLE.items() if k not in {("int4", "square", 16), ("int4", "wide", 16)}}
    wins = out[out.index("WO_MID_M_WINS"):]
    assert set(ast.literal_eval(wins[wins.index("{"):wins.rindex("}") + 1])) == set(WO_MID_M_WINS)  # none swept

    # mid-M: a key is printed as a win where its best launch's summed time beats today's path's (rows' today_us)
    mid = [row("qkv", 32, {repr(a): 10.0}), row("o", 32, {repr(a): 95.0}),       # square 32: 105 < 200 -> win
           row("down", 64, {repr(a): 120.0}),                                    # deep 64: 120 > 100 -> not
           row("gate_up", 100, {repr(a): 99.0})]                                 # wide 128: 99 < 100 -> win
    bench["print_small_m_table"](mid)
    out = capsys.readouterr().out
    wins = out[out.index("WO_MID_M_WINS"):]
    got = set(ast.literal_eval(wins[wins.index("{"):wins.rindex("}") + 1]))
    swept = {("int4", "square", 32), ("int4", "deep", 64), ("int4", "wide", 128)}
    assert got - swept == set(WO_MID_M_WINS) - swept
    assert got & swept == {("int4", "square", 32), ("int4", "wide", 128)}


def test_lop3j_rounds_each_weight_as_dequantize_does(device):
    """"lop3j" dots round((q - zero) * scale) in x's dtype: its output is F.linear on dequantize_int4_to's weights
    (the dequantize + cuBLAS path) up to the fp32 summation order (half an ulp, one rounding, where the other kinds
    differ from it by the weights' rounding too); and with a K split."""
    from hayabusa.kernels.quant_linear import dequantize_int4_to

    for dtype in (torch.bfloat16, torch.float16):
        x, q, s, z, b = _int4(72, 384, 128, dtype, device, seed=21, M=32)
        want = torch.nn.functional.linear(x.float(), dequantize_int4_to(q, s, z, 128, dtype).float(), b.float())
        for cfg in (LaunchConfig("lop3j", BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1),
                    LaunchConfig("lop3j", BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=3)):
            y = wo_small_m_linear(x, q, s, z, 128, b, cfg=cfg)
            err = float((y.float() - want).abs().max()) / float(want.abs().max())
            assert err <= 0.5 * EPS[dtype] + 1e-6, (dtype, cfg, err)


@pytest.mark.parametrize("M", [17, 100, 256])
def test_mid_m_switch_routes_rows_past_16(device, monkeypatch, M):
    """HAYABUSA_WO_MID_M (USE_WO_MID_M) sends x of 17..WO_MID_M_MAX rows to wo_small_m_linear where (scheme, shape
    class, M bucket) is in WO_MID_M_WINS (int4: the table's "lop3j" launch; int8: its "dot" launch; both measured
    against the reference); at other keys, off (the default), and past WO_MID_M_MAX rows, quant_linear's path runs."""
    import hayabusa.kernels.wo_small_m as wsm

    calls = _spy_routed_rows(monkeypatch)
    monkeypatch.setattr(ql, "USE_WO_SMALL_M", True)
    x, q, s, z, b = _int4(40, 256, 128, torch.bfloat16, device, seed=M, M=M)
    assert not wsm.USE_WO_MID_M or "HAYABUSA_WO_MID_M" in os.environ    # off unless the variable says so
    monkeypatch.setattr(wsm, "USE_WO_MID_M", False)
    ql._kernel_linear(x, q, s, z, b, 40, 128)
    assert calls == []
    monkeypatch.setattr(wsm, "USE_WO_MID_M", True)
    key4 = ("int4", "deep", wsm.wo_m_bucket(M))                              # [256] -> [40]: a deep layer
    ql._kernel_linear(x, q, s, z, b, 40, 128)                                # the measured set decides
    assert calls == ([M] if key4 in wsm.WO_MID_M_WINS else []), (key4, calls)
    calls.clear()
    monkeypatch.setattr(wsm, "WO_MID_M_WINS", frozenset())
    ql._kernel_linear(x, q, s, z, b, 40, 128)
    assert calls == []
    monkeypatch.setattr(wsm, "WO_MID_M_WINS", frozenset({key4, ("int8", "square", wsm.wo_m_bucket(M))}))
    assert pick_wo_small_m_config(M, 40, 256, 128, torch.device(device)).kind == "lop3j"
    _assert_few_ulps(ql._kernel_linear(x, q, s, z, b, 40, 128), int4_weight_only_linear_ref(x, q, s, z, 128, b))
    assert calls == [M]
    x8, q8, s8, b8 = _int8(40, 96, torch.bfloat16, device, seed=M, M=M)
    _assert_few_ulps(ql._kernel_linear(x8, q8, s8, None, b8, 40, None), int8_weight_only_linear_ref(x8, q8, s8, b8))
    assert calls == [M, M]                                                    # int8 too (its "dot" launches)
    big = torch.cat([x] * (wsm.WO_MID_M_MAX // M + 1))[:wsm.WO_MID_M_MAX + 1]
    monkeypatch.setattr(ql, "DEQUANT_GEMM_MIN_M_INT4", 10 ** 6)               # keep the big case off cuBLAS's path
    ql._kernel_linear(big, q, s, z, b, 40, 128)
    assert calls == [M, M]


_COMPILE_LOP3_FOR_SM90 = """
import sys
sys.path.insert(0, sys.argv[4])
try:
    import triton.backends.nvidia  # noqa: F401
except ImportError:
    sys.exit(77)
from sass_wo_small_m import compile_launch
ptx = compile_launch(sys.argv[1], int(sys.argv[2]), 4, fp16=sys.argv[3] == "fp16").asm["ptx"]
print(ptx.count("lop3.b32"), ptx.count("prmt.b32"), ptx.count("fma.rn.bf16x2") + ptx.count("fma.rn.f16x2"),
      "wgmma.mma_async" in ptx)
"""


@pytest.mark.parametrize("kind,BM,dt", [("lop3", 16, "bf16"), ("lop3j", 64, "bf16"), ("lop3j", 64, "fp16")])
def test_lop3_kinds_compile_for_sm90(kind, BM, dt):
    """The inline PTX (which the interpreter cannot run) compiles for sm_90 with Triton's front end and bundled
    ptxas, no GPU needed (benchmarks/kernels/sass_wo_small_m.py's compile_launch): 8 LOP3s and 2 PRMTs per pair of
    words, a second packed FMA (the scale) only in "lop3j", and "lop3j" at 64 rows on warpgroup MMAs (one K = 128 dot
    per tile). Its values: test_lop3_ptx_computes_the_slabs here, and on the GPU test_wo_small_m_cuda.py."""
    import subprocess
    import sys

    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels")   # sass_wo_small_m.compile_launch
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_LOP3_FOR_SM90, kind, str(BM), dt, tools], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode == 77 or "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no CUDA compiler in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    lop3, prmt, fma, wgmma = (int(v) if v.isdigit() else v for v in r.stdout.split())
    assert lop3 >= 8 and lop3 % 8 == 0 and prmt >= 2 * (lop3 // 8)
    assert fma == lop3 * (2 if kind == "lop3j" else 1)           # the scale's FMA only in "lop3j"
    assert (wgmma == "True") == (kind == "lop3j")


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """Interpret _lop3_asm's PTX on 32-bit ints (mov / prmt / shr / lop3 / fma.rn.{bf16x2,f16x2}; the FMA in fp32 then
    rounded once to the half type, exact for its inputs here: float products of <= 11-bit significands)."""
    import re

    import numpy as np

    def halves(v: int, ty: str) -> list[float]:
        parts = [(v >> 16 * i) & 0xFFFF for i in (0, 1)]
        if ty == "bf16x2":
            return [float(np.array([p << 16], dtype=np.uint32).view(np.float32)[0]) for p in parts]
        return [float(np.array([p], dtype=np.uint16).view(np.float16)[0]) for p in parts]

    def pack(xs: list[float], ty: str) -> int:
        if ty == "bf16x2":
            bits = [int(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)) & 0xFFFF for x in xs]
        else:
            bits = [int(np.array([x], dtype=np.float16).view(np.uint16)[0]) for x in xs]
        return bits[0] | bits[1] << 16

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 16) if tok.startswith("0x") else regs[tok]

    for ins in filter(None, (i.strip() for i in asm.strip("{} ").split(";"))):
        if ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "prmt.b32":
            src = val(a[1]) | val(a[2]) << 32
            sel = val(a[3])
            regs[a[0]] = sum(((src >> 8 * ((sel >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "lop3.b32":
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), int(a[4], 16)
            regs[a[0]] = sum(((lut >> (((x >> i) & 1) << 2 | ((y >> i) & 1) << 1 | ((z >> i) & 1))) & 1) << i
                             for i in range(32))
        else:
            m = re.fullmatch(r"fma\.rn\.(bf16x2|f16x2)", op)
            assert m, op
            ty = m.group(1)
            x, y, z = (halves(val(t), ty) for t in a[1:4])
            regs[a[0]] = pack([x[i] * y[i] + z[i] for i in (0, 1)], ty)
    return regs


@pytest.mark.parametrize("fp16", [False, True], ids=["bf16", "fp16"])
def test_lop3_ptx_computes_the_slabs(fp16):
    """_lop3_asm's PTX, interpreted instruction by instruction on random packed words, zeros and scales: slab s of
    each word is q - zero (exact), and with the scale round((q - zero) * scale) in the half type, for both words of
    the pair: nibble order (PRMT selectors), LUT, magic numbers and the FMA forms, which the interpreter-run kernel
    tests never execute."""
    import numpy as np

    import hayabusa.kernels.wo_small_m as wo

    dt = torch.float16 if fp16 else torch.bfloat16
    base = 1024.0 if fp16 else 128.0
    asm = {False: (wo.LOP3_ASM_FP16 if fp16 else wo.LOP3_ASM_BF16).value,     # the strings the kernel compiles
           True: (wo.LOP3S_ASM_FP16 if fp16 else wo.LOP3S_ASM_BF16).value}
    rng = np.random.default_rng(0)

    def pair_bits(xs) -> int:
        b = torch.tensor(xs, dtype=dt).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        return int(b[0] | b[1] << 16)

    for _ in range(50):
        w = [int(v) for v in rng.integers(0, 2 ** 32, size=2)]
        z = [float(v) for v in rng.integers(0, 16, size=2)]
        sc = torch.tensor(rng.uniform(1e-3, 0.05, size=2), dtype=dt).float().tolist()
        regs = {"$8": w[0], "$9": w[1], "$10": pair_bits([-(base + z[0]), -(base + z[1])]), "$11": pair_bits(sc)}
        for scaled in (False, True):
            out = _run_ptx(asm[scaled], dict(regs))
            for s in range(8):
                got = torch.tensor([out[f"${s}"] & 0xFFFF, out[f"${s}"] >> 16], dtype=torch.int32).to(torch.int16)
                got = got.view(dt).float().tolist()
                q = [(w[j] >> 4 * s) & 0xF for j in (0, 1)]
                want = [q[j] - z[j] for j in (0, 1)]
                if scaled:
                    want = torch.tensor([want[j] * sc[j] for j in (0, 1)]).to(dt).float().tolist()
                assert got == want, (s, scaled, w, z, sc)
