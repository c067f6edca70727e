"""Triton kernels, one op per file: `_op_kernel`, an `op()` launcher that checks its inputs, and `op_ref()` in
plain torch (the CPU engine's path). Importing a kernel file does not need Triton (see `_triton.py`)."""
