"""Errors raised by hayabusa.

Bad input fails at the edge, once, naming the parameter: ``HayabusaValidationError`` is a ``ValueError``
(the OpenAI server maps it to HTTP 400) that carries ``.parameter`` and ``.value``.
"""

from __future__ import annotations

from typing import Any


def is_int(v: Any) -> bool:
    """An integer that is not a bool (True is an int in Python, never a count or a tile size; JSON's true / 4.0 are
    not integers either)."""
    return isinstance(v, int) and not isinstance(v, bool)


class HayabusaValidationError(ValueError):
    """A user-supplied value is invalid.

    Attributes:
        parameter: name of the offending parameter (``"temperature"``, ``"prompt"``, ...).
        value: the value that was rejected.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def prefixed(self, where: str) -> HayabusaValidationError:
        """The same error (class, parameter, value) with ``where: `` before its message, to say which input of
        many it was (``prompts[3]``, ``requests.jsonl:4``)."""
        return type(self)(f"{where}: {self}", parameter=self.parameter, value=self.value)


class HayabusaTypeError(HayabusaValidationError, TypeError):
    """A value of the wrong type, or an unknown keyword: a HayabusaValidationError (so the server answers 400 and
    ``.parameter`` names it) that ``except TypeError`` catches too, as vLLM raises TypeError there."""


class ChatTemplateError(HayabusaValidationError):
    """The chat template failed to parse or to render the messages (``parameter`` names what the caller passed:
    "messages"; a server whose request brought its own template names "chat_template" instead)."""


class KVCacheCapacityError(HayabusaValidationError):
    """The KV cache cannot hold even one sequence of ``max_model_len`` tokens."""


class UnsupportedModelError(HayabusaValidationError):
    """The checkpoint's architecture (or a feature of it) is not supported."""
