"""Programmatic dependent launch (PDL) for the decode step's chain of Triton kernels (Hopper, sm90+).

Without it, a kernel in a CUDA stream (or graph) starts only after the one before has finished and flushed, so
every boundary costs the next kernel's launch and ramp-up with the GPU idle: ~1-3 us each, and a 0.5B decode step
is ~290 kernels of ~3.2 us (issue #25; BENCHMARKS.md, "0.5b decode step at batch 1"). With PDL (CUDA programming
guide, "Programmatic Dependent Launch and Synchronization"; Triton's tutorial 11) a kernel launched with the
``launch_pdl`` attribute may be scheduled while the previous one still runs, once every program of that one has
executed ``griddepcontrol.launch_dependents`` (or ended); it must then execute ``griddepcontrol.wait`` (which
returns when the previous grid has completed and its memory is visible) before it touches anything that grid
wrote. ``pdl_wait`` does both at a kernel's start: the boundary's launch latency hides behind the previous
kernel's tail, and nothing is read early, so results are bit-identical with PDL on and off. The small-M linear
(kernels/small_m_linear.py) and the FP8 16-row dot kernel (kernels/fp8_gemv.py) also load their first weight tile
before the wait (weights are never written during a step; CUTLASS's example 63 prefetches weights the same way), so
their weight stream starts during the previous kernel's tail.

Switch: ``HAYABUSA_PDL`` (read at import), on by default since it was measured on an H200 (2026-12-04,
BENCHMARKS.md "Twentieth session" and "Twenty-second session": W3 faster on both shapes with it, the whole engine
CUDA suite green with it and HAYABUSA_SMALL_M_LINEAR on); ``HAYABUSA_PDL=0`` turns it off. It applies on CUDA
devices of compute capability 9.0+ and only to the kernels whose launchers pass
``pdl_kwargs(device)``: fused add + RMSNorm, SiLU-and-mul, fused RoPE + KV write, paged attention and its merge,
the small-M linears (kernels/small_m_linear.py), the weight-only int4 / int8 small-M kernel (kernels/wo_small_m.py),
batch-invariant mode's GEMMs and partial sum (kernels/bi_gemm.py) and, for FP8 / INT8 W8A8, the producers that
quantize their output (kernels/fused_act_quant.py), per_token_quant_fp8 and the FP8 small-M kernels
(kernels/fp8_gemv.py). A kernel that is not among them (cuBLAS, torch's own) runs as before: a PDL kernel after it
waits for it to end, as without PDL.
"""

from __future__ import annotations

import torch

from hayabusa.envs import env_flag
from hayabusa.kernels._triton import HAS_TRITON, tl, triton

PDL_SWITCH = "HAYABUSA_PDL"
USE_PDL = env_flag(PDL_SWITCH, True)   # read per launch through pdl_kwargs (tests change it)

if HAS_TRITON:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # a Triton without grid dependency control: PDL stays off (pdl_kwargs)
        gdc_launch_dependents = gdc_wait = None
else:
    gdc_launch_dependents = gdc_wait = None

HOPPER = (9, 0)   # the compute capability PDL needs, and where the small-M kernels' tables were measured
_CAPABILITY: dict[int, tuple[int, int]] = {}   # device index -> compute capability, asked once


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """At a kernel's start, with PDL: wait until the previous grid has completed (its writes visible), then let
    the next PDL kernel be scheduled. Without PDL: nothing (the branch is compiled out)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: ``HAYABUSA_PDL`` on, a CUDA device of compute capability 9.0+, and a
    Triton with grid dependency control (never in the CPU interpreter)."""
    return USE_PDL and gdc_wait is not None and capability_at_least(device, HOPPER)


def capability_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether ``device`` is a CUDA device of at least this compute capability (False for any other device; the
    capability asked once per device index). PDL's test here, and the small-M kernels' default
    (small_m_linear.small_m_enabled, quant_linear.wo_small_m_enabled)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITY[index] >= capability


def pdl_kwargs(device: torch.device) -> dict:
    """The launch keywords of a PDL-aware kernel (one with a ``PDL: tl.constexpr`` that calls ``pdl_wait(PDL)``
    first): ``{"PDL": True, "launch_pdl": True}`` where pdl_enabled(device), else ``{"PDL": False}``."""
    return _ON if pdl_enabled(device) else _OFF


_ON = {"PDL": True, "launch_pdl": True}     # read-only: spread into launches (one dict, not one per launch)
_OFF = {"PDL": False}


__all__ = ["HOPPER", "PDL_SWITCH", "capability_at_least", "pdl_enabled", "pdl_kwargs", "pdl_wait"]
