"""Quantization tests: until hayabusa/kernels/quant_linear.py exists (another change writes it), its torch
stand-in serves the weight-only schemes."""

from __future__ import annotations

import importlib
import sys

try:
    importlib.import_module("hayabusa.kernels.quant_linear")
except ImportError:
    from tests.quantization import _quant_linear_stand_in

    sys.modules["hayabusa.kernels.quant_linear"] = _quant_linear_stand_in
    import hayabusa.kernels

    hayabusa.kernels.quant_linear = _quant_linear_stand_in
