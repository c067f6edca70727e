"""hayabusa: a fast LLM inference engine (PyTorch + Triton) with a vLLM-compatible API.

    from hayabusa import LLM, SamplingParams
"""

from hayabusa.config import EngineArgs
from hayabusa.engine.llm_engine import LLMEngine
from hayabusa.engine.async_llm_engine import AsyncEngineArgs, AsyncLLMEngine
from hayabusa.entrypoints.llm import LLM
from hayabusa.errors import HayabusaValidationError
from hayabusa.inputs import PromptType, TextPrompt, TokensPrompt
from hayabusa.outputs import CompletionOutput, Logprob, RequestOutput
from hayabusa.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs",
           "LLMEngine", "AsyncLLMEngine", "AsyncEngineArgs", "PromptType", "TextPrompt", "TokensPrompt",
           "HayabusaValidationError", "__version__"]
