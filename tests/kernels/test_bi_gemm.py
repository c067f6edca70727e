"""The split-K batch-invariant GEMM (kernels/bi_gemm.py): one input row's bits are the same alone and inside batches
of other rows of many sizes, whichever launch (split: a program per (tile, K chunk) + the partial-sum kernel;
unsplit: a program per tile) and whichever tiles M's bucket picks; they match F.linear within the dtype's tolerance.
The arithmetic (BLOCK_K, CHUNK_K) depends on (N, K) and the SM count only; the table and HAYABUSA_BI_GEMM_CONFIGS
override it; M's bucket changes only the launch's TILE_FIELDS.

Triton kernels run under TRITON_INTERPRET on CPU (its "GPU" has 4 SMs: bi_gemm.num_sms), tiny shapes. NOTE: the
interpreter casts fp32 to bf16 / fp16 by truncation (the GPU rounds to nearest), hence the tolerance of 2 ulps.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels import bi_gemm as bg
from hayabusa.kernels.bi_gemm import BiGemmConfig, bi_gemm, bi_gemm_config, bi_gemm_splits

SIZES = (1, 2, 3, 7, 16, 33, 64, 130)
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
SMALL = BiGemmConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, CHUNK_K=64)
# (N, K, config), each run split at M <= 16 and unsplit from M = 33 or 130 on (the interpreter's 4 SMs):
# chunks of 64 over K = 200 (the last one 8 wide: K is no multiple of the chunk, nor of BLOCK_K) with 32-row tiles;
# a narrow weight (N 40 < one 64 tile, chunks of 96, the last 12); the heuristic's own choice at K = 520 (three
# chunks of 192, the last 136) with 64-row tiles.
CASES = {
    "small-tiles": (72, 200, SMALL),
    "narrow": (40, 300, BiGemmConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, CHUNK_K=96)),
    "heuristic": (72, 520, None),     # and M's buckets: 16-row tiles up to M = 16, the 64-row tiles above
}
RUNS = [("small-tiles", torch.bfloat16, True), ("narrow", torch.float16, False), ("narrow", torch.float32, True),
        ("heuristic", torch.bfloat16, True)]


def _row_in_batches(fn, row: torch.Tensor, sizes=SIZES) -> list[torch.Tensor]:
    """fn(batch)[at] for the same row placed among random rows in batches of each size, in the middle and last
    (first in a tile, last in a tile, or anywhere between, by the size)."""
    gen = torch.Generator().manual_seed(1)
    outs = []
    for n in sizes:
        for at in sorted({n // 2, n - 1}):
            batch = torch.randn(n, row.shape[0], generator=gen).to(row.dtype)
            batch[at] = row
            outs.append(fn(batch)[at])
    return outs


def _weights(N: int, K: int, dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    row = torch.randn(K, generator=gen).to(dtype)
    return w, b, row


@pytest.mark.parametrize("case,dtype,bias", RUNS, ids=[f"{c}-{str(d)[6:]}-{'bias' if b else 'nobias'}"
                                                         for c, d, b in RUNS])
def test_bi_gemm_row_invariant_across_batch_sizes(device, case, dtype, bias):
    N, K, cfg = CASES[case]
    w, b, row = _weights(N, K, dtype, bias=bias)
    w, b = w.to(device), (b.to(device) if b is not None else None)
    sms = bg.num_sms(torch.device(device))
    launches = {bi_gemm_splits(M, N, K, cfg or bi_gemm_config(N, K, sms), sms) for M in SIZES}
    assert launches == {True, False} or device == "cuda", "the sizes should exercise both launches"
    outs = _row_in_batches(lambda x: bi_gemm(x.to(device), w, b, config=cfg).cpu(), row)
    for i, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"variant {i} differs by {(o.float() - outs[0].float()).abs().max()}"
    ref = F.linear(row[None].float(), w.float().cpu(), None if b is None else b.float().cpu())[0]
    tol = 2 * ULP[dtype] * ref.abs().max().item() + 1e-6
    torch.testing.assert_close(outs[0].float(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("M,dtype", [(1, torch.float32), (5, torch.float32), (70, torch.float32)])
def test_split_and_unsplit_launches_are_bit_identical(device, M, dtype):
    """The same rows forced through both launches: the chunk partials and their index-order sum are the same float
    operations whether one program sums them in registers or the partial-sum kernel does (bias included). fp32
    shows a changed summation order (bf16's rounding mostly hides it at these sizes; the row tests cover bf16)."""
    N, K, cfg = CASES["small-tiles"]
    w, b, _ = _weights(N, K, dtype, bias=True, seed=3)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(4)).to(dtype)
    w, b, x = w.to(device), b.to(device), x.to(device)
    split = bi_gemm(x, w, b, config=cfg, split=True)
    unsplit = bi_gemm(x, w, b, config=cfg, split=False)
    assert torch.equal(split, unsplit)
    assert not torch.equal(split, bi_gemm(x, w, None, config=cfg, split=True))   # the bias is really added


@pytest.mark.parametrize("M", [1, 70])
def test_sum_in_kernel_equals_the_two_launch_sum(device, M):
    """SUM_IN_KERNEL: the tile's last chunk program sums the partials (no second kernel): the same bits as the
    partial-sum kernel and the unsplit launch, twice in a row (the arrival counters are back at zero after each)."""
    import dataclasses

    N, K, cfg = CASES["small-tiles"]
    fused = dataclasses.replace(cfg, SUM_IN_KERNEL=True)
    w, b, _ = _weights(N, K, torch.float32, bias=True, seed=5)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(6))
    w, b, x = w.to(device), b.to(device), x.to(device)
    want = bi_gemm(x, w, b, config=cfg, split=False)
    for _ in range(2):
        assert torch.equal(bi_gemm(x, w, b, config=fused, split=True), want)
    assert torch.equal(bi_gemm(x, w, b, config=fused, split=False), want)
    bg.reserve_tile_counters(torch.device(device))                       # already there: a no-op
    assert not bg._tile_counters(torch.device(device)).any()


def test_bi_gemm_leading_dims_and_strided_x(device):
    """x [..., K] keeps its leading shape; a strided x (rows of a wider tensor) gives the contiguous x's bits."""
    N, K, cfg = CASES["small-tiles"]
    w, b, _ = _weights(N, K, torch.bfloat16, bias=True)
    wide = torch.randn(6, K + 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(device)
    x = wide[:, :K]
    y = bi_gemm(x.reshape(2, 3, K), w.to(device), b.to(device), config=cfg)
    assert y.shape == (2, 3, N)
    assert torch.equal(y.reshape(6, N), bi_gemm(x.contiguous(), w.to(device), b.to(device), config=cfg))


def test_bi_gemm_rejects_bad_inputs(device):
    with pytest.raises(ValueError, match="weight"):
        bi_gemm(torch.zeros(2, 8, device=device), torch.zeros(4, 9, device=device))
    with pytest.raises(ValueError, match="bias"):
        bi_gemm(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device), torch.zeros(5, device=device))
    assert bi_gemm(torch.zeros(0, 8, device=device), torch.zeros(4, 8, device=device)).shape == (0, 4)


# ----------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("N,K", [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896),
                                 (4608, 3584), (3584, 18944), (37888, 3584), (128, 896), (72, 80)])
def test_heuristic_config_splits_k_by_weight_shape(N, K):
    """Chunks are whole BLOCK_K steps, at least MIN_CHUNK_K (or all of a short K), at most MAX_SPLITS of them; a
    narrow weight splits (decode parallelism), one with a column tile per SM does not."""
    cfg = bg.heuristic_config(N, K, 132)
    S = cfg.num_chunks(K)
    assert cfg.CHUNK_K % cfg.BLOCK_K == 0 and (cfg.CHUNK_K >= bg.MIN_CHUNK_K or S == 1)
    assert 1 <= S <= bg.MAX_SPLITS and (S - 1) * cfg.CHUNK_K < K <= S * cfg.CHUNK_K
    col_tiles = -(-N // cfg.BLOCK_N)
    if col_tiles >= 132:                   # one row tile already gives every SM a program: no split
        assert S == 1
    elif K >= 2 * bg.MIN_CHUNK_K:          # a narrow weight: decode gets S x its column tiles
        assert S > 1
        assert S * col_tiles >= min(132, col_tiles * (K // bg.MIN_CHUNK_K)) // 2


@pytest.fixture
def fresh_config_cache():
    bg.reset_config_cache()
    yield
    bg.reset_config_cache()


def test_table_and_env_override_the_heuristic(monkeypatch, fresh_config_cache):
    monkeypatch.delenv(bg.ENV_CONFIGS, raising=False)
    assert (768, 512) not in bg.BI_GEMM_TABLE and (512, 2048) not in bg.BI_GEMM_TABLE
    assert bi_gemm_config(768, 512) == bg.heuristic_config(768, 512, 132)
    for shape, cfg in bg.BI_GEMM_TABLE.items():             # the measured entries are what the launch reads
        assert bi_gemm_config(*shape) == cfg
    measured = BiGemmConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, CHUNK_K=256, num_warps=8)
    monkeypatch.setitem(bg.BI_GEMM_TABLE, (768, 512), measured)
    bg.reset_config_cache()               # the table is read once per shape
    assert bi_gemm_config(768, 512) == measured
    monkeypatch.setenv(bg.ENV_CONFIGS, '{"768x512": {"CHUNK_K": 384, "num_stages": 4}}')
    assert bi_gemm_config(768, 512) == BiGemmConfig(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, CHUNK_K=384,
                                                    num_warps=8, num_stages=4)
    assert bi_gemm_config(512, 2048) == bg.heuristic_config(512, 2048, 132)     # other shapes untouched
    monkeypatch.setenv(bg.ENV_CONFIGS, '{"*": {"SUM_IN_KERNEL": true, "num_stages": 2}, "768x512": {"num_stages": 4}}')
    assert bi_gemm_config(512, 2048).SUM_IN_KERNEL and bi_gemm_config(512, 2048).num_stages == 2
    assert bi_gemm_config(768, 512).SUM_IN_KERNEL and bi_gemm_config(768, 512).num_stages == 4


@pytest.mark.parametrize("raw,field", [("not json", None), ('{"896": {}}', None),
                                       ('{"896x896": {"BLOCK_Q": 1}}', "['BLOCK_Q'] for 896x896; the fields are "
                                                                       "['BLOCK_M', 'BLOCK_N', 'BLOCK_K', 'CHUNK_K'"),
                                       ('{"896x896": {"CHUNK_K": 100}}', "BiGemmConfig.CHUNK_K=100"),
                                       ('{"*": {"SUM_IN_KERNEL": 1}}', "BiGemmConfig.SUM_IN_KERNEL=1"),
                                       ('{"*": {"num_warps": 4.0}}', "BiGemmConfig.num_warps=4.0"),
                                       ('{"*": {"num_stages": true}}', "BiGemmConfig.num_stages=True"),
                                       ('{"*": {"BLOCK_N": 48}}', "BiGemmConfig.BLOCK_N=48")])
def test_bad_env_config_is_refused_by_name(monkeypatch, fresh_config_cache, raw, field):
    """The variable is the parameter; the message names the shape and the field (JSON's 4.0 and true are no tile
    sizes)."""
    monkeypatch.setenv(bg.ENV_CONFIGS, raw)
    with pytest.raises(HayabusaValidationError) as info:
        bi_gemm_config(896, 896)
    assert info.value.parameter == bg.ENV_CONFIGS and bg.ENV_CONFIGS in str(info.value)
    if field:
        assert field in str(info.value) and "896x896" in str(info.value)


def test_config_fields_are_checked():
    with pytest.raises(HayabusaValidationError, match="BLOCK_N"):
        BiGemmConfig(BLOCK_N=48)
    with pytest.raises(HayabusaValidationError, match="CHUNK_K"):
        BiGemmConfig(BLOCK_K=64, CHUNK_K=96)
    with pytest.raises(HayabusaValidationError, match="num_warps"):
        BiGemmConfig(num_warps=3)


def test_linear_shapes_of_the_benchmark_models():
    """The shapes the CUDA test and bench_bi_gemm.py use: q/k/v and gate/up merged as the engine holds them
    (0.5b: 14 heads + 2 x 2 KV heads of 64 -> 1152; 7b: 28 + 2 x 4 of 128 -> 4608)."""
    from hayabusa.bench.models import linear_shapes

    assert linear_shapes("qwen2.5-0.5b-shape") == {"qkv": (1152, 896, True), "o": (896, 896, False),
                                                   "gate_up": (9728, 896, False), "down": (896, 4864, False),
                                                   "lm_head": (151936, 896, False)}
    assert linear_shapes("qwen2.5-7b-shape")["qkv"] == (4608, 3584, True)
    assert linear_shapes("qwen2.5-7b-shape")["down"] == (3584, 18944, False)


def test_bench_bi_gemm_runs(device, tmp_path):
    """benchmarks/kernels/bench_bi_gemm.py end to end on a tiny shape (the interpreter on CPU): a row per M with
    every column, the engine's launch named, and a sweep result that is a valid configuration."""
    import json
    import runpy
    from pathlib import Path

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks/kernels/bench_bi_gemm.py"),
                           run_name="bench_bi_gemm")
    out = tmp_path / "bi.json"
    sweep = ["--sweep"] if device == "cpu" else []          # on a GPU the real grid takes minutes
    bench["main"](["--device", device, "--shapes", "40x200", "--m", "1,3", "--json", str(out),
                   "--config", '{"40x200": {"BLOCK_M": 16, "CHUNK_K": 128}}'] + sweep)
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["N"], r["K"], r["M"]) for r in rows] == [(40, 200, 1), (40, 200, 3)]
    assert all(r["config"]["BLOCK_M"] == 16 and r["S"] == 2 for r in rows)       # --config reached the kernel
    for col in ("torch_us", "unsplit_us", "bi_us", "bi_split_us", "bi_fused_us", "bi_unsplit_us", "bi_gb_s"):
        assert all(r[col] > 0 for r in rows), col
    assert {r["launch"] for r in rows} <= {"split", "unsplit"}
    if sweep:
        (best,) = data["sweep"]
        assert (best["N"], best["K"]) == (40, 200) and best["candidates"] > 0
        BiGemmConfig(**best["best"])


def test_bench_bi_gemm_probe_and_bucket_sweep(monkeypatch, fresh_config_cache, tmp_path):
    """--probe-tiles counts launches whose rows differ (none in the interpreter either); --bucket-sweep --keep-arith
    keeps the shape's BLOCK_K / CHUNK_K and writes a bucket file that bi_gemm_config then reads."""
    import json
    import runpy
    from pathlib import Path

    monkeypatch.delenv(bg.ENV_CONFIGS, raising=False)
    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks/kernels/bench_bi_gemm.py"),
                           run_name="bench_bi_gemm")
    probe = tmp_path / "probe.json"
    bench["main"](["--device", "cpu", "--shapes", "40x200", "--probe-tiles", "--json", str(probe)])
    found = json.loads(probe.read_text())
    assert [r["dtype"] for r in found] == ["torch.bfloat16", "torch.float16"]
    assert all(r["compared"] >= 8 and r["differ"] == [] for r in found)
    out, buckets = tmp_path / "sweep.json", tmp_path / "buckets.json"
    bench["main"](["--device", "cpu", "--shapes", "40x200", "--m", "1,20", "--bucket-sweep", "--keep-arith",
                   "--json", str(out), "--buckets-out", str(buckets)])
    (r,) = json.loads(out.read_text())
    own = bi_gemm_config(40, 200, 4)
    assert (r["BLOCK_K"], r["CHUNK_K"]) == (own.BLOCK_K, own.CHUNK_K) and len(r["arith_means"]) == 1
    monkeypatch.setenv(bg.ENV_BUCKETS, str(buckets))
    for M, p in zip((1, 5000), r["per_m"]):
        cfg = bi_gemm_config(40, 200, 4, M)
        assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) == (p["cfg"]["BLOCK_M"], p["cfg"]["BLOCK_N"], own.BLOCK_K)


@pytest.mark.parametrize("shape", [*bg.BI_GEMM_BUCKETS, (768, 512), (1536, 8960)])
@pytest.mark.parametrize("hopper", [True, False])
def test_buckets_change_only_the_launch(monkeypatch, fresh_config_cache, shape, hopper):
    """Every M's launch keeps the shape's BLOCK_K and CHUNK_K (the order a row's products are added in) and differs
    from the shape's configuration only in TILE_FIELDS; M picks the first bucket whose bound it does not pass: the
    measured buckets on a compute capability 9.0 device (as if on one here), heuristic_buckets without their large
    tiles on any other."""
    monkeypatch.delenv(bg.ENV_CONFIGS, raising=False)
    monkeypatch.setattr(bg, "capability_at_least", lambda device, capability: hopper)
    base = bi_gemm_config(*shape)
    buckets = (bg.BI_GEMM_BUCKETS.get(shape) if hopper else None) or bg.heuristic_buckets(base, hopper)
    seen = set()
    for M in (1, 2, 15, 16, 17, 63, 64, 65, 255, 256, 257, 2048, 100_000):
        cfg = bi_gemm_config(*shape, M=M, device=torch.device("cuda"))
        assert (cfg.BLOCK_K, cfg.CHUNK_K) == (base.BLOCK_K, base.CHUNK_K), (shape, M)
        changed = {f for f in BiGemmConfig.__dataclass_fields__ if getattr(cfg, f) != getattr(base, f)}
        assert changed <= bg.TILE_FIELDS, (shape, M, changed)
        bound, tile = next(b for b in buckets if M <= b[0] or b is buckets[-1])
        assert all(getattr(cfg, k) == v for k, v in tile.items()), (shape, M, bound)
        seen.add(bound)
    assert seen == {b for b, _ in buckets}, "the sizes should reach every bucket"


def test_buckets_table_and_env(monkeypatch, fresh_config_cache):
    """The measured buckets are what the launch reads; the environment's tile fields win over a bucket (an
    experiment sets every M); a bucket that changes BLOCK_K or CHUNK_K is refused naming the fields."""
    monkeypatch.delenv(bg.ENV_CONFIGS, raising=False)
    monkeypatch.setattr(bg, "capability_at_least", lambda device, capability: True)
    gpu = torch.device("cuda")
    assert bi_gemm_config(9728, 896, M=1, device=gpu).BLOCK_M == 16
    assert bi_gemm_config(9728, 896, M=2048, device=gpu).BLOCK_M == 128
    assert bi_gemm_config(9728, 896, M=2048).BLOCK_M == 64        # no device (or not Hopper): no 128-row tiles
    assert bi_gemm_splits(1, 896, 4864, bi_gemm_config(896, 4864, M=1, device=gpu), 132)   # measured: split at 1 row
    assert not bi_gemm_splits(2048, 896, 4864, bi_gemm_config(896, 4864, M=2048, device=gpu), 132)
    monkeypatch.setenv(bg.ENV_CONFIGS, '{"9728x896": {"BLOCK_M": 32, "num_warps": 2}}')
    assert {(bi_gemm_config(9728, 896, M=m, device=gpu).BLOCK_M, bi_gemm_config(9728, 896, M=m, device=gpu).num_warps)
            for m in (1, 64, 4096)} == {(32, 2)}
    monkeypatch.delenv(bg.ENV_CONFIGS)
    monkeypatch.setitem(bg.BI_GEMM_BUCKETS, (768, 512), ((16, dict(BLOCK_K=128)), (1 << 62, {})))
    bg.reset_config_cache()
    with pytest.raises(HayabusaValidationError, match="BLOCK_K"):
        bi_gemm_config(768, 512, M=1, device=gpu)


def test_bucket_file_from_the_environment(monkeypatch, fresh_config_cache, tmp_path):
    """HAYABUSA_BI_GEMM_BUCKETS (what bench_bi_gemm.py --bucket-sweep --buckets-out writes): its shapes' launches
    over the table's, other shapes untouched; a missing file, or a bucket changing BLOCK_K or setting a bad value,
    refused naming the variable."""
    monkeypatch.delenv(bg.ENV_CONFIGS, raising=False)
    path = tmp_path / "buckets.json"
    path.write_text('{"896x896": [[8, {"BLOCK_M": 16, "BLOCK_N": 64}], [99, {"BLOCK_M": 128, "num_warps": 8}]]}')
    bg.reset_config_cache()
    monkeypatch.setenv(bg.ENV_BUCKETS, str(path))
    assert (bi_gemm_config(896, 896, M=8).BLOCK_M, bi_gemm_config(896, 896, M=8).BLOCK_N) == (16, 64)
    assert (bi_gemm_config(896, 896, M=5000).BLOCK_M, bi_gemm_config(896, 896, M=5000).num_warps) == (128, 8)
    assert bi_gemm_config(896, 896, M=8).CHUNK_K == bg.BI_GEMM_TABLE[(896, 896)].CHUNK_K
    assert bi_gemm_config(9728, 896, M=1).BLOCK_M == 16                       # another shape: heuristic buckets
    path.write_text('{"896x896": [[8, {"BLOCK_M": 16}], [null, {"BLOCK_M": 128, "num_warps": 8}]]}')   # null: no bound
    bg.reset_config_cache()
    assert bi_gemm_config(896, 896, M=9).BLOCK_M == 128 and bi_gemm_config(896, 896, M=1 << 40).BLOCK_M == 128
    for text, match in (("{not json", "must name a JSON file"),
                        ('{"896x896": [[8, {"CHUNK_K": 128}]]}', "CHUNK_K.*set them for every M with "
                                                                   "HAYABUSA_BI_GEMM_CONFIGS"),
                        ('{"896x896": [[8, {"BLOCK_M": 48}]]}', "896x896, bucket up to M=8: BiGemmConfig.BLOCK_M=48"),
                        ('{"896x896": [[8, {"num_stages": true}]]}', "num_stages=True"),
                        ('{"896x896": [[64, {}], [8, {"BLOCK_M": 16}]]}', "increasing int bounds.*got 8 after 64"),
                        ('{"896x896": [[-1, {}]]}', "increasing int bounds"),
                        ('{"896x896": [[null, {}], [64, {}]]}', r"got 64 after no bound \(null\)"),
                        ('{"896x896": [[null, {"TMA": "yes"}]]}', r"bucket up to M=no bound \(null\): "
                                                                  "BiGemmConfig.TMA='yes' must be true or false"),
                        ('{"896x896": [[8, {"BLOK_M": 16}]]}', r"unknown field\(s\) \['BLOK_M'\]; a bucket sets")):
        path.write_text(text)
        bg.reset_config_cache()
        with pytest.raises(HayabusaValidationError, match=match) as info:
            bi_gemm_config(896, 896, M=8)
        assert info.value.parameter == bg.ENV_BUCKETS and bg.ENV_BUCKETS in str(info.value)
    monkeypatch.setenv(bg.ENV_BUCKETS, str(tmp_path / "missing.json"))
    with pytest.raises(HayabusaValidationError) as info:
        bi_gemm_config(896, 896, M=8)
    assert info.value.parameter == bg.ENV_BUCKETS


def test_heuristic_buckets_keep_small_memory_off_hopper():
    """Off compute capability 9.0 the heuristic never asks for the 128 x 128 tiles (their shared memory); on it,
    prefill-sized M gets them when BLOCK_K is 64."""
    cfg = bg.heuristic_config(3584, 18944, 132)
    assert all(t.get("BLOCK_M", cfg.BLOCK_M) <= 64 for _, t in bg.heuristic_buckets(cfg, hopper=False))
    assert bg.heuristic_buckets(cfg, hopper=True)[-1][1] == dict(BLOCK_M=128, BLOCK_N=128, num_warps=8)
    assert bg.heuristic_buckets(cfg, hopper=True)[0][1]["BLOCK_M"] == 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [SMALL, BiGemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, CHUNK_K=32)],
                         ids=["chunks-of-64", "chunks-of-32"])
def test_silu_and_mul_bi_has_the_two_launches_bits(device, dtype, cfg):
    """gate_up + SiLU-and-mul in one launch (the mode's MLP on CUDA) gives the bits of bi_gemm's unsplit launch and
    activation.silu_and_mul, at any M (a row alone included), with K in several chunks (K = 200 over chunks of 64 or
    32: partial last chunk and BLOCK_K step); it declines (None) a bias and a split launch."""
    from hayabusa.kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(5)
    D, K = 40, 200
    w = (torch.randn(2 * D, K, generator=gen) / K ** 0.5).to(dtype).to(device)
    unsplit = BiGemmConfig(**{**cfg.__dict__, "SPLIT_BELOW_TILES": bg.UNSPLIT})
    for M in (1, 3, 17, 40):
        x = (torch.randn(M, K, generator=gen) * 2).to(dtype).to(device)
        fused = bg.silu_and_mul_bi(x, w, config=unsplit)
        two = silu_and_mul(bi_gemm(x, w, config=unsplit, split=False))
        assert fused.shape == (M, D) and torch.equal(fused, two), (M, (fused.float() - two.float()).abs().max())
        assert torch.equal(bg.silu_and_mul_bi(x[M // 2:M // 2 + 1], w, config=unsplit)[0], fused[M // 2])
    ref = F.silu(F.linear(x.float(), w.float())[:, :D]) * F.linear(x.float(), w.float())[:, D:]
    torch.testing.assert_close(fused.float(), ref, rtol=4e-2, atol=4e-2 * ref.abs().max().item())
    assert bg.silu_and_mul_bi(x, w, torch.zeros(2 * D, dtype=dtype, device=device), config=unsplit) is None
    assert bg.silu_and_mul_bi(x, w, config=BiGemmConfig(**{**cfg.__dict__, "SPLIT_BELOW_TILES": bg.SPLIT})) is None
    with pytest.raises(ValueError, match="even number of rows"):
        bg.silu_and_mul_bi(x, w[1:], config=unsplit)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["small-tiles", "one-chunk"])
def test_tma_kernel_rows_do_not_depend_on_m(device, dtype, case):
    """The persistent TMA kernel (TMA=True in M's bucket on Hopper; forced here, in the interpreter too): a row's bits
    alone and among other rows at every M, with a bias, with K in several chunks (K = 200: partial last chunk) and in
    one (the flattened tile loop); close to the pointer kernel (bit equality of the two is a GPU claim,
    test_bi_gemm_cuda.py: the interpreter's fp32 dot sums a transposed operand in another order), and the MLP's
    SiLU launch through it close to the two launches."""
    from hayabusa.kernels.activation import silu_and_mul

    N, K, cfg = CASES["small-tiles"]
    if case == "one-chunk":
        cfg = BiGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, CHUNK_K=224, GROUP_M=2)
    w, b, row = _weights(N, K, dtype, bias=True, seed=7)
    w, b = w.to(device), b.to(device)
    outs = _row_in_batches(lambda x: bi_gemm(x.to(device), w, b, config=cfg, split=False, tma=True).cpu(), row,
                           sizes=(1, 3, 16, 33, 70))
    for i, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"variant {i} differs by {(o.float() - outs[0].float()).abs().max()}"
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(8)).to(dtype).to(device)
    tma = bi_gemm(x, w, b, config=cfg, split=False, tma=True)
    pointer = bi_gemm(x, w, b, config=cfg, split=False, tma=False)
    tol = 2 * ULP[dtype] * pointer.abs().max().item() + 1e-5
    torch.testing.assert_close(tma.float(), pointer.float(), rtol=0, atol=tol)
    assert not torch.equal(tma, bi_gemm(x, w, None, config=cfg, split=False, tma=True))   # the bias is added
    gate_up = w[:64]                                    # D = 32: the output's rows 16-byte aligned
    fused = bg.silu_and_mul_bi(x, gate_up, config=dataclasses.replace(cfg, SPLIT_BELOW_TILES=bg.UNSPLIT), tma=True)
    two = silu_and_mul(bi_gemm(x, gate_up, config=cfg, split=False, tma=False))
    torch.testing.assert_close(fused.float(), two.float(), rtol=0, atol=4 * ULP[dtype] * two.abs().max().item() + 1e-5)
    alone = bg.silu_and_mul_bi(x[5:6], gate_up, config=dataclasses.replace(cfg, SPLIT_BELOW_TILES=bg.UNSPLIT),
                               tma=True)
    assert torch.equal(alone[0], fused[5])


def test_tma_is_chosen_only_where_it_applies():
    """uses_tma: the launch's TMA field on a Hopper GPU with 16-byte-aligned operands, or what the caller forces;
    never on the CPU by default (the interpreter runs it only when forced)."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    on = BiGemmConfig(TMA=True)
    assert not bg.uses_tma(on, None, x) and not bg.uses_tma(BiGemmConfig(), None, x)
    assert bg.uses_tma(BiGemmConfig(), True, x) and not bg.uses_tma(on, False, x)
    assert bg.tma_aligned(x) and not bg.tma_aligned(torch.zeros(4, 65, dtype=torch.bfloat16)[:, :64])
    assert not bg.tma_aligned(torch.zeros(4 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 64))
    with pytest.raises(HayabusaValidationError, match="TMA"):
        BiGemmConfig(TMA=1)


def test_bench_bi_gemm_cold_l2_and_gate_up_silu(fresh_config_cache):
    """The bucket sweep as the engine sees it: --cold-l2 times each launch over copies of the weight (2 on CPU,
    the copies equal to the weight); --gate-up-silu times gate_up through engine_launch, whose results are the
    engine's (silu_and_mul_bi's bits for an unsplit launch, bi_gemm + the activation kernel for a split one)."""
    import runpy
    from pathlib import Path

    from hayabusa.kernels.activation import silu_and_mul

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks/kernels/bench_bi_gemm.py"),
                           run_name="bench_bi_gemm")
    x, w, b = bench["make_inputs"](64, 96, 5, False, "cpu")
    copies = bench["cold_copies"](w, "cpu")
    assert len(copies) == 2 and copies[0] is w and torch.equal(copies[1], w) and copies[1].data_ptr() != w.data_ptr()
    cfg = BiGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, CHUNK_K=32)
    two = silu_and_mul(bi_gemm(x, w, config=cfg, split=False))
    for split in (False, True):
        assert torch.equal(bench["engine_launch"](x, w, None, cfg, split, True), two)
    assert torch.equal(bench["engine_launch"](x, w, None, cfg, True, False), bi_gemm(x, w, config=cfg, split=False))
    r = bench["bucket_sweep_shape"](64, 96, False, [1, 20], "cpu", keep_arith=True, cold_l2=True, silu=True)
    assert r["cold_l2"] and r["silu"] and len(r["per_m"]) == 2 and all(t > 0 for t in r["torch_us"])
