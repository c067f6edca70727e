"""kernels/pdl.py off the GPU: PDL is never asked for on a CPU device (the interpreter has no grid dependency
control), whatever the switch says; the switch refuses a value that is not one, naming it; and every PDL-aware
kernel, run in the interpreter with its PDL branch taken (the two grid-dependency instructions stubbed), gives the
bits it gives without (the small-M and FP8 dot kernels' first weight tile loaded before the wait, their loops
peeled). On a GPU, with the real instructions: test_pdl_cuda.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hayabusa.kernels.pdl as pdl


def test_never_on_a_cpu_device(monkeypatch):
    monkeypatch.setattr(pdl, "USE_PDL", True)
    assert pdl.pdl_enabled(torch.device("cpu")) is False
    assert pdl.pdl_kwargs(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "USE_PDL", False)
    assert pdl.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": False}     # off: no device query at all


def test_the_pdl_aware_kernels_give_the_same_bits_with_the_flag_passed_off(device):
    """PDL=False (what every launcher passes off a Hopper GPU) is the kernel as before: SiLU-and-mul through its
    launcher equals its reference bit for bit on values where both round the same way."""
    from hayabusa.kernels.activation import silu_and_mul, silu_and_mul_ref

    x = torch.randn(3, 64, dtype=torch.float32, device=device)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), rtol=1e-6, atol=1e-6)


def test_switch_garbage_is_refused_naming_it():
    code = "import hayabusa.kernels.pdl"
    r = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "HAYABUSA_PDL": "sometimes"},
                       capture_output=True, text=True)
    assert r.returncode != 0 and "HAYABUSA_PDL='sometimes'" in r.stderr


@pytest.mark.parametrize("value, expected", [(None, "True"), ("0", "False"), ("1", "True")])
def test_on_by_default_and_zero_turns_it_off(value, expected):
    """Unset means on (measured on an H200, BENCHMARKS.md); HAYABUSA_PDL=0 turns it off."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "HAYABUSA_PDL"}
    if value is not None:
        env["HAYABUSA_PDL"] = value
    r = subprocess.run([sys.executable, "-c", "import hayabusa.kernels.pdl as p; print(p.USE_PDL)"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == expected, r.stderr


# ------------------------------------------------------------------------------ every PDL-aware kernel, PDL taken
import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401  (the interpreter wants it visible from jit functions)

PDL_MODULES = ("activation", "fused_norm", "rope_store_kv", "paged_attention", "small_m_linear", "fused_act_quant",
               "fp8_quant", "fp8_gemv", "bi_gemm")


_STUB_CALLS: list[int] = []


@triton.jit
def _no_grid_dependency_control():
    _STUB_CALLS.append(1)      # interpreter only: a jit function runs as Python there


def _run_both(monkeypatch, fn):
    """fn() with every PDL-aware launcher passing PDL=False, then PDL=True with the grid-dependency instructions
    stubbed as no-ops (the interpreter has none; on a GPU they only change when programs are scheduled): the
    kernels' PDL branches run, the small-M linear's first weight tile loaded before the wait and its loop peeled."""
    import importlib

    off = fn()
    monkeypatch.setattr(pdl, "gdc_wait", _no_grid_dependency_control)
    monkeypatch.setattr(pdl, "gdc_launch_dependents", _no_grid_dependency_control)
    for name in PDL_MODULES:
        monkeypatch.setattr(importlib.import_module(f"hayabusa.kernels.{name}"), "pdl_kwargs",
                            lambda device: {"PDL": True})
    return off, fn()


def _assert_same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif a is None:
        assert b is None
    else:
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b)


def test_every_pdl_kernel_gives_the_same_bits_with_its_pdl_branch(device, monkeypatch):
    if device != "cpu":
        pytest.skip("the interpreter's check; on a GPU test_pdl_cuda.py runs the real instructions")
    from hayabusa.kernels.activation import silu_and_mul
    from hayabusa.kernels.bi_gemm import UNSPLIT, BiGemmConfig, bi_gemm, silu_and_mul_bi
    from hayabusa.kernels.fp8_gemv import fp8_small_m_linear
    from hayabusa.kernels.fp8_quant import per_token_quant_fp8, per_token_quant_fp8_ref
    from hayabusa.kernels.fused_act_quant import rms_norm_quant, silu_and_mul_quant
    from hayabusa.kernels.fused_norm import fused_add_rms_norm
    from hayabusa.kernels.paged_attention import paged_attention
    from hayabusa.kernels.quant_linear import LaunchConfig
    from hayabusa.kernels.rope_store_kv import rope_and_store_kv
    from hayabusa.kernels.quant_ref import quantize_int4_grouped, quantize_int8_per_channel
    from hayabusa.kernels.small_m_linear import small_m_linear, small_m_silu_linear
    from hayabusa.kernels.wo_small_m import wo_small_m_linear
    from tests.kernels.test_paged_attention import make_case
    from tests.kernels.test_rope_store_kv import _case, _run

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(5, 104, generator=g).to(bf).to(device)
    res = torch.randn(5, 104, generator=g).to(bf).to(device)
    nw = (torch.rand(104, generator=g) + 0.5).to(bf).to(device)
    w = (torch.randn(72, 104, generator=g) / 10).to(bf).to(device)
    b = torch.randn(72, generator=g).to(bf).to(device)
    wq, sw = per_token_quant_fp8_ref(torch.randn(72, 104, generator=g) / 10)
    wq, sw = wq.to(device), sw.view(-1).contiguous().to(device)
    gu = torch.randn(5, 2 * 104, generator=g).to(bf).to(device)
    q8, s8 = (t.to(device) for t in quantize_int8_per_channel(w))
    x128 = torch.randn(5, 128, generator=g).to(bf).to(device)
    q4, s4, z4 = (t.to(device) for t in quantize_int4_grouped((torch.randn(72, 128, generator=g) / 10).to(bf), 128))
    split = LaunchConfig("dot", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=2)
    whole = LaunchConfig("dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)
    gemv = LaunchConfig("gemv", BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=1)
    bi_cfg = BiGemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, CHUNK_K=64, SPLIT_BELOW_TILES=UNSPLIT)
    attn = make_case([(5, 1), (30, 1), (0, 3)], 4, 2, 64, 16, bf, device)
    rope = _case(4, 2, 64, 11, bf, bf, 2, 16, device)

    def attention(splits):
        out = torch.zeros_like(attn["q"])
        paged_attention(out=out, **attn, num_kv_splits=splits)
        return out

    cases = {
        "silu_and_mul": lambda: silu_and_mul(gu),
        "fused_add_rms_norm": lambda: fused_add_rms_norm(x, res, nw, 1e-6),
        "rope_and_store_kv": lambda: _run(rope_and_store_kv, rope, 4, 2, 64, (None, None)),
        "paged_attention": lambda: attention(1),
        "paged_attention_split_merge": lambda: attention(3),
        "small_m_split": lambda: small_m_linear(x, w, b, cfg=split),
        "small_m_whole": lambda: small_m_linear(x, w, b, cfg=whole),
        "small_m_silu": lambda: small_m_silu_linear(x, w, cfg=whole),        # gate_up + SiLU-and-mul, D = 36
        "per_token_quant_fp8": lambda: per_token_quant_fp8(x),
        "rms_norm_quant": lambda: rms_norm_quant(x, res, nw, 1e-6, "fp8"),
        "silu_and_mul_quant": lambda: silu_and_mul_quant(gu, "fp8"),
        "silu_and_mul_quant_rows": lambda: silu_and_mul_quant(torch.cat([gu] * 4), "int8"),   # 20 rows: one launch
        "fp8_dot_xq": lambda: fp8_small_m_linear(*per_token_quant_fp8(x)[:1], wq, sw, b, cfg=split,
                                                 x_scale=per_token_quant_fp8(x)[1]),
        "fp8_dot_plain": lambda: fp8_small_m_linear(x, wq, sw, b, cfg=split),
        "fp8_gemv": lambda: fp8_small_m_linear(x, wq, sw, b, cfg=gemv),
        "wo_small_m_int8": lambda: wo_small_m_linear(x, q8, s8, None, None, b, cfg=split),
        "wo_small_m_int4": lambda: wo_small_m_linear(x128, q4, s4, z4, 128, b),
        "bi_gemm_split": lambda: bi_gemm(x, w, b, config=bi_cfg, split=True),      # and its partial-sum kernel
        "bi_gemm_unsplit": lambda: bi_gemm(x, w, b, config=bi_cfg, split=False),
        "bi_gemm_silu": lambda: silu_and_mul_bi(x, w, config=bi_cfg),             # gate_up + SiLU-and-mul, D = 36
    }
    _STUB_CALLS.clear()
    off, on = _run_both(monkeypatch, lambda: {k: f() for k, f in cases.items()})
    assert len(_STUB_CALLS) > 2 * len(cases)          # every launch of the second pass took its PDL branch
    for k in cases:
        _assert_same(off[k], on[k])
