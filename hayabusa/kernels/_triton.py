"""Triton, or a stand-in when it is not installed.

The CPU engine runs the plain-torch references that live beside each kernel, so importing a kernel file must not
need Triton. Without Triton, ``triton.jit`` (and ``autotune``/``heuristics``) return the function unchanged and
``tl.constexpr`` etc. are inert placeholders; launching a kernel then fails, which only the CUDA path does.

Under ``TRITON_INTERPRET=1`` (kernels on CPU) importing this module also applies
``fix_interpreter_for_numpy_2_4`` (Triton <= 3.6 with numpy >= 2.4), so a plain script can launch the kernels
there, as their docstrings say.
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



def cdiv(x: int, y: int) -> int:
    """ceil(x / y) of two ints on the host: ``triton.cdiv``'s arithmetic without its constexpr-function call (about
    5 us each in Triton 3.6, measured here; a launch wrapper makes several per launch). Kernels use ``tl.cdiv``."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1) on the host: ``triton.next_power_of_2``'s bit operations, without
    its call cost (see ``cdiv``)."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


def fix_interpreter_for_numpy_2_4() -> bool:
    """Make Triton's CPU interpreter turn a 1-element tensor into an int again (idempotent).

    Triton <= 3.6's interpreter implements ``tensor.__index__`` as ``int(array)``; numpy >= 2.4 refuses that for a
    1-element array that is not 0-d (triton-lang/triton#9171), so every kernel loop such as ``for k0 in
    range(k_start, k_end, BLOCK_K)`` raised ``InterpreterError: TypeError('only 0-dimensional arrays can be
    converted to Python scalars')``. This re-registers ``__index__`` with a squeeze; on a 0-d array it is the same
    value. It changes nothing for compiled (CUDA) kernels. Returns whether the patch is in place (False without
    Triton or without the interpreter's hook).
    """
    if not HAS_TRITON:
        return False
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "_hayabusa_fixed", False):
        return True

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._hayabusa_fixed = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = patched
    return True


def _interpreting() -> bool:
    """Whether TRITON_INTERPRET is on (Triton's knob when it has one, else the variable)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):
        import os

        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if HAS_TRITON and _interpreting():
    fix_interpreter_for_numpy_2_4()

__all__ = ["triton", "tl", "HAS_TRITON", "cdiv", "fix_interpreter_for_numpy_2_4", "next_power_of_2"]
