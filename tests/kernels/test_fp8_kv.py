"""FP8 KV cache: store_kv and paged_attention (Triton) vs their torch references with float8_e4m3fn / float8_e5m2
caches and scales != 1, and the reference's error against full-precision attention within a derived bound."""

import math

import pytest
import torch

from hayabusa.kernels.fp8 import FP8_FORMATS, dequantize_fp8_ref, quantize_fp8_ref
from hayabusa.kernels.paged_attention import paged_attention_ref
from hayabusa.kernels.store_kv import store_kv, store_kv_ref

from tests.kernels.test_paged_attention import MIXED, SENTINEL, TOL, make_case, run_both
from tests.kernels.test_store_kv import _fused_kv, _slots

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return 2.0 ** -(FP8_FORMATS[dtype][1] + 1)  # half an ulp, relative: 1/16 (e4m3), 1/8 (e5m2)


def _abs_floor(dtype: torch.dtype) -> float:
    _, mant, emin = FP8_FORMATS[dtype]
    return 2.0 ** (emin - mant - 1)  # half the smallest subnormal: the absolute error near zero


# ------------------------------------------------------------------------------------------------ store_kv
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)])
def test_store_kv_fp8_matches_ref(device, cache_dtype, dtype, k_scale, v_scale):
    """Bit-exact with the torch reference (round to nearest even, saturating), padding rows untouched, and the
    stored value within half an fp8 ulp of x / scale."""
    gen = torch.Generator().manual_seed(0)
    T, H, H_kv, D, num_blocks, block_size = 23, 4, 2, 64, 4, 16
    k, v = _fused_kv(T, H, H_kv, D, torch.float32, "cpu", gen)
    mag = torch.logspace(-5, 3.5, T)[:, None, None]          # rows from tiny (fp8 subnormals) to past the max
    k, v = (k * mag).to(dtype).to(device), (v * mag).to(dtype).to(device)
    slots = _slots(T, num_blocks * block_size, num_pad=3, gen=gen).to(device)
    init = torch.randn(num_blocks, block_size, H_kv, D, generator=gen).to(cache_dtype).to(device)
    kc, vc, kc_ref, vc_ref = (init.clone() for _ in range(4))
    ks = torch.tensor([k_scale], device=device)
    vs = torch.tensor([v_scale], device=device)
    store_kv(k, v, kc, vc, slots, ks, vs)
    store_kv_ref(k, v, kc_ref, vc_ref, slots, ks, vs)
    assert torch.equal(_bits(kc), _bits(kc_ref)) and torch.equal(_bits(vc), _bits(vc_ref))
    keep = slots >= 0
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert torch.equal(_bits(kc).view(-1, H_kv, D)[untouched], _bits(init).view(-1, H_kv, D)[untouched])
    fmax = FP8_FORMATS[cache_dtype][0]
    for x, cache, s in ((k, kc, k_scale), (v, vc, v_scale)):
        want = (x[keep].float() / s).clamp(-fmax, fmax)
        got = cache.view(-1, H_kv, D)[slots[keep]].float()
        bound = _unit_roundoff(cache_dtype) * want.abs() + _abs_floor(cache_dtype)
        assert ((got - want).abs() <= bound).all()
        assert torch.isfinite(got).all()                    # saturated, never inf / NaN


@pytest.mark.parametrize("cache_dtype", FP8)
def test_store_kv_fp8_every_value_and_tie(device, cache_dtype):
    """Every finite fp8 value, every midpoint between neighbours (ties go to the even mantissa) and values past
    the max (saturate), times a scale: the kernel writes the same bits as torch's round-to-nearest-even cast."""
    fmax = FP8_FORMATS[cache_dtype][0]
    allv = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    pos = torch.unique(allv[torch.isfinite(allv) & (allv >= 0)])          # sorted, 0 .. max
    mids = (pos[1:] + pos[:-1]) / 2
    above = torch.tensor([fmax * 1.03, fmax * 1.1, fmax * 4, 1e30])
    xs = torch.cat([pos, mids, above, -pos, -mids, -above])
    s = 0.75
    D = 64
    n = -(-xs.numel() // D) * D
    x = torch.zeros(n)
    x[:xs.numel()] = xs * s
    k = x.view(-1, 1, D).to(device)
    slots = torch.arange(k.shape[0], dtype=torch.int64, device=device)
    caches = [torch.zeros(k.shape[0], 1, 1, D, dtype=cache_dtype, device=device) for _ in range(4)]
    scale = torch.tensor([s], device=device)
    store_kv(k, k, caches[0], caches[1], slots, scale, scale)
    store_kv_ref(k, k, caches[2], caches[3], slots, scale, scale)
    assert torch.equal(_bits(caches[0]), _bits(caches[2]))
    got = caches[0].flatten().float().cpu()[:xs.numel()]
    assert torch.equal(got[:pos.numel()], pos)                 # exact values stay exact
    assert got.abs().max() == fmax and torch.isfinite(got).all()


def test_store_kv_non_fp8_cache_ignores_scales(device):
    gen = torch.Generator().manual_seed(3)
    k, v = _fused_kv(5, 2, 2, 64, torch.float32, device, gen)
    slots = torch.arange(5, dtype=torch.int64, device=device)
    a = [torch.zeros(1, 16, 2, 64, device=device) for _ in range(2)]
    b = [torch.zeros(1, 16, 2, 64, device=device) for _ in range(2)]
    store_kv(k, v, *a, slots, torch.tensor([4.0], device=device), torch.tensor([4.0], device=device))
    store_kv(k, v, *b, slots)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_store_kv_rejects_bad_scale(device):
    k = torch.randn(4, 2, 64, device=device)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn, device=device)
    slots = torch.arange(4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(k, k, cache, cache.clone(), slots, torch.tensor([1.0, 2.0], device=device), None)
    with pytest.raises(ValueError, match="v_scale"):
        store_kv(k, k, cache, cache.clone(), slots, None, torch.tensor([2.0], dtype=torch.float64, device=device))


# ------------------------------------------------------------------------------------------------ paged_attention
def _fp8_case(case: dict, cache_dtype: torch.dtype, k_scale: float, v_scale: float, q_dtype: torch.dtype) -> dict:
    """The case with its caches quantized to fp8 (unused slots stay NaN) and q cast to q_dtype."""
    out = dict(case)
    out["q"] = case["q"].to(q_dtype)
    out["k_cache"] = quantize_fp8_ref(case["k_cache"], k_scale, cache_dtype)  # NaN stays NaN: a bad read shows
    out["v_cache"] = quantize_fp8_ref(case["v_cache"], v_scale, cache_dtype)
    out["k_scale"] = torch.tensor([k_scale], device=case["q"].device)
    out["v_scale"] = torch.tensor([v_scale], device=case["q"].device)
    return out


_run_both = run_both   # (kernel out, ref out), both pre-filled with SENTINEL


def _check(case: dict, **kwargs) -> None:
    out, ref = _run_both(case, **kwargs)
    atol, rtol = TOL[case["q"].dtype]
    valid = int(case["query_start_loc"][-1])
    torch.testing.assert_close(out[:valid].float(), ref[:valid].float(), atol=atol, rtol=rtol)
    assert torch.isfinite(ref[:valid].float()).all()
    assert (out[valid:] == SENTINEL).all()


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_attention_fp8_matches_ref(device, cache_dtype, q_dtype):
    """Mixed decode / prefill / chunked prefill / empty rows, GQA group 7, scales != 1."""
    case = make_case(MIXED, 14, 2, 64, 16, torch.float32, device, q_mult=2.0)
    case["k_cache"] *= 3.0                  # K / k_scale = 60 N(0, 1): up to ~300, near e4m3's max of 448
    _check(_fp8_case(case, cache_dtype, 0.05, 4.0, q_dtype))


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(None, None), (16, None), (None, 5.0)])
def test_paged_attention_fp8_splits_window_softcap(device, cache_dtype, num_kv_splits, window, softcap):
    reqs = [(300, 1), (0, 0), (40, 7), (0, 33)]
    case = _fp8_case(make_case(reqs, 4, 2, 128, 16, torch.float32, device, q_mult=4.0), cache_dtype, 0.5, 0.25,
                     torch.float16)
    _check(case, num_kv_splits=num_kv_splits, sliding_window=window, softcap=softcap)


def _error_bound(q, k, v, scale, cache_dtype, k_scale, v_scale) -> torch.Tensor:
    """Per-element bound on |attention(fp8 K/V) - attention(exact K/V)| for one causal sequence.

    With e(x) = u |x| + a * s (u: unit roundoff, a: half the smallest subnormal, s: the scale) bounding the error
    of one stored value, a query's scores move by at most eps = scale * max_j sum_d |q_d| e(k_jd), so every softmax
    weight changes by a factor within exp(+-2 eps) and sum_j |p'_j - p_j| <= exp(2 eps) - 1. Then
    |o' - o| <= (exp(2 eps) - 1) max_j |v'_j| + max_j e(v_j) per output dim.
    """
    S, H, D = q.shape
    G = H // k.shape[1]
    u, a = _unit_roundoff(cache_dtype), _abs_floor(cache_dtype)
    ek = (u * k.abs() + a * k_scale).repeat_interleave(G, 1)        # [S, H, D]
    ev = (u * v.abs() + a * v_scale).repeat_interleave(G, 1)
    vq = v.abs().repeat_interleave(G, 1) + ev                        # >= |v'|
    causal = torch.ones(S, S, dtype=torch.bool).tril()               # [query, key]
    out = torch.empty(S, H, D)
    for h in range(H):
        err_s = scale * (q[:, h].abs() @ ek[:, h].T)                  # [S, S]
        eps = err_s.masked_fill(~causal, 0).amax(1)                   # [S]
        vmax = torch.stack([vq[: i + 1, h].amax(0) for i in range(S)])       # [S, D] running max over keys
        evmax = torch.stack([ev[: i + 1, h].amax(0) for i in range(S)])
        out[:, h] = (torch.exp(2 * eps) - 1)[:, None] * vmax + evmax
    return out


@pytest.mark.parametrize("cache_dtype", FP8)
def test_ref_fp8_error_vs_full_precision_within_bound(cache_dtype):
    """The reference with fp8 K/V against the same attention on the exact fp32 K/V (one 200-token sequence,
    GQA, random N(0, 1) q and K, V ~ 300 N(0, 1)): every output element within the derived bound (+1e-5 for fp32
    rounding), and the relative RMS error near what one rounding of V gives (half-ulp / sqrt(3): 3.6% e4m3,
    7.2% e5m2): measured 3.6% (e4m3) and 7.1% (e5m2); asserted < 5% / < 10%."""
    S, H, H_kv, D, bs = 200, 4, 2, 32, 16
    case = make_case([(0, S)], H, H_kv, D, bs, torch.float32, "cpu", num_pad_tokens=0)
    k_scale, v_scale = 0.1, 8.0                  # |K| / k_scale, |V| / v_scale stay below e4m3's 448
    case["v_cache"] *= 300.0                      # V beyond e4m3's 448 without the scale: the scale is needed
    pos = torch.arange(S)
    slots = case["block_table"][0, pos // bs].long() * bs + pos % bs
    k = case["k_cache"].view(-1, H_kv, D)[slots]
    v = case["v_cache"].view(-1, H_kv, D)[slots]
    exact = torch.empty_like(case["q"])
    paged_attention_ref(out=exact, **case)
    fp8 = _fp8_case(case, cache_dtype, k_scale, v_scale, torch.float32)
    got = torch.empty_like(case["q"])
    paged_attention_ref(out=got, **fp8)
    err = (got - exact).abs()
    bound = _error_bound(case["q"], k, v, case["scale"], cache_dtype, k_scale, v_scale)
    assert (err <= bound + 1e-5).all(), float((err - bound).max())
    rel_rms = float(err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
    assert rel_rms < {torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.10}[cache_dtype], rel_rms
    # without the scale V saturates at the format's max: e4m3 (448) loses most of it, far outside the bound
    if cache_dtype == torch.float8_e4m3fn:
        unscaled = _fp8_case(case, cache_dtype, k_scale, 1.0, torch.float32)
        bad = torch.empty_like(case["q"])
        paged_attention_ref(out=bad, **unscaled)
        assert float((bad - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()) > 5 * rel_rms
    assert math.isfinite(rel_rms)


def test_dequantize_matches_scale_semantics():
    """read = fp8 * scale, write = fp8(x / scale): a round trip of an fp8-representable x * scale is exact."""
    s = torch.tensor([0.125])
    x = torch.tensor([1.0, -2.5, 448.0, 0.015625]) * s
    q = quantize_fp8_ref(x, s, torch.float8_e4m3fn)
    assert torch.equal(dequantize_fp8_ref(q, s), x)
