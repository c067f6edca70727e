"""On a GPU: mixed-step CUDA graphs (worker/cuda_graph.py: steps with prompt chunks replayed on a (bs, T_pad)
shape). Greedy output equals enforce_eager's (the same padded shapes run eagerly: bit-identical) and, in float32,
equals the unpadded eager steps' (mixed graphs off); the graphs are replayed; the KV cache returns to empty."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from hayabusa import LLM, SamplingParams

pytestmark = pytest.mark.cuda


def _prompts(n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"prompt_token_ids": rng.integers(100, 10000, size=int(rng.integers(8, 700))).tolist()}
            for _ in range(n)]


def _run(model_dir: str, mixed: bool = True, **kwargs) -> tuple[list[list[int]], int]:
    from hayabusa.worker import cuda_graph

    old = cuda_graph.USE_MIXED_GRAPHS
    cuda_graph.USE_MIXED_GRAPHS = mixed
    try:
        llm = LLM(model_dir, kv_cache_memory_bytes=2 << 30, max_num_seqs=4, max_model_len=1024,
                  skip_tokenizer_init=True, **kwargs)
    finally:
        cuda_graph.USE_MIXED_GRAPHS = old
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(_prompts(12), params, use_tqdm=False)]
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    runs = engine.runner.decode_runner.num_mixed_runs
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return outs, runs


def test_mixed_graphs_equal_eager_on_the_same_shapes(q05_dir):
    graphs, runs = _run(q05_dir)
    eager, eager_runs = _run(q05_dir, enforce_eager=True)
    assert runs > 0 and eager_runs == runs          # admission steps of <= 1,024 tokens
    assert all(len(o) == 24 for o in graphs)
    same = sum(a == b for a, b in zip(eager, graphs))
    assert same == len(eager), f"{len(eager) - same} of {len(eager)} sequences differ"


def test_mixed_graphs_on_off_same_greedy_in_float32(q05_dir):
    on, runs = _run(q05_dir, dtype="float32")
    off, off_runs = _run(q05_dir, mixed=False, dtype="float32")
    assert runs > 0 and off_runs == 0
    same = sum(a == b for a, b in zip(on, off))
    assert same == len(on), f"{len(on) - same} of {len(on)} sequences differ"
