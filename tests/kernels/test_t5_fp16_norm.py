"""kernels/t5_fp16_norm.py (T5 in fp16: residual add + transformers' clamp + T5LayerNorm in one launch) against the
torch path it replaces, ``model/t5.py``'s ``_add_norm`` fp16 branch (the switch off): the new residual bit for bit,
normed within one fp16 ulp (the fp32 sum of squares is reduced in another order). CUDA, or the Triton interpreter
on CPU. ``tests/models/test_t5_fp16_norm_cuda.py`` runs these on a GPU and the engine's greedy ids on / off."""

from __future__ import annotations

import pytest
import torch

from hayabusa.kernels.t5_fp16_norm import t5_fp16_add_norm_ref
from tests.kernels.conftest import DEVICE

F16 = torch.float16
SHAPES = [(1, 512), (300, 768), (37, 333), (129, 512), (2, 768)]
CASES = ["fp32_residual", "fp32_delta", "fp32_both", "fp16_no_inf", "fp16_inf", "none_fp16", "none_fp16_inf",
         "none_fp32"]


def make_inputs(case: str, T: int, d: int, device: str, seed: int = 0):
    """(delta, residual, weight) of one case. The fp16 cases put values in (64512, 65504] (clamped only once an inf
    is present anywhere) in the middle row; the "_inf" cases make the sum of the last row overflow to inf, in some
    other row than those values when T > 1 (the clamp's condition is global), and add a NaN (kept by the clamp)."""
    g = torch.Generator().manual_seed(seed)
    delta_dtype = torch.float32 if case in ("fp32_delta", "fp32_both", "none_fp32") else F16
    res_dtype = torch.float32 if case in ("fp32_residual", "fp32_both") else F16
    delta = (torch.randn(T, d, generator=g) * 3).to(delta_dtype)
    residual = None if case.startswith("none") else (torch.randn(T, d, generator=g) * 30).to(res_dtype)
    weight = (torch.rand(d, generator=g) * 2 - 0.5).to(F16)
    fp16 = case in ("fp16_no_inf", "fp16_inf", "none_fp16", "none_fp16_inf")
    if fp16:
        big = torch.tensor([64992.0, -64800.0, 64608.0, 65504.0])   # fp16 values past the lowered limit (64512)
        m = T // 2
        if residual is None:
            delta[m, :4] = big.to(F16)
        else:
            residual[m, :4] = (big - big.sign() * 32).to(F16)                # exact fp16 sums
            delta[m, :4] = (big.sign() * 32).to(F16)
    if case == "fp16_inf":
        residual[-1, 5], delta[-1, 5] = 60000.0, 60000.0       # fp16 sum 120000 -> inf
        residual[-1, 6], delta[-1, 6] = -60000.0, -30000.0     # -> -inf
        if T > 2:
            residual[0, 1] = float("nan")
    if case == "none_fp16_inf":
        delta[-1, 3] = float("inf")
    return delta.to(device), (None if residual is None else residual.to(device)), weight.to(device)


# the torch path the kernel replaces: model/t5.py's _add_norm runs it wherever the kernel is off (CPU included)
torch_path = t5_fp16_add_norm_ref


def fp16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the fp16 ulp at max(|a|, |b|) (NaNs must coincide; 0 where both are NaN)."""
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a.float().nan_to_num(0.0), b.float().nan_to_num(0.0)
    mag = torch.maximum(a.abs(), b.abs()).clamp(min=2.0 ** -14)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 10)
    return float(((a - b).abs() / ulp).max()) if a.numel() else 0.0


def within_one_ulp_before_the_weight(out: torch.Tensor, res: torch.Tensor, weight: torch.Tensor, eps: float
                                     ) -> torch.Tensor:
    """[T, d] bool: out = weight * n rounded to fp16 for n the torch path's fp16 normalized value of the residual
    res (x * rsqrt(mean(x^2) + eps), cast to fp16) or one of its two fp16 neighbours. (One ulp of n can be two ulps
    of the product once the weight scales it, so this is the precise form of "within one fp16 ulp".)"""
    xf = res.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(F16).cpu()    # on res's device, as the path
    out, weight = out.cpu(), weight.cpu()
    ok = out.isnan() & n.isnan()
    for cand in (n, torch.nextafter(n, torch.full_like(n, float("inf"))),
                 torch.nextafter(n, torch.full_like(n, float("-inf")))):
        ok |= (weight.float() * cand.float()).to(F16) == out
    return ok


def check_case(case: str, T: int, d: int, device: str, eps: float = 1e-6, seed: int = 0) -> float:
    """Kernel vs the torch path on one case: the residual exactly; normed: the fp16 normalized value (before the
    weight) within one fp16 ulp of the torch path's. Returns the output's max difference in fp16 ulps. The flag and
    counter are zero again after the launch."""
    from hayabusa.kernels.t5_fp16_norm import _SYNC, t5_fp16_add_norm

    delta, residual, weight = make_inputs(case, T, d, device, seed)
    out, res = t5_fp16_add_norm(delta, residual, weight, eps)
    ref_out, ref_res = torch_path(delta, residual, weight, eps)
    assert out.dtype == F16 and out.shape == (T, d)
    assert res.dtype == ref_res.dtype and res.shape == (T, d)
    assert torch.equal(res.isnan(), ref_res.isnan())
    assert torch.equal(res.nan_to_num(0.0), ref_res.nan_to_num(0.0)), case     # bit for bit (finite after clamp)
    if case == "none_fp32":
        assert res is delta                                                  # the stream is delta itself
    assert torch.equal(within_one_ulp_before_the_weight(ref_out, ref_res, weight, eps),
                       torch.ones(T, d, dtype=torch.bool))                  # the check's own premise
    ok = within_one_ulp_before_the_weight(out, res, weight, eps)
    assert bool(ok.all()), (case, T, d, int((~ok).sum()))
    ulps = fp16_ulps(out, ref_out)
    assert ulps <= 2.0, (case, T, d, ulps)
    for sync in _SYNC.values():
        assert sync.tolist() == [0, 0]
    return ulps


@pytest.mark.parametrize("T,d", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_torch_path(device, case, T, d):
    check_case(case, T, d, device)


def test_the_clamp_is_global_and_the_flag_resets(device):
    """An inf in one row lowers the limit of every row (the middle row's 64992 becomes 64512 there), and the next
    call without an inf does not clamp (the flag and counter are back at zero); the hand-computed values."""
    from hayabusa.kernels.t5_fp16_norm import FP16_CLAMP_INF, t5_fp16_add_norm

    assert FP16_CLAMP_INF == 64512.0
    for case, expect in (("fp16_inf", 64512.0), ("fp16_no_inf", 64992.0), ("fp16_inf", 64512.0)):
        delta, residual, weight = make_inputs(case, 5, 512, device)
        _, res = t5_fp16_add_norm(delta, residual, weight, 1e-6)
        assert float(res[2, 0]) == expect
        assert float(res[2, 3]) == (64512.0 if case == "fp16_inf" else 65504.0)
        if case == "fp16_inf":
            assert res[-1, 5] == 64512.0 and res[-1, 6] == -64512.0 and res.isfinite().sum() == res.numel() - 1
        check_case(case, 5, 512, device)


def test_reference_is_transformers_ops():
    """t5_fp16_add_norm_ref (the launcher's fallback and _add_norm's torch branch) is transformers' T5 in fp16 bit
    for bit: T5Block's clamp of an fp16 sum (finfo.max - 1000 once an inf is present anywhere), then T5LayerNorm
    with fp16 weights."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm as HFT5LayerNorm

    for case in CASES:
        delta, residual, weight = make_inputs(case, 9, 96, "cpu")
        out, res = t5_fp16_add_norm_ref(delta, residual, weight, 1e-6)
        x = delta if residual is None else residual + delta
        if x.dtype == F16:
            limit = torch.where(torch.isinf(x).any(), torch.finfo(F16).max - 1000, torch.finfo(F16).max)
            x = torch.clamp(x, min=-limit, max=limit)
        hf = HFT5LayerNorm(96, eps=1e-6).to(F16)
        hf.weight.data.copy_(weight)
        with torch.no_grad():
            want = hf(x)
        assert torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0)), case
        assert torch.equal(res.nan_to_num(0.0), x.nan_to_num(0.0)) and res.dtype == x.dtype, case
def test_bad_inputs_name_the_parameter(device):
    from hayabusa.errors import HayabusaValidationError
    from hayabusa.kernels.t5_fp16_norm import t5_fp16_add_norm

    delta, residual, weight = make_inputs("fp16_no_inf", 4, 64, device)
    bad = [((delta[None], residual, weight), "delta"), ((delta.to(torch.bfloat16), residual, weight), "delta"),
           ((delta, residual[:3], weight), "residual"), ((delta, residual.to(torch.bfloat16), weight), "residual"),
           ((delta, residual, weight.float()), "weight"), ((delta, residual, weight[:8]), "weight"),
           ((delta.t(), residual, weight), "delta")]
    for args, name in bad:
        with pytest.raises(HayabusaValidationError) as e:
            t5_fp16_add_norm(*args, 1e-6)
        assert e.value.parameter == name and isinstance(e.value, ValueError)


def test_empty_batch(device):
    from hayabusa.kernels.t5_fp16_norm import t5_fp16_add_norm

    delta, residual, weight = make_inputs("fp16_no_inf", 1, 64, device)
    out, res = t5_fp16_add_norm(delta[:0], residual[:0], weight, 1e-6)
    assert out.shape == (0, 64) and res.shape == (0, 64) and res.dtype == F16
