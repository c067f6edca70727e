"""vLLM's import path for the async engine: ``from hayabusa.engine.async_llm_engine import AsyncLLMEngine``
(the same class as ``hayabusa.AsyncLLMEngine``, defined in hayabusa.entrypoints.async_engine)."""

from hayabusa.entrypoints.async_engine import AsyncEngineArgs, AsyncLLMEngine

__all__ = ["AsyncLLMEngine", "AsyncEngineArgs"]
