"""Kernel tests run on CUDA when present, else under the Triton interpreter on CPU.

TRITON_INTERPRET is read when @triton.jit decorates a function, including triton's own (tl.max, tl.cdiv, ...),
so on CPU it must be set before anything imports triton. It is set here, which is early enough when only this
directory runs or nothing before it imported triton; otherwise (the CPU engine imports hayabusa.kernels for the
*_ref functions) set it at the top of tests/conftest.py, else these tests skip with that reason.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Qwen2.5-7B's linear layers, (K, N): the real shapes of the quantized-linear CUDA tests
QWEN_7B = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}


def _kernels_usable() -> str | None:
    """None if the Triton kernels can run here, else the reason to skip."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if DEVICE == "cpu":
        from triton import knobs

        if not knobs.runtime.interpret:
            return "no CUDA device and TRITON_INTERPRET is not 1"
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.max, InterpretedFunction):  # triton's own @jit helpers were built uninterpreted
            return "triton was imported before TRITON_INTERPRET=1 was set: set it at the top of tests/conftest.py"
    return None


def _fix_interpreter_dot_row_invariance() -> None:
    """The interpreter's tl.dot is one np.matmul of the tile, and OpenBLAS's sgemm (numpy 2.4.6's 0.3.31) sums a
    row's products in an order that depends on the tile's other rows (small-matrix and edge kernels), so a row of a
    [1, K] x [K, N] dot and the same row inside [16, K] x [K, N] could differ in the last bit. A GPU's tensor-core
    dot computes each output from its own row and column only, which the batch-invariant kernels rely on. So float
    tiles are multiplied in float64 (every product and partial sum of bf16 / fp16 / fp32 inputs over K <= 2^20 fits,
    so the result is the exact dot product up to one fp64 rounding), then rounded once to the accumulator's dtype."""
    import numpy as np
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_hayabusa_fixed", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.is_floating() and b.dtype.is_floating() and d.data.dtype == np.float32):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:   # fp8 operands: as the original
            a_data = interp._convert_float(a_data, a.dtype, interp.tl.float16, None).view(np.float16)
            b_data = interp._convert_float(b_data, b.dtype, interp.tl.float16, None).view(np.float16)
        prod = np.matmul(a_data.astype(np.float64), b_data.astype(np.float64)).astype(np.float32)
        return interp.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._hayabusa_fixed = True
    builder.create_dot = create_dot


SKIP_REASON = _kernels_usable()
if SKIP_REASON is None and DEVICE == "cpu":
    from hayabusa.kernels._triton import fix_interpreter_for_numpy_2_4

    fix_interpreter_for_numpy_2_4()   # importing a kernel applies it too; here before any test module imports one
    _fix_interpreter_dot_row_invariance()


@pytest.fixture
def device() -> str:
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    return DEVICE
