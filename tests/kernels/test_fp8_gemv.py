"""fp8_small_m_linear (Triton; CUDA, or the interpreter on CPU, which handles e4m3 loads and, with the soft
rounding of kernels/fp8.py, e4m3 stores) against its torch reference: the quantized activations bit-identical to
per_token_quant_fp8's (through an identity weight), the product within a few ulps of the output (fp32 summation
order), on every launch path (GEMV / 16-row tl.dot, with and without split-K, ragged K), padded weights, static
scales, strided rows; the launch choice; the input checks. The real 7B shapes run in test_fp8_gemv_cuda.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hayabusa.kernels.fp8_gemv import (
    FP8_M_BUCKETS, FP8_SMALL_M_MAX, FP8_TABLE, FP8Q_TABLE, fp8_launch, fp8_m_bucket, fp8_small_m_linear,
    fp8_small_m_linear_ref, pick_fp8_config,
)
from hayabusa.kernels.fp8_quant import FP8_DTYPE, per_token_quant_fp8_ref
from hayabusa.kernels.quant_linear import LaunchConfig, gemm_shape_class
from tests.kernels.conftest import QWEN_7B

# interpreter-sized launches reaching every code path (K = 104 is not a multiple of 32: a ragged last K tile)
CONFIGS = {
    "gemv": LaunchConfig("gemv", BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1),
    "gemv_split": LaunchConfig("gemv", BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=1),
    "gemv4_split": LaunchConfig("gemv", BLOCK_M=4, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=1),
    "gemm": LaunchConfig("dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2),
    "gemm_split": LaunchConfig("dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=2),
}
EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}   # 1 ulp at 1.0


def _weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, s = per_token_quant_fp8_ref(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5)
    return w, s.view(-1).contiguous()


def _assert_few_ulps(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 2 ulps of the output's largest value (the interpreter's bf16 cast truncates: 1 ulp of that)."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    scale = float(ref.float().abs().max())
    err = float((y.float() - ref.float()).abs().max())
    assert err <= 2 * EPS[y.dtype] * scale, f"max |kernel - ref| = {err:.3g}, output scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cfg, M", [("gemv", 1), ("gemv_split", 3), ("gemv4_split", 3), ("gemv4_split", 6),
                                    ("gemm", 5), ("gemm_split", 16), ("gemm_split", 19)])
def test_fp8_small_m_matches_ref(device, dtype, cfg, M):
    """Bias on odd M; N = 40 is not a multiple of the N tile; 19 rows: two row tiles of 16."""
    N, K = 40, 104
    g = torch.Generator().manual_seed(M)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype).to(device)
    w, sw = (t.to(device) for t in _weight(N, K, seed=M))
    bias = torch.randn(N, generator=g).to(dtype).to(device) if M % 2 else None
    y = fp8_small_m_linear(x, w, sw, bias, cfg=CONFIGS[cfg])
    _assert_few_ulps(y, fp8_small_m_linear_ref(x, w, sw, bias))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("cfg", ["gemv_split", "gemm_split"])
def test_fp8_small_m_quantizes_like_per_token_quant_fp8(device, cfg, static):
    """With an identity weight (s_w = 1) each output is e4m3(x / s_x) * s_x computed once in fp32 and cast, so the
    kernel's outputs equal the reference quantizer's bits pushed through the same two roundings: any e4m3 step
    or scale ulp of difference shows. Rows from 1e-6 to 1e4 (subnormal e4m3 after scaling), an all-zero row (the
    MIN_SCALE floor) and, under the small static scale, saturating rows. x holds bf16 values in fp32: the output
    cast is then exact (the interpreter's bf16 cast truncates; the CUDA test also checks bf16 outputs)."""
    M, K = 4, 72
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g) * torch.logspace(-6, 4, M)[:, None]
    x[1] = 0.0
    x = x.to(torch.bfloat16).float().to(device)
    eye = torch.eye(K).to(FP8_DTYPE).to(device)
    ones = torch.ones(K, device=device)
    scale = torch.tensor(0.02, device=device) if static else None
    y = fp8_small_m_linear(x, eye, ones, input_scale=scale, cfg=CONFIGS[cfg])
    q, s = per_token_quant_fp8_ref(x, scale)
    assert torch.equal(y, (q.float() * s * ones).to(x.dtype))
    if static:
        assert (q.float().abs() == 448).any()                      # the saturating case was reached


@pytest.mark.parametrize("static", [False, True])
def test_fp8_small_m_padded_weight_strided_rows(device, static):
    """The layer's weight padded for _scaled_mm ([N', K'] >= [N, K]) with garbage in the padding: only [:N, :K] is
    read; x a column slice of a wider tensor (row stride 120)."""
    N, K = 24, 40
    w, sw = _weight(32, 48, seed=3)
    w, sw = w.to(device), sw.to(device)
    base = torch.randn(3, 120, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(device)
    x = base[:, 8:8 + K]
    scale = torch.tensor(0.01, device=device) if static else None
    y = fp8_small_m_linear(x, w, sw, input_scale=scale, out_features=N, cfg=CONFIGS["gemv_split"])
    assert y.shape == (3, N) and y.is_contiguous()
    _assert_few_ulps(y, fp8_small_m_linear_ref(x.contiguous(), w[:N, :K].contiguous(), sw[:N], None, scale))


@pytest.mark.parametrize("M, K, cfg", [
    (2, 8200, LaunchConfig("gemv", BLOCK_N=16, BLOCK_K=512, SPLIT_K=2, num_warps=8, num_stages=1)),  # 2 unrolled
    (3, 8200, LaunchConfig("gemv", BLOCK_M=4, BLOCK_N=16, BLOCK_K=512, SPLIT_K=2, num_warps=8, num_stages=1)),
    (5, 1100, LaunchConfig("dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=3, num_warps=4, num_stages=2)),
])
def test_fp8_small_m_long_rows(device, M, K, cfg):
    """Rows longer than one amax chunk: the unrolled prologue (GEMV: 8192-column chunks) and the looped one (16
    rows x 512 columns, 3 chunks: more x per thread than the unroll allows). Row 0's largest value sits in the last
    chunk; the weight picks 16 columns (one of them that one) with 1.0, so each output is q[m, k] * s_x[m] in fp32
    and must equal per_token_quant_fp8's bits (a prologue that stopped early gets row 0's scale wrong)."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=g)
    x[0, K - 3] = 50.0
    x = x.to(torch.bfloat16).float().to(device)
    cols = torch.cat([torch.linspace(0, K - 1, 15).long(), torch.tensor([K - 3])])
    w = torch.zeros(16, K)
    w[torch.arange(16), cols] = 1.0
    w, ones = w.to(FP8_DTYPE).to(device), torch.ones(16, device=device)
    y = fp8_small_m_linear(x, w, ones, cfg=cfg)
    q, s = per_token_quant_fp8_ref(x)
    assert torch.equal(y, q[:, cols.to(device)].float() * s * ones)
    assert float(s[0]) == pytest.approx(50.0 / 448.0, rel=1e-6)          # the last chunk set row 0's scale


def test_fp8_small_m_default_launch(device):
    """pick_fp8_config's own launch (FP8_TABLE: GEMV up to 4 rows, the tl.dot tile above); M = 0 allocates only."""
    w, sw = (t.to(device) for t in _weight(48, 256, seed=0))
    for M in (2, FP8_SMALL_M_MAX):
        x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16).to(device)
        _assert_few_ulps(fp8_small_m_linear(x, w, sw), fp8_small_m_linear_ref(x, w, sw))
    assert fp8_small_m_linear(torch.empty(0, 256, dtype=torch.bfloat16, device=device), w, sw).shape == (0, 48)


def _sweep_tiles() -> list[LaunchConfig]:
    """Every distinct tile of bench_quant_linear's --fp8 --sweep candidates (7B shapes, M = 1, 4, 16, 132 SMs) and
    of FP8_TABLE, each with SPLIT_K 3 (the fused reduction; on a small K fewer splits remain)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_quant_linear.py"
    spec = importlib.util.spec_from_file_location("bench_quant_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    entries = {bench._fp8_entry(c)[:4] + bench._fp8_entry(c)[5:] for M in (1, 4, 16)
               for K, N in QWEN_7B.values() for c in bench.fp8_sweep_configs(M, N, K, 132)}
    entries |= {e[:4] + e[5:] for e in FP8_TABLE.values()}
    return [LaunchConfig(kind, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=3, num_warps=w, num_stages=st)
            for kind, bm, bn, bk, w, st in sorted(entries)]


def test_every_sweep_candidate_matches_ref(device):
    """Each tile the sweep may put into FP8_TABLE, at M = 1, 3 and 16 (rows beyond a GEMV's 4 or below a dot
    tile's 16 masked) with N = 72 and K = 1576 (multiples of no tile size: ragged N and K tiles, a ragged last
    split), bias on, split-K reduced by the last program: within 2 ulps of the reference. On a GPU every tile at
    every M; in Triton's CPU interpreter (2 min for the full grid) each tile at one M, the Ms taken in turn, so
    every tile and every M is still run."""
    N, K = 72, 1576
    w, sw = (t.to(device) for t in _weight(N, K, seed=7))
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(N, generator=g).to(torch.bfloat16).to(device)
    xs = {M: (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16).to(device) for M in (1, 3, 16)}
    refs = {M: fp8_small_m_linear_ref(x, w, sw, bias) for M, x in xs.items()}
    tiles = _sweep_tiles()
    assert len(tiles) >= 20
    for i, cfg in enumerate(tiles):
        ms = list(xs) if w.is_cuda else [list(xs)[i % len(xs)]]
        for M in ms:
            x = xs[M]
            y = fp8_small_m_linear(x, w, sw, bias, cfg=cfg)
            scale = float(refs[M].float().abs().max())
            err = float((y.float() - refs[M].float()).abs().max())
            assert err <= 2 * EPS[torch.bfloat16] * scale, (cfg, M, err, scale)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("cfg", ["gemv_split", "gemv4_split", "gemm_split"])
def test_fused_splitk_reduce_equals_two_launch_reduce(device, monkeypatch, cfg, M):
    """The split-K partials summed by each tile's last program (USE_FUSED_REDUCE) are splitk_reduce's sum, bit for
    bit, with a bias; the per-tile counters are back at zero afterwards (the next launch, a CUDA-graph replay,
    needs them so)."""
    import hayabusa.kernels.fp8_gemv as fg

    N, K = 40, 104
    g = torch.Generator().manual_seed(M + 11)
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16).to(device)
    w, sw = (t.to(device) for t in _weight(N, K, seed=M))
    bias = torch.randn(N, generator=g).to(torch.bfloat16).to(device)
    fused = fp8_small_m_linear(x, w, sw, bias, cfg=CONFIGS[cfg])
    assert int(fg._LOCKS[torch.device(device)].abs().sum()) == 0
    monkeypatch.setattr(fg, "USE_FUSED_REDUCE", False)
    two = fp8_small_m_linear(x, w, sw, bias, cfg=CONFIGS[cfg])
    assert torch.equal(fused, two)
    _assert_few_ulps(fused, fp8_small_m_linear_ref(x, w, sw, bias))


def test_fp8_table_launches():
    """FP8_TABLE: an entry for every (shape class, M bucket), each a valid launch; 7B shapes on a 132-SM GPU get
    the GEMV up to 4 rows and the 16-row dot tile above; resolved K splits keep >= 1 K tile each; a malformed entry
    raises ValueError."""
    from hayabusa.kernels.quant_linear import GEMM_SHAPE_CLASSES

    assert set(FP8_TABLE) == {(c, b) for c in GEMM_SHAPE_CLASSES for b in FP8_M_BUCKETS}
    assert [fp8_m_bucket(M) for M in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, 16]
    cpu = torch.device("cpu")
    for M in range(1, FP8_SMALL_M_MAX + 1):
        for K, N in QWEN_7B.values():
            cfg = pick_fp8_config(M, N, K, cpu)
            assert cfg.kind == ("gemv" if M <= 4 else "dot")
            assert cfg.BLOCK_M >= M or cfg.kind == "dot"
            assert -(-K // cfg.BLOCK_K) >= cfg.SPLIT_K >= 1
    for bad in [("gemm", 16, 64, 128, 1, 4, 3), ("gemv", 8, 32, 512, 1, 4, 1), ("gemv", 1, 32, 8, 1, 4, 1),
                ("dot", 16, 48, 128, 1, 4, 3), ("gemv", 1, 32, 512, -1, 4, 1)]:
        with pytest.raises(ValueError, match="FP8_TABLE entry"):
            fp8_launch(bad, 1, 64, 64, cpu)
    assert set(FP8Q_TABLE) == set(FP8_TABLE)
    for M in (1, 4, 16):
        for K, N in QWEN_7B.values():
            assert pick_fp8_config(M, N, K, cpu, prequantized=True) == fp8_launch(
                FP8Q_TABLE[(gemm_shape_class(N, K), fp8_m_bucket(M))], M, N, K, cpu)


def test_tables_load_from_a_sweeps_json(tmp_path, monkeypatch):
    """HAYABUSA_FP8_TABLE_JSON's file (what `bench_quant_linear.py --fp8 --sweep --table-json` writes) replaces the
    entries it names, in both tables; a bad entry is refused naming the file and the row, leaving both tables as
    they were."""
    import json

    import hayabusa.kernels.fp8_gemv as fg

    monkeypatch.setattr(fg, "FP8_TABLE", dict(FP8_TABLE))
    monkeypatch.setattr(fg, "FP8Q_TABLE", dict(FP8Q_TABLE))
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"FP8_TABLE": [["deep", 1, ["gemv", 1, 64, 256, 2, 8, 1]]],
                                "FP8Q_TABLE": [["wide", 4, ["gemv", 4, 16, 512, 1, 8, 1]],
                                               ["square", 16, ["dot", 16, 64, 128, 0, 4, 3]]]}))
    assert fg.load_fp8_tables(str(path)) == {"FP8_TABLE": 1, "FP8Q_TABLE": 2}
    assert fg.FP8_TABLE[("deep", 1)] == ("gemv", 1, 64, 256, 2, 8, 1)
    assert fg.FP8Q_TABLE[("wide", 4)] == ("gemv", 4, 16, 512, 1, 8, 1)
    assert fg.FP8Q_TABLE[("deep", 1)] == FP8Q_TABLE[("deep", 1)]            # entries not named stay
    cfg = fg.pick_fp8_config(4, 37888, 3584, torch.device("cpu"), prequantized=True)
    assert (cfg.kind, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps) == ("gemv", 4, 16, 512, 8)
    before = (dict(fg.FP8_TABLE), dict(fg.FP8Q_TABLE))
    for bad in ([["deep", 1, ["gemv", 8, 64, 256, 2, 8, 1]]], [["huge", 1, ["gemv", 1, 64, 256, 2, 8, 1]]],
                [["deep", 1]]):
        path.write_text(json.dumps({"FP8Q_TABLE": [["wide", 1, ["gemv", 1, 16, 512, 1, 4, 1]]], "FP8_TABLE": bad}))
        with pytest.raises(ValueError, match="t.json: bad FP8_TABLE row"):
            fg.load_fp8_tables(str(path))
        assert (fg.FP8_TABLE, fg.FP8Q_TABLE) == before
    for text in ("{not json", "[1, 2]"):
        path.write_text(text)
        with pytest.raises(ValueError, match="t.json"):
            fg.load_fp8_tables(str(path))
    with pytest.raises(ValueError, match="missing.json: cannot read"):
        fg.load_fp8_tables(str(tmp_path / "missing.json"))
    assert (fg.FP8_TABLE, fg.FP8Q_TABLE) == before


def test_table_json_refuses_what_it_would_silently_drop_or_fail_on_later(tmp_path, monkeypatch):
    """A hand-written table: a misspelt table name would load nothing and say nothing; num_warps 3 (Triton takes
    powers of two), num_stages 0, a bucket given as true or 1.5, a table that is not a list and the same
    (class, bucket) twice would only fail (or be dropped) at a launch. Each is refused naming the file."""
    import json

    import hayabusa.kernels.fp8_gemv as fg

    monkeypatch.setattr(fg, "FP8_TABLE", dict(FP8_TABLE))
    monkeypatch.setattr(fg, "FP8Q_TABLE", dict(FP8Q_TABLE))
    before = (dict(fg.FP8_TABLE), dict(fg.FP8Q_TABLE))
    path = tmp_path / "t.json"
    good = ["gemv", 1, 32, 512, 4, 8, 1]
    for data, match in (
            ({"FP8_TABEL": [["deep", 1, good]]}, "FP8_TABEL"),
            ({"FP8_TABLE": {"deep": good}}, "FP8_TABLE must be a list"),
            ({"FP8_TABLE": [["deep", 1, ["gemv", 1, 32, 512, 4, 3, 1]]]}, "warps"),
            ({"FP8_TABLE": [["deep", 1, ["gemv", 1, 32, 512, 4, 8, 0]]]}, "stages"),
            ({"FP8_TABLE": [["deep", 1, ["gemv", 1.5, 32, 512, 4, 8, 1]]]}, "BLOCK_M"),
            ({"FP8_TABLE": [["deep", True, good]]}, "bucket"),
            ({"FP8_TABLE": [["deep", 1.5, good]]}, "bucket"),
            ({"FP8_TABLE": [["deep", 1, good], ["deep", 1, ["gemv", 1, 64, 256, 2, 8, 1]]]}, "twice")):
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match) as info:
            fg.load_fp8_tables(str(path))
        assert "t.json" in str(info.value)
        assert (fg.FP8_TABLE, fg.FP8Q_TABLE) == before


def test_table_env_var_with_a_bad_file_is_refused_by_name(tmp_path):
    """HAYABUSA_FP8_TABLE_JSON naming a missing file: importing the kernels fails with an error naming the variable
    and the file (a fresh interpreter: the module reads it at import)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HAYABUSA_FP8_TABLE_JSON=str(tmp_path / "nope.json"))
    p = subprocess.run([sys.executable, "-c", "import hayabusa.kernels.fp8_gemv"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and "HAYABUSA_FP8_TABLE_JSON" in p.stderr and "nope.json" in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's case")
def test_the_kernel_runs_in_a_plain_script_under_the_interpreter(tmp_path):
    """The docstring's promise (\"on CPU it needs TRITON_INTERPRET=1\") in a fresh interpreter that has not loaded the
    tests' conftest: Triton 3.6's interpreter turns a loop bound into an int with int(array), which numpy >= 2.4
    refuses for a 1-element array (triton-lang/triton#9171), so every `range(k_start, k_end, ...)` loop failed
    there; importing the kernels now applies the fix. The default launch and the XQ launch, against the reference."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from hayabusa.kernels.fp8_gemv import fp8_small_m_linear, fp8_small_m_linear_ref\n"
        "from hayabusa.kernels.fp8_quant import per_token_quant_fp8_ref\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w, s = per_token_quant_fp8_ref(torch.randn(48, 64, generator=g) / 8)\n"
        "s = s.view(-1).contiguous()\n"
        "x = torch.randn(3, 64, generator=g).to(torch.bfloat16)\n"
        "y = fp8_small_m_linear(x, w, s)\n"
        "xq, sx = per_token_quant_fp8_ref(x)\n"
        "assert torch.equal(fp8_small_m_linear(xq, w, s, x_scale=sx), y)\n"
        "err = float((y.float() - fp8_small_m_linear_ref(x, w, s).float()).abs().max())\n"
        "print('max err', err)\n"
        "assert err <= 2 ** -6 * float(y.float().abs().max()), err\n")
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "max err" in p.stdout


def test_out_dtype_of_a_float_x_may_only_repeat_its_dtype(device):
    """A bf16 / float32 x gives its own dtype: out_dtype equal to it is accepted (the same bits as without it);
    any other out_dtype is refused by name rather than ignored (checked in test_fp8_small_m_rejects_bad_input)."""
    w, s = (t.to(device) for t in _weight(16, 16, seed=0))
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
        y = fp8_small_m_linear(x, w, s, out_dtype=dtype, cfg=CONFIGS["gemv"])
        assert y.dtype == dtype and torch.equal(y, fp8_small_m_linear(x, w, s, cfg=CONFIGS["gemv"]))


@pytest.mark.parametrize("make, match", [
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w.float(), weight_scale=s), "weight must"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w.t(), weight_scale=s), "weight must"),
    (lambda d, w, s: dict(x=torch.randn(2, 32, device=d), weight=w, weight_scale=s), "columns"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s, out_features=17),
     "out_features"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s.half()), "weight_scale"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s,
                          bias=torch.zeros(16, dtype=torch.float16, device=d)), "bias"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d).double(), weight=w, weight_scale=s), "x must"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s, input_scale=0.5),
     "input_scale must"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s,
                          input_scale=torch.ones(2, device=d)), "input_scale must"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s, out_dtype=torch.int8),
     "out_dtype"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s, out_dtype=torch.bfloat16),
     "out_dtype"),
    (lambda d, w, s: dict(x=torch.randn(2, 8, device=d), weight=w, weight_scale=s,
                          x_scale=torch.ones(2, 1, device=d)), "x_scale is only"),
    (lambda d, w, s: dict(x=torch.zeros(2, 8, device=d).to(FP8_DTYPE), weight=w, weight_scale=s), "x_scale must"),
    (lambda d, w, s: dict(x=torch.zeros(2, 8, device=d).to(FP8_DTYPE), weight=w, weight_scale=s,
                          x_scale=torch.ones(3, 1, device=d)), "x_scale must"),
    (lambda d, w, s: dict(x=torch.zeros(2, 8, device=d).to(FP8_DTYPE), weight=w, weight_scale=s,
                          x_scale=torch.ones(2, 1, device=d), input_scale=torch.ones(1, device=d)), "input_scale"),
    (lambda d, w, s: dict(x=torch.zeros(2, 8, device=d).to(FP8_DTYPE), weight=w, weight_scale=s,
                          x_scale=torch.ones(2, 1, device=d), out_dtype=torch.int8), "out_dtype"),
    (lambda d, w, s: dict(x=torch.zeros(2, 8, device=d).to(FP8_DTYPE), weight=w, weight_scale=s,
                          x_scale=torch.ones(2, 1, device=d), bias=torch.zeros(16, device=d)), "bias must"),
])
def test_fp8_small_m_rejects_bad_input(device, make, match):
    w, s = (t.to(device) for t in _weight(16, 16, seed=0))
    with pytest.raises(ValueError, match=match):
        fp8_small_m_linear(**make(device, w, s))


@pytest.mark.parametrize("M", [1, 3, 6])
@pytest.mark.parametrize("cfg", ["gemv", "gemv_split", "gemv4_split", "gemm", "gemm_split"])
def test_prequantized_x_gives_the_fused_kernels_bits(device, cfg, M):
    """x quantized by its producer (per_token_quant_fp8's x_q and scales, what fused_act_quant's kernels write)
    through the XQ launches: the same bits as the kernel quantizing x itself with the same launch (the sums run in
    the same order), bias on; float16 output when asked."""
    N, K = 40, 104
    g = torch.Generator().manual_seed(M + 5)
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16).to(device)
    w, sw = (t.to(device) for t in _weight(N, K, seed=M))
    bias = torch.randn(N, generator=g).to(torch.bfloat16).to(device)
    xq, sx = per_token_quant_fp8_ref(x)
    fused = fp8_small_m_linear(x, w, sw, bias, cfg=CONFIGS[cfg])
    pre = fp8_small_m_linear(xq, w, sw, bias, cfg=CONFIGS[cfg], x_scale=sx)
    assert pre.dtype == torch.bfloat16 and torch.equal(pre, fused)
    half = fp8_small_m_linear(xq, w, sw, bias.half(), cfg=CONFIGS[cfg], x_scale=sx, out_dtype=torch.float16)
    _assert_few_ulps(half, fp8_small_m_linear_ref(x.half(), w, sw, bias.half()))


def test_sweep_tables_reach_the_engine_through_the_json(tmp_path, monkeypatch, capsys):
    """bench_quant_linear's --fp8 --sweep summary: per (shape class, M bucket) the launch with the least time summed
    over the class's layers, for the kernel quantizing x (FP8_TABLE) and for its XQ launch (FP8Q_TABLE), printed
    and written with --table-json; load_fp8_tables (HAYABUSA_FP8_TABLE_JSON) then picks exactly those launches."""
    import importlib.util
    from pathlib import Path

    import hayabusa.kernels.fp8_gemv as fg

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_quant_linear.py"
    spec = importlib.util.spec_from_file_location("bench_quant_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a, b = ("gemv", 1, 32, 512, 4, 8, 1), ("gemv", 1, 64, 256, 2, 4, 1)
    cfg = dict(kind="gemv", BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=1)

    def row(layer, K, N, fused, xq):
        return dict(layer=layer, K=K, N=N, M=1, config=cfg, copy_gb_s=4000.0, bf16_us=10.0, scaled_mm_us=15.0,
                    fused_us=9.0, fused_gb_s=2000.0, xq_us=8.0, xq_gb_s=2500.0,
                    sweep_us={repr(a): fused[0], repr(b): fused[1]}, sweep_best=repr(a), sweep_best_us=fused[0],
                    sweep_best_gb_s=1.0, xq_sweep_us={repr(a): xq[0], repr(b): xq[1]}, xq_sweep_best=repr(b),
                    xq_sweep_best_us=xq[1], xq_sweep_best_gb_s=1.0)

    # qkv and o are one class ("square"): a wins the fused sum (5 + 6 < 7 + 5), b the XQ sum (4 + 4 < 3 + 6)
    rows = [row("qkv", 3584, 4608, (5.0, 7.0), (3.0, 4.0)), row("o", 3584, 3584, (6.0, 5.0), (6.0, 4.0))]
    out = tmp_path / "tables.json"
    bench.print_fp8_table(rows, str(out))
    text = capsys.readouterr().out
    assert f"('square', 1): {a!r}" in text and f"('square', 1): {b!r}" in text
    monkeypatch.setattr(fg, "FP8_TABLE", dict(FP8_TABLE))
    monkeypatch.setattr(fg, "FP8Q_TABLE", dict(FP8Q_TABLE))
    assert fg.load_fp8_tables(str(out)) == {"FP8_TABLE": 1, "FP8Q_TABLE": 1}
    assert fg.FP8_TABLE[("square", 1)] == a and fg.FP8Q_TABLE[("square", 1)] == b


def test_split_locks_grow_and_keep_the_old_buffer(monkeypatch):
    """split_locks grows its buffer when a launch needs more counters, zeroed, and keeps the one it replaces alive
    (a CUDA graph captured with it replays on it)."""
    import hayabusa.kernels.fp8_gemv as fg

    monkeypatch.setattr(fg, "_LOCKS", {})
    monkeypatch.setattr(fg, "_RETIRED_LOCKS", [])
    cpu = torch.device("cpu")
    first = fg.split_locks(cpu, 10)
    assert first.numel() >= 10 and fg.split_locks(cpu, first.numel()) is first
    bigger = fg.split_locks(cpu, first.numel() + 1)
    assert bigger.numel() > first.numel() and int(bigger.abs().sum()) == 0
    assert fg._RETIRED_LOCKS == [first] and fg.split_locks(cpu, 5) is bigger
