"""Backward-compatible import path: AsyncLLMEngine lives in ``hayabusa.engine.async_llm_engine`` (where vLLM keeps
it). Re-exports only."""

from hayabusa.engine.async_llm_engine import (AsyncEngineArgs, AsyncLLMEngine, EngineDeadError, EngineStepError,
                                              RequestStream, cuda_device_index)

__all__ = ["AsyncLLMEngine", "AsyncEngineArgs", "EngineDeadError", "EngineStepError", "RequestStream",
           "cuda_device_index"]
