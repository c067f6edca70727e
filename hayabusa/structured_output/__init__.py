"""Structured outputs: grammars compiled by xgrammar (a cache, a small thread pool) and the per-step token bitmask
of the constrained requests; the runner applies the bitmask to the logits (``hayabusa.sample.bitmask``)."""

from hayabusa.structured_output.manager import (StructuredOutputManager, StructuredOutputRequest, fill_bitmask,
                                                grammar_key)

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "fill_bitmask", "grammar_key"]
