"""vLLM's import path for ``LLM.get_metrics()``'s metric types: ``from hayabusa.v1.metrics.reader import Counter,
Vector`` (the same classes as ``hayabusa.metrics_reader``'s)."""

from hayabusa.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Metric", "Counter", "Gauge", "Vector", "Histogram"]
