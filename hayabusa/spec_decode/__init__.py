"""Speculative decoding: proposers that fill a request's speculative tokens (n-gram / prompt lookup), the config
(vLLM's ``speculative_config`` keys) and the scheduler-side rule of which requests get proposals. The rejection
sampler that verifies proposals lives in ``hayabusa/sample/rejection_sampler.py``."""

from hayabusa.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
