"""kernels/pdl.py off the GPU: PDL is never asked for on a CPU device (the interpreter has no grid dependency
control), whatever the switch says; the switch refuses a value that is not one, naming it. On a GPU:
test_pdl_cuda.py."""

from __future__ import annotations

import subprocess
import sys

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
