"""Sampling: per-step SamplingMetadata and the batched fp32 Sampler."""

from hayabusa.sample.metadata import SamplingMetadata, build_sampling_metadata
from hayabusa.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "build_sampling_metadata"]
