"""vLLM v1's import paths (``vllm.v1...``), for scripts converted by changing the import: re-exports only."""
