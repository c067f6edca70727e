"""Triton, or a stand-in when it is not installed.

The CPU engine runs the plain-torch references that live beside each kernel, so importing a kernel file must not
need Triton. Without Triton, ``triton.jit`` (and ``autotune``/``heuristics``) return the function unchanged and
``tl.constexpr`` etc. are inert placeholders; launching a kernel then fails, which only the CUDA path does.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install
    HAS_TRITON = False

    class _Missing:
        """Any attribute is another placeholder; calling one with a single function returns that function."""

        def __getattr__(self, name: str) -> "_Missing":
            return _Missing()

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return _Missing()

    triton = _Missing()  # type: ignore[assignment]
    tl = _Missing()  # type: ignore[assignment]

__all__ = ["triton", "tl", "HAS_TRITON"]
