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


def test_mixed_graph_sizes_follow_the_flop_budget():
    from hayabusa.worker import cuda_graph
    from hayabusa.worker.cuda_graph import mixed_graph_sizes

    small = mixed_graph_sizes(64, 8192, 100_000_000)            # 2e8 x 2048 x 2 = 4e11 FLOPs: every bucket
    assert sorted({t for _, t in small}) == list(cuda_graph.MIXED_GRAPH_TOKENS)
    assert sorted({b for b, _ in small}) == [1, 2, 4, 8, 16]
    assert len(small) == 5 * len(cuda_graph.MIXED_GRAPH_TOKENS)
    half = mixed_graph_sizes(64, 8192, 390_000_000)             # the 0.5b shape: up to 1,024 tokens
    assert max(t for _, t in half) == 1024
    assert [t for b, t in mixed_graph_sizes(3, 300, 1000) if b == 3] == [64, 128, 256]   # max_num_seqs 3 is a size
    assert {b for b, _ in mixed_graph_sizes(3, 300, 1000)} == {1, 2, 3}
    assert mixed_graph_sizes(16, 8192, 7_000_000_000) == [(b, 64) for b in (1, 2, 4, 8, 16)]
    assert mixed_graph_sizes(16, 8192, 10_000_000_000) == []    # a 10B model: its prefill is GPU-bound


def test_linear_params_per_token_of_a_real_config(tiny_qwen2):
    from hayabusa.worker.cuda_graph import linear_params_per_token

    llm = LLM(tiny_qwen2)
    mc = llm.llm_engine.config.model_config
    hf = mc.hf_config
    expect = hf.num_hidden_layers * (4 * hf.hidden_size ** 2 + 3 * hf.hidden_size * hf.intermediate_size)
    assert linear_params_per_token(mc) == expect > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_mixed_steps_give_same_greedy_output(tiny_qwen2, example_prompts, async_scheduling):
    """Steps with prompt chunks run on a mixed graph's padded (bs, T_pad) shape (here eagerly, graphs off):
    padding tokens, requests without queries, max_query_len = T_pad. Greedy output is unchanged, with chunked
    prefill (max_num_batched_tokens 64) and decode rows in the same steps."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(max_num_seqs=3, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    base = [o.outputs[0].token_ids for o in LLM(tiny_qwen2, **kw).generate(example_prompts, params,
                                                                            use_tqdm=False)]
    llm = LLM(tiny_qwen2, **kw)
    runner = llm.llm_engine.runner
    runner.decode_runner = CUDAGraphRunner.for_runner(runner, use_graphs=False)
    assert runner.decode_runner.mixed_sizes == [(b, 64) for b in (1, 2, 3)]
    sizes = []
    original = runner.decode_runner.run_mixed
    runner.decode_runner.run_mixed = lambda inp: sizes.append(
        (inp.num_reqs, len(inp.input_ids), runner.decode_runner.mixed_size(inp.num_reqs, len(inp.input_ids)))) \
        or original(inp)
    padded = [o.outputs[0].token_ids for o in llm.generate(example_prompts, params, use_tqdm=False)]
    assert padded == base
    assert sizes and all(r <= bs and t <= T_pad for r, t, (bs, T_pad) in sizes)
    assert any(t < T_pad for _, t, (_, T_pad) in sizes)      # some steps really were padded
