"""small_m_linear (Triton; CUDA, or the interpreter on CPU) against its torch reference on every launch path (16-row
tl.dot tiles with and without split-K, the fused split-K reduction and the two-launch one, ragged N and K, a
padded weight, strided rows, bias), the table and its JSON, F.linear's drop-in (linear_small_m) and the loader's
switch; the fused gate_up + SiLU-and-mul kernel against the two launches it replaces. The 7B shapes on the GPU:
test_small_m_linear_cuda.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hayabusa.kernels.fp8_gemv import FP8_M_BUCKETS, check_fp8_entry, load_launch_tables
from hayabusa.kernels.quant_linear import LaunchConfig, gemm_shape_class
from hayabusa.kernels.small_m_linear import (
    FUSED_SILU_MIN_BLOCK_N, SMALL_M_MAX, SMALL_M_SHAPES, SMALL_M_TABLE, linear_small_m, pick_small_m_config,
    silu_and_mul_small_m, small_m_linear, small_m_linear_ref, small_m_silu_config, small_m_silu_linear,
    small_m_silu_linear_ref,
)

CONFIGS = {
    "dot": LaunchConfig("dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2),
    "dot_split": LaunchConfig("dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2),
    "dot_wide_k": LaunchConfig("dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3),
}
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}   # 1 ulp at 1.0


def _operands(M: int, N: int, K: int, dtype: torch.dtype, device: str, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _assert_few_ulps(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 2 ulps of the output's largest value: the fp32 sums in another order, then one rounding (the
    interpreter's bf16 cast truncates: 1 ulp of that)."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    scale = float(ref.float().abs().max())
    err = float((y.float() - ref.float()).abs().max())
    assert err <= 2 * EPS[y.dtype] * scale, f"max |kernel - ref| = {err:.3g}, output scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("M", [1, 5, 16])
def test_matches_reference(device, dtype, cfg, M):
    """N = 72 and K = 104 fit no tile: ragged N and K tiles; with split-K a ragged last split."""
    x, w, b = _operands(M, 72, 104, dtype, device, seed=M)
    _assert_few_ulps(small_m_linear(x, w, b, cfg=CONFIGS[cfg]), small_m_linear_ref(x, w, b))
    _assert_few_ulps(small_m_linear(x, w, None, cfg=CONFIGS[cfg]), small_m_linear_ref(x, w, None))


@pytest.mark.parametrize("M", [1, 16])
def test_fused_split_reduce_equals_two_launch_reduce(device, monkeypatch, M):
    """The split-K partials summed by each tile's last program are splitk_reduce's sum, bit for bit (the same
    order), with a bias; the counters are zero again afterwards (a CUDA-graph replay needs them so)."""
    import hayabusa.kernels.fp8_gemv as fg

    x, w, b = _operands(M, 72, 200, torch.bfloat16, device, seed=3)
    fused = small_m_linear(x, w, b, cfg=CONFIGS["dot_split"])
    monkeypatch.setattr(fg, "USE_FUSED_REDUCE", False)
    assert torch.equal(fused, small_m_linear(x, w, b, cfg=CONFIGS["dot_split"]))
    assert int(fg._LOCKS[torch.device(device)].abs().sum()) == 0


def test_padded_weight_strided_rows_and_out_features(device):
    """A weight with more rows and columns than used (out_features, K < K'), x a column slice of a wider tensor
    (row stride > K), and M = 0."""
    x_wide, w, b = _operands(3, 80, 120, torch.bfloat16, device, seed=5)
    x = x_wide[:, :100]
    assert x.stride(0) == 120
    y = small_m_linear(x, w, b[:64].contiguous(), out_features=64, cfg=CONFIGS["dot_split"])
    _assert_few_ulps(y, small_m_linear_ref(x, w, b[:64], out_features=64))
    assert small_m_linear(x[:0], w).shape == (0, 80)


def test_default_launches_from_the_table(device):
    """Every SMALL_M_TABLE entry is a valid 'dot' launch; pick_small_m_config keys it by shape class and M bucket;
    the default launch of every (class, bucket) matches the reference on a small shape of that class."""
    assert {b for _, b in SMALL_M_TABLE} == set(FP8_M_BUCKETS) and SMALL_M_MAX == FP8_M_BUCKETS[-1]
    for entry in SMALL_M_TABLE.values():
        check_fp8_entry(entry)
        assert entry[0] == "dot"
    cfg = pick_small_m_config(1, 40000, 3584, torch.device("cpu"))
    assert (cfg.kind, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) == SMALL_M_TABLE[("wide", 1)][:4]
    # a layer shape the sweep timed takes its own launch, at every M of its bucket
    assert {(N, K) for N, K, _ in SMALL_M_SHAPES} >= {(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)}
    for (N, K, bucket), entry in SMALL_M_SHAPES.items():
        check_fp8_entry(entry)
        assert entry[0] == "dot" and bucket in FP8_M_BUCKETS
    own = SMALL_M_SHAPES[(4608, 3584, 16)]
    assert own != SMALL_M_TABLE[("square", 16)]
    for M in (5, 16):
        cfg = pick_small_m_config(M, 4608, 3584, torch.device("cpu"))
        assert (cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, cfg.num_stages) == own[2:]
    for M in FP8_M_BUCKETS:
        for N, K, cls in ((200, 48, "wide"), (72, 104, "square"), (24, 112, "deep")):
            assert gemm_shape_class(N, K) == cls
            x, w, b = _operands(M, N, K, torch.bfloat16, device, seed=M)
            _assert_few_ulps(small_m_linear(x, w, b), small_m_linear_ref(x, w, b))


@pytest.mark.parametrize("call,match", [
    (lambda x, w: small_m_linear(x.float(), w), "x must be .* bfloat16 or float16"),
    (lambda x, w: small_m_linear(x, w.half()), "weight must be .* torch.bfloat16"),
    (lambda x, w: small_m_linear(x.t(), w), "x must be"),
    (lambda x, w: small_m_linear(x, w[:, :8]), "weight has 8 columns, fewer than x's K = 16"),
    (lambda x, w: small_m_linear(x, w, out_features=40), "out_features must be an int in 1..32"),
    (lambda x, w: small_m_linear(x, w, torch.zeros(31, dtype=torch.bfloat16)), "bias must be \\[N=32\\]"),
    (lambda x, w: small_m_linear(x, w, cfg=LaunchConfig("gemv", BLOCK_N=32, BLOCK_K=32)), "cfg must be a 'dot'"),
])
def test_bad_arguments_are_refused_by_name(call, match):
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    w = torch.zeros(32, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        call(x, w)


def test_linear_small_m_is_f_linear_beyond_its_rows(device):
    """The drop-in: 1-16 rows (any leading shape) take the kernel, its bits exactly; 17 rows and fp32 take
    F.linear, its bits exactly."""
    x, w, b = _operands(16, 72, 104, torch.bfloat16, device, seed=9)
    y = linear_small_m(x.view(2, 8, 104), w, b)
    assert y.shape == (2, 8, 72) and torch.equal(y.view(16, 72), small_m_linear(x, w, b))
    x17, _, _ = _operands(17, 72, 104, torch.bfloat16, device, seed=10)
    assert torch.equal(linear_small_m(x17, w, b), F.linear(x17, w, b))
    assert torch.equal(linear_small_m(x.float(), w.float(), b.float()), F.linear(x.float(), w.float(), b.float()))


def test_linear_small_m_takes_what_f_linear_takes(device):
    """The drop-in refuses what F.linear refuses and takes what it takes: a weight of another K is an error (not
    its first K columns), a bias that is a strided view, an expanded scalar or a [1] broadcast is added as F.linear
    adds it, and a weight of no rows gives [M, 0]."""
    x, w, b = _operands(3, 24, 48, torch.bfloat16, device, seed=11)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        F.linear(x[:, :40], w, b)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        linear_small_m(x[:, :40], w, b)
    strided = torch.stack([b, -b], dim=1)[:, 0]
    assert not strided.is_contiguous()
    for bias in (strided, torch.tensor(0.5, dtype=torch.bfloat16, device=device).expand(24), b[:1]):
        want = F.linear(x, w, bias)
        got = linear_small_m(x, w, bias)
        _assert_few_ulps(got, want)
        assert torch.equal(got, small_m_linear(x, w, bias.expand(24).contiguous()))
    assert linear_small_m(x, w[:0]).shape == (3, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K", [96, 104])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_fused_silu_equals_the_two_launches(device, dtype, K, M):
    """small_m_silu_linear (gate_up + SiLU-and-mul in one launch) gives the bits of small_m_linear with the gate_up
    launch whose BLOCK_K it shares, then activation.silu_and_mul: D = 40 fits no 16-column tile, K = 104 no 32-wide
    K tile (ragged tiles); and it is close to the torch reference."""
    from hayabusa.kernels.activation import silu_and_mul

    x, w, _ = _operands(M, 80, K, dtype, device, seed=M + K)
    two = LaunchConfig("dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
    one = LaunchConfig("dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
    h = small_m_linear(x, w, cfg=two)
    ref2 = silu_and_mul(h) if device == "cuda" else torch.nn.functional.silu(h[:, :40]) * h[:, 40:]
    y = small_m_silu_linear(x, w, cfg=one)
    assert y.shape == (M, 40) and y.dtype == dtype
    assert torch.equal(y, ref2), float((y.float() - ref2.float()).abs().max())
    _assert_few_ulps(y, small_m_silu_linear_ref(x, w))


def test_fused_silu_launch_and_refusals(device):
    """small_m_silu_config: the gate_up layer's own launch with BLOCK_N halved, None where that launch splits K or
    past SMALL_M_MAX rows; silu_and_mul_small_m (the Linear method's hook) answers None wherever the two launches
    must run (a bias, too many rows, fp32, a K split), and small_m_silu_linear refuses bad arguments by name."""
    cpu = torch.device("cpu")
    for M in (1, 4, 16):
        gate_up = pick_small_m_config(M, 37888, 3584, cpu)
        fused = small_m_silu_config(M, 18944, 3584, cpu)
        assert gate_up.SPLIT_K == 1
        if gate_up.BLOCK_N < FUSED_SILU_MIN_BLOCK_N:   # 7b's M=4 launch (32 wide): the fused one measured slower
            assert M == 4 and fused is None
            continue
        assert (fused.BLOCK_N, fused.BLOCK_K, fused.num_warps, fused.num_stages) == \
            (gate_up.BLOCK_N // 2, gate_up.BLOCK_K, gate_up.num_warps, gate_up.num_stages)
    assert small_m_silu_config(17, 18944, 3584, cpu) is None
    assert small_m_silu_config(1, 3584, 18944, cpu) is None          # a "deep" launch: 8 K splits
    x, w, b = _operands(3, 400, 96, torch.bfloat16, device)        # 400 >= 4 x 96: a "wide" launch, no split
    y = silu_and_mul_small_m(x, w, None)
    assert y is not None and torch.equal(y, small_m_silu_linear(x, w))
    assert silu_and_mul_small_m(x.view(1, 3, 96), w, None).shape == (1, 3, 200)
    assert silu_and_mul_small_m(x, w, b) is None
    assert silu_and_mul_small_m(x.float(), w.float(), None) is None
    assert silu_and_mul_small_m(torch.cat([x] * 6), w, None) is None    # 18 rows
    assert silu_and_mul_small_m(x, w[:80].contiguous(), None) is None   # 80 x 96: a "square" launch, 8 K splits
    for call, match in ((lambda: small_m_silu_linear(x, w[:79]), "even number of rows"),
                        (lambda: small_m_silu_linear(x, w[:, :64].contiguous()), "fewer than x's K|x has K"),
                        (lambda: small_m_silu_linear(x, w, cfg=CONFIGS["dot_split"]), "SPLIT_K 1")):
        with pytest.raises(ValueError, match=match):
            call()
    assert small_m_silu_linear(x[:0], w).shape == (0, 200)
    # no default launch: 17 rows, or a "square" gate_up whose launch splits K; the error says so, naming cfg
    for xx, ww in ((torch.cat([x] * 6), w), (x, w[:80].contiguous())):
        with pytest.raises(ValueError, match=r"cfg: no fused launch for x \[\d+, 96\] and D = \d+ \(more than"):
            small_m_silu_linear(xx, ww)


def test_table_json_loads_dot_launches_only(tmp_path, monkeypatch):
    """The sweep's JSON (bench_small_m_linear.py --sweep --table-json) replaces the named entries; a 'gemv' launch
    (the kernel has only the tl.dot form), an unknown table and a bad file are refused naming the file, the table
    unchanged; named by the environment variable, the error names the variable."""
    import hayabusa.kernels.small_m_linear as sm
    from hayabusa.errors import HayabusaValidationError

    table = dict(SMALL_M_TABLE)
    monkeypatch.setattr(sm, "SMALL_M_TABLE", table)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"SMALL_M_TABLE": [["square", 4, ["dot", 16, 128, 64, 2, 8, 4]]]}))
    assert load_launch_tables(str(path), {"SMALL_M_TABLE": table}, dot_only=("SMALL_M_TABLE",)) == {"SMALL_M_TABLE": 1}
    assert table[("square", 4)] == ("dot", 16, 128, 64, 2, 8, 4)
    cfg = sm.pick_small_m_config(4, 4000, 3584, torch.device("cpu"))      # a shape SMALL_M_SHAPES lacks
    assert (cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, cfg.num_stages) == (128, 64, 2, 8, 4)
    before = dict(table)
    for data, match in (({"SMALL_M_TABLE": [["deep", 1, ["gemv", 1, 32, 512, 4, 8, 1]]]}, "'dot' launches only"),
                        ({"FP8_TABLE": []}, "unknown key"),
                        ({"SMALL_M_TABLE": [["deep", 1, ["dot", 16, 48, 64, 1, 4, 3]]]}, "power-of-two")):
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match) as info:
            load_launch_tables(str(path), {"SMALL_M_TABLE": table}, dot_only=("SMALL_M_TABLE",))
        assert "t.json" in str(info.value) and table == before
    # the per-layer table: rows [N, K, bucket, entry]; a class key, a bucket not in FP8_M_BUCKETS or N < 1 refused
    shapes = {}
    monkeypatch.setattr(sm, "SMALL_M_SHAPES", shapes)
    both = {"SMALL_M_TABLE": table, "SMALL_M_SHAPES": shapes}
    path.write_text(json.dumps({"SMALL_M_SHAPES": [[4608, 3584, 4, ["dot", 16, 32, 64, 4, 4, 3]]]}))
    assert load_launch_tables(str(path), both, dot_only=tuple(both), shape_keyed=("SMALL_M_SHAPES",)) == \
        {"SMALL_M_TABLE": 0, "SMALL_M_SHAPES": 1}
    cfg = sm.pick_small_m_config(3, 4608, 3584, torch.device("cpu"))
    assert (cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K) == (32, 64, 4) and table == before
    for row, match in (([["square", 4, ["dot", 16, 32, 64, 4, 4, 3]]], "positive ints N, K"),
                       ([[4608, 3584, 8, ["dot", 16, 32, 64, 4, 4, 3]]], "a bucket of"),
                       ([[0, 3584, 4, ["dot", 16, 32, 64, 4, 4, 3]]], "positive ints"),
                       ([[4608, 3584, 4, ["gemv", 1, 32, 512, 4, 8, 1]]], "'dot' launches only")):
        path.write_text(json.dumps({"SMALL_M_SHAPES": row}))
        with pytest.raises(ValueError, match=match):
            load_launch_tables(str(path), both, dot_only=tuple(both), shape_keyed=("SMALL_M_SHAPES",))
        assert shapes == {(4608, 3584, 4): ("dot", 16, 32, 64, 4, 4, 3)}
    with pytest.raises(HayabusaValidationError, match="environment variable HAYABUSA_SMALL_M_TABLE_JSON: .*missing"):
        load_launch_tables(str(tmp_path / "missing.json"), {"SMALL_M_TABLE": table},
                           env="HAYABUSA_SMALL_M_TABLE_JSON", dot_only=("SMALL_M_TABLE",))


def test_switch_defaults_to_hopper_and_refuses_garbage(monkeypatch):
    """Unset: on for a CUDA device of compute capability 9.0+ only (where the tables were measured), off on CPU,
    on an Ampere / Ada GPU and with no device; set: its value on any device; garbage refused by name."""
    from hayabusa.errors import HayabusaValidationError
    from hayabusa.kernels.small_m_linear import small_m_enabled

    from hayabusa.kernels import pdl

    monkeypatch.setattr(pdl, "_CAPABILITY", {0: (9, 0), 1: (8, 9)})   # two made-up GPUs, kept from other tests
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("HAYABUSA_SMALL_M_LINEAR", raising=False)
    assert small_m_enabled() is False and small_m_enabled(torch.device("cpu")) is False
    assert small_m_enabled(torch.device("cuda", 0)) is True
    assert small_m_enabled(torch.device("cuda", 1)) is False and small_m_enabled(torch.device("cuda")) is False
    monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", "0")
    assert small_m_enabled(torch.device("cuda", 0)) is False
    monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", "1")
    assert small_m_enabled() is True and small_m_enabled(torch.device("cuda", 1)) is True
    monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", "fast")
    with pytest.raises(HayabusaValidationError, match="HAYABUSA_SMALL_M_LINEAR='fast'"):
        small_m_enabled()


def test_switch_garbage_is_refused_where_the_switch_does_nothing(stories_dir, monkeypatch):
    """The loader reads HAYABUSA_SMALL_M_LINEAR before deciding whether it applies: on the CPU engine in float32
    (where 0 and 1 change nothing) a value that is not a switch is still refused, naming it; 1 loads as 0 does."""
    from hayabusa import LLM
    from hayabusa.errors import HayabusaValidationError
    from hayabusa.model.layers.linear import Linear
    from hayabusa.quantization.base import UnquantizedLinearMethod

    monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", "fast")
    with pytest.raises(HayabusaValidationError, match="HAYABUSA_SMALL_M_LINEAR='fast'"):
        LLM(stories_dir, device="cpu", dtype="float32")
    monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", "1")
    model = LLM(stories_dir, device="cpu", dtype="float32").llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(type(m.quant_method) is UnquantizedLinearMethod for m in linears)
    assert model.logits_linear is not linear_small_m


def test_engine_greedy_with_the_kernel_in_every_linear(stories_dir):
    """use_small_m_linears (what HAYABUSA_SMALL_M_LINEAR=1 does on a CUDA GPU) on the trained stories260K in bf16,
    here on the CPU engine through the interpreter: every Linear takes SmallMLinearMethod and the lm_head
    linear_small_m, decode steps (1-4 rows) run the kernel, prefill (more rows) F.linear; the greedy ids of 4
    prompts x 24 tokens equal the default path's (the products are the same, the fp32 sums in another order)."""
    from hayabusa import LLM, SamplingParams
    from hayabusa.model.layers.linear import Linear
    from hayabusa.model.loader import use_small_m_linears
    from hayabusa.quantization.base import SmallMLinearMethod

    prompts = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(stories_dir, device="cpu", dtype="bfloat16", max_num_seqs=4, enable_prefix_caching=False)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    model = llm.llm_engine.runner.model
    use_small_m_linears(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(type(m.quant_method) is SmallMLinearMethod for m in linears)
    assert model.logits_linear is linear_small_m
    import hayabusa.kernels.small_m_linear as sm

    calls = []
    real = sm.small_m_silu_linear

    def counting(x, w, cfg=None):
        calls.append(x.shape[0])
        return real(x, w, cfg)

    sm.small_m_silu_linear = counting
    try:
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        sm.small_m_silu_linear = real
    assert after == before and all(len(t) == 24 for t in after)
    # every decode step's MLPs took the fused gate_up + SiLU-and-mul launch (prefill's rows: the two steps)
    n_mlp = sum(type(m).__name__ == "LlamaMLP" for m in model.modules())
    assert n_mlp and calls and max(calls) <= 4 and len(calls) >= 23 * n_mlp


def test_sweep_table_reaches_the_engine_through_the_json(tmp_path, monkeypatch, capsys):
    """bench_small_m_linear's --sweep summary: per (shape class, M bucket) the launch with the least time summed
    over the class's layers, and each layer's own fastest, printed and written with --table-json;
    load_small_m_tables (what HAYABUSA_SMALL_M_TABLE_JSON does at import) then picks exactly them. The candidates
    are 'dot' launches with K splits putting 1-12 programs on each of 132 SMs."""
    import importlib.util
    from pathlib import Path

    import hayabusa.kernels.small_m_linear as sm

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_small_m_linear.py"
    spec = importlib.util.spec_from_file_location("bench_small_m_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cands = bench.sweep_configs(1, 4608, 3584, 132)
    assert cands and all(c.kind == "dot" and c.BLOCK_M == 16 for c in cands)
    assert all(132 <= -(-4608 // c.BLOCK_N) * c.SPLIT_K <= 12 * 132 for c in cands)
    a, b = ("dot", 16, 64, 64, 8, 4, 3), ("dot", 16, 128, 64, 4, 8, 3)

    def row(layer, K, N, times):
        return dict(shape="7b", layer=layer, K=K, N=N, M=1, copy_gb_s=4000.0, bytes=N * K * 2, config=a,
                    cublas_us=10.0, small_m_us=9.0, sweep_us={repr(a): times[0], repr(b): times[1]})

    # qkv and o are one class ("square"): b wins the sum (4 + 4 < 3 + 6) though a is best on qkv alone; a third
    # launch c only the o layer timed (qkv's sweep left it out) is charged qkv's slowest time (4): 4 + 4.5 > 8
    c = ("dot", 16, 32, 64, 16, 4, 3)
    out = tmp_path / "table.json"
    rows = [row("qkv", 3584, 4608, (3.0, 4.0)), row("o", 3584, 3584, (6.0, 4.0))]
    rows[1]["sweep_us"][repr(c)] = 4.5
    assert bench.class_cost(rows, repr(c)) == 8.5 and bench.class_cost(rows, repr(b)) == 8.0
    bench.print_table(rows, str(out))
    printed = capsys.readouterr().out
    assert f"('square', 1): {b!r}" in printed and f"(4608, 3584, 1): {a!r}" in printed
    table, shapes = dict(SMALL_M_TABLE), {}
    monkeypatch.setattr(sm, "SMALL_M_TABLE", table)
    monkeypatch.setattr(sm, "SMALL_M_SHAPES", shapes)
    assert sm.load_small_m_tables(str(out)) == {"SMALL_M_TABLE": 1, "SMALL_M_SHAPES": 2}
    assert table[("square", 1)] == b and shapes == {(4608, 3584, 1): a, (3584, 3584, 1): b}
    # each timed layer takes its own fastest launch; another square layer the class's
    assert sm.pick_small_m_config(1, 4608, 3584, torch.device("cpu")).BLOCK_N == 64
    assert sm.pick_small_m_config(1, 3584, 3584, torch.device("cpu")).BLOCK_N == 128
    assert sm.pick_small_m_config(1, 3000, 3584, torch.device("cpu")).BLOCK_N == 128



def test_sweep_per_layer_table_sums_the_rows_of_one_bucket(tmp_path, monkeypatch, capsys):
    """SMALL_M_SHAPES from a sweep with two row counts in one M bucket (--m 2,4: both bucket 4): the layer's launch
    is the one with the least time summed over both rows (as the class table sums its layers), written once, not
    the last row's own fastest."""
    import importlib.util
    from pathlib import Path

    import hayabusa.kernels.small_m_linear as sm

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_small_m_linear.py"
    spec = importlib.util.spec_from_file_location("bench_small_m_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a, b = ("dot", 16, 64, 64, 8, 4, 3), ("dot", 16, 128, 64, 4, 8, 3)

    def row(M, ta, tb):
        return dict(shape="7b", layer="qkv", K=3584, N=4608, M=M, copy_gb_s=4000.0, bytes=4608 * 3584 * 2,
                    config=a, cublas_us=10.0, small_m_us=9.0, sweep_us={repr(a): ta, repr(b): tb})

    out = tmp_path / "table.json"
    bench.print_table([row(2, 3.0, 5.0), row(4, 4.1, 4.0)], str(out))      # a: 7.1 us in all, b: 9.0
    printed = capsys.readouterr().out
    assert printed.count("(4608, 3584, 4): ") == 1 and f"(4608, 3584, 4): {a!r}" in printed
    shapes = {}
    monkeypatch.setattr(sm, "SMALL_M_TABLE", dict(SMALL_M_TABLE))
    monkeypatch.setattr(sm, "SMALL_M_SHAPES", shapes)
    assert sm.load_small_m_tables(str(out)) == {"SMALL_M_TABLE": 1, "SMALL_M_SHAPES": 1}
    assert shapes == {(4608, 3584, 4): a}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "mlp_bias"])
def test_llama_mlp_fused_path_on_tensor_parallel_shards(monkeypatch, bias):
    """LlamaMLP with SmallMLinearMethod: each tensor-parallel rank's gate_up shard ([gate rows | up rows] of its
    slice, tensor_parallel._shard_mlp) gives, through the fused launch, exactly its columns of the whole MLP's
    activation; a gate_up with a bias (mlp_bias) never takes the fused launch and matches the two steps; more than
    16 rows take the two steps."""
    import copy
    from types import SimpleNamespace

    import hayabusa.kernels.small_m_linear as sm
    from hayabusa.model.layers.activation import silu_and_mul
    from hayabusa.model.layers.tensor_parallel import _shard_mlp
    from hayabusa.model.llama import LlamaMLP
    from hayabusa.quantization.base import SmallMLinearMethod

    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=256, hidden_act="silu")
    mlp = LlamaMLP(cfg, bias, torch.bfloat16, torch.device("cpu"))
    for p in mlp.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32) / 8)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.quant_method = SmallMLinearMethod()
    calls, acts = [], []
    real = sm.small_m_silu_linear
    monkeypatch.setattr(sm, "small_m_silu_linear", lambda x, w, cfg=None: calls.append(x.shape[0]) or real(x, w, cfg))

    def run(m, x):
        h = m.down_proj.register_forward_pre_hook(lambda mod, args: acts.append(args[0]))
        try:
            return m(x)
        finally:
            h.remove()

    x = (torch.randn(5, 64) * 2).to(torch.bfloat16)
    y = run(mlp, x)
    two = silu_and_mul(mlp.gate_up_proj(x))
    assert torch.equal(acts[-1], two) and calls == ([] if bias else [5])
    assert torch.equal(y, mlp.down_proj(two))
    whole = acts[-1]
    for rank in range(2):
        shard = copy.deepcopy(mlp)
        _shard_mlp(shard.gate_up_proj, shard.down_proj, rank, 2, gated=True)
        assert shard.gate_up_proj.weight.shape == (256, 64)
        run(shard, x)
        assert torch.equal(acts[-1], whole[:, rank * 128:(rank + 1) * 128])
    assert calls == ([] if bias else [5, 5, 5])
    x17 = torch.cat([x] * 4)[:17]
    assert torch.equal(run(mlp, x17), mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x17)))) and len(calls) in (0, 3)

def test_switch_reaches_every_lm_head():
    """Every registered architecture's lm_head goes through ``logits_linear`` (what the switch and batch-invariant
    mode replace): Qwen2-VL's and T5's compute_logits too, called on stand-ins for the model."""
    from types import SimpleNamespace

    from hayabusa.model.registry import get_model_class, supported_architectures

    for arch in supported_architectures():
        assert hasattr(get_model_class(arch), "logits_linear"), arch
    seen = []

    def fake_linear(h, w):
        seen.append((h, w))
        return h @ w.t()

    w = torch.randn(10, 4)
    h = torch.randn(2, 4)
    vl = SimpleNamespace(lm_head=None, model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=w)),
                         logits_linear=fake_linear)
    assert torch.equal(get_model_class("Qwen2VLForConditionalGeneration").compute_logits(vl, h), h @ w.t())
    t5 = SimpleNamespace(scale_decoder_outputs=True, config=SimpleNamespace(d_model=4), has_lm_head=True, lm_head=w,
                         logits_linear=fake_linear)
    assert torch.equal(get_model_class("T5ForConditionalGeneration").compute_logits(t5, h), (h * 0.5) @ w.t())
    assert len(seen) == 2 and seen[0][1] is w and seen[1][1] is w


@pytest.mark.parametrize("tp_path", [False, True], ids=["build_model", "build_sharded_model"])
def test_switch_reaches_models_built_on_the_host(stories_dir, monkeypatch, tp_path):
    """Tensor- and pipeline-parallel workers build the model on the host and move their shard to the GPU
    (build_sharded_model): the switch still applies there, on the device the shard lands on. Here "meta" (the shard)
    and "cpu" (build_model) stand in for CUDA. Not in fp32, not in batch-invariant mode, not with the switch off."""
    import dataclasses

    from hayabusa.config import EngineArgs
    from hayabusa.model import loader
    from hayabusa.model.layers.linear import Linear
    from hayabusa.model.layers.tensor_parallel import build_sharded_model
    from hayabusa.quantization.base import SmallMLinearMethod

    device = torch.device("meta" if tp_path else "cpu")   # the shard moves to meta from the host's CPU build
    monkeypatch.setattr(loader, "SMALL_M_DEVICE_TYPES", (device.type,))

    def build(dtype, switch="1", bi=False):
        monkeypatch.setenv("HAYABUSA_SMALL_M_LINEAR", switch)
        mc = EngineArgs(model=stories_dir, device="cpu", dtype=dtype).create_engine_config().model_config
        mc = dataclasses.replace(mc, batch_invariant=bi)
        model = build_sharded_model(mc, device, 0, 1) if tp_path else loader.build_model(mc, device)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears
        on = [type(m.quant_method) is SmallMLinearMethod for m in linears]
        assert all(on) or not any(on)
        assert all(on) == (model.logits_linear is linear_small_m)
        return all(on)

    assert build("bfloat16") and build("float16")
    assert not build("float32") and not build("bfloat16", switch="0") and not build("bfloat16", bi=True)



_COMPILE_FOR_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import hayabusa.kernels.small_m_linear as sm
D = int(sys.argv[1])
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": "constexpr", "D": "i32", "K": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "EVEN_K": "constexpr", "DOT_FP32": "constexpr",
       "BF16_BY_HAND": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
       "PDL": "constexpr"}
consts = {"M": 1, "EVEN_K": True, "DOT_FP32": False, "BF16_BY_HAND": False, "BLOCK_M": 16, "BLOCK_N": 16,
          "BLOCK_K": 64, "PDL": False}
if D == 1:
    sig.update(D="constexpr", stride_om="constexpr")
    consts.update(D=1, stride_om=1)
src = ASTSource(sm._small_m_silu_dot_kernel, sig, consts)
try:
    import triton.backends.nvidia  # noqa: F401
except ImportError:
    sys.exit(77)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
print("mma.sync.aligned.m16n8k16" in k.asm["ptx"])
"""


@pytest.mark.parametrize("D", [1, 40])
def test_fused_silu_kernel_compiles_for_the_gpu_with_any_d(D):
    """On a GPU, Triton passes an int argument equal to 1 as a constexpr (a Python int): the fused kernel's
    up-half offset must not call a tensor method on D, or a gate_up of 2 rows (D = 1) fails to compile there while
    the interpreter (which does not specialize) runs it. Compiled for sm90 without a GPU (Triton's front end and
    its bundled ptxas) in a process without TRITON_INTERPRET; M = 1 a constexpr too, as at every decode step."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, str(D)], env=env, capture_output=True, text=True,
                       timeout=120)
    if r.returncode == 77 or "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no CUDA compiler in this Triton install")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
