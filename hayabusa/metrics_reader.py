"""``LLM.get_metrics()``'s answer in vLLM's shape (``vllm/v1/metrics/reader.py``): a list of ``Metric`` objects,
``Counter`` (int value), ``Gauge`` (float value), ``Vector`` (list of int values: the only one is
``vllm:spec_decode_num_accepted_tokens_per_pos``) and ``Histogram``, named as vLLM names them (``vllm:`` prefix, no
``_total``; hayabusa's own counters under ``hayabusa:``, as on the server's /metrics).

A script written for vLLM imports them from ``hayabusa.v1.metrics.reader`` (vLLM's module path) or from here.

``MetricsList`` is that list and, as hayabusa's shorthand from before, also a read-only mapping of the engine's
counters by their plain keys (``m["spec_decode_num_accepted_tokens"]``, ``m.get(key)``, ``key in m``, ``m.keys()``,
``m.items()``); iterating it yields the Metric objects, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ItemsView, Iterable, KeysView, Union, ValuesView


@dataclass
class Metric:
    """One metric: its name (``vllm:...`` or ``hayabusa:...``) and its labels (``model_name``, ``engine``)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter (since the engine started)."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's one use: ``vllm:spec_decode_num_accepted_tokens_per_pos``,
    element i = how many times the proposal at position i was accepted)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down, read when ``get_metrics`` is called."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: ``buckets`` maps each bucket's upper limit (as a string, ``"+Inf"`` always
    present) to its count; ``count`` = the ``"+Inf"`` bucket's count; ``sum`` = the sum of the observed values."""

    count: int
    sum: float
    buckets: dict[str, int]


ShorthandValue = Union[int, float, list]


class MetricsList(list):
    """``list[Metric]`` (vLLM's ``get_metrics()`` answer) that also answers hayabusa's older dict form.

    A plain-string key reads the shorthand mapping (``num_prompt_tokens``, ``num_generation_tokens``,
    ``num_preemptions``, the CPU tier's and speculative decoding's counters: see ``LLMEngine.get_metrics``);
    an int or a slice indexes the list. ``in`` with a string asks the mapping, with anything else the list.
    ``keys()`` / ``values()`` / ``items()`` / ``get()`` / ``as_dict()`` are the mapping's. Iteration, ``len``
    and ``==`` are the list's.

    Args:
        metrics: the Metric objects, in order.
        shorthand: plain key -> value (int counters; ``spec_decode_num_accepted_tokens_per_pos`` a list of int).
    """

    def __init__(self, metrics: Iterable[Metric] = (), shorthand: dict[str, ShorthandValue] | None = None) -> None:
        super().__init__(metrics)
        self._shorthand: dict[str, ShorthandValue] = dict(shorthand or {})

    def __getitem__(self, key: Any) -> Any:
        """``m["key"]``: the shorthand value (KeyError naming the key and the keys there are); ``m[i]``, ``m[a:b]``:
        the list's."""
        if isinstance(key, str):
            try:
                return self._shorthand[key]
            except KeyError:
                raise KeyError(f"{key!r}: no such metric key here; keys: {sorted(self._shorthand)} "
                               "(iterate get_metrics() for the Metric objects)") from None
        return super().__getitem__(key)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, str):
            return item in self._shorthand
        return super().__contains__(item)

    def get(self, key: str, default: Any = None) -> Any:
        """The shorthand value of ``key``, or ``default``."""
        return self._shorthand.get(key, default)

    def keys(self) -> KeysView[str]:
        return self.as_dict().keys()

    def values(self) -> ValuesView[ShorthandValue]:
        return self.as_dict().values()

    def items(self) -> ItemsView[str, ShorthandValue]:
        return self.as_dict().items()

    def as_dict(self) -> dict[str, ShorthandValue]:
        """A copy of the shorthand mapping (plain key -> value)."""
        return dict(self._shorthand)

    def by_name(self, name: str) -> Metric:
        """The first Metric named ``name`` (e.g. ``"vllm:prompt_tokens"``); KeyError when there is none."""
        for metric in self:
            if metric.name == name:
                return metric
        raise KeyError(f"{name!r}: no such metric; names: {[m.name for m in self]}")
