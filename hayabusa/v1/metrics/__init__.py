"""vLLM's ``vllm.v1.metrics`` import path: re-exports only (see ``reader``)."""
