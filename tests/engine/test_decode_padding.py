"""The CUDA path pads decode-only steps to a capture size (rows with slot -1 and seq_len 0). The padding logic is
device-independent, so it is checked here on CPU with graphs off: greedy output must not change."""

from __future__ import annotations

from hayabusa import LLM, SamplingParams
from hayabusa.worker.cuda_graph import CUDAGraphRunner, capture_sizes


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(64, [3, 100]) == [3, 64]


import pytest


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_decode_gives_same_greedy_output(tiny_qwen2, example_prompts, async_scheduling):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(tiny_qwen2).generate(example_prompts, params, use_tqdm=False)]
    llm = LLM(tiny_qwen2, max_num_seqs=8, cuda_graph_sizes=[4, 8], async_scheduling=async_scheduling)
    runner = llm.llm_engine.runner
    runner.decode_runner = CUDAGraphRunner.for_runner(runner, use_graphs=False)
    calls = []
    original = runner.decode_runner.run
    runner.decode_runner.run = lambda inp: calls.append(inp.num_reqs) or original(inp)
    padded = [o.outputs[0].token_ids for o in llm.generate(example_prompts, params, use_tqdm=False)]
    assert padded == base
    assert calls and set(calls) >= {7}        # 7 decode rows padded to 8
