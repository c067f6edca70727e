"""vLLM's import path for the engine arguments: ``from hayabusa.engine.arg_utils import AsyncEngineArgs, EngineArgs``
(the same classes as ``hayabusa.EngineArgs`` / ``hayabusa.AsyncEngineArgs``)."""

from hayabusa.config import EngineArgs
from hayabusa.engine.async_llm_engine import AsyncEngineArgs

__all__ = ["EngineArgs", "AsyncEngineArgs"]
