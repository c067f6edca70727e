"""Verify steps on the padded (batch, k + 1) shapes of the CUDA graphs (worker/cuda_graph.py), run eagerly on the
CPU with the torch attention reference: the padding (tokens in no request, requests without queries) changes no
token. The graphs themselves: tests/spec_decode/test_spec_graphs_cuda.py."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.worker.cuda_graph import CUDAGraphRunner
from tests.spec_decode.test_spec_engine import PROMPTS, OracleProposer, _ids


def test_pad_verify_makes_the_rest_padding():
    import torch

    from hayabusa.worker.step_buffers import StepBuffers

    buf = StepBuffers(16, 4, 3, torch.device("cpu"))
    for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens):
        t.fill_(7)
    buf.query_start_loc.copy_(torch.tensor([0, 2, 5, 9, 11]))
    buf.pad_verify(5, 2, 4, 12)            # 2 requests, 5 tokens -> the (4, 3) shape: 12 tokens
    assert buf.query_start_loc.tolist() == [0, 2, 5, 5, 5]          # requests 2, 3: no queries
    assert buf.seq_lens.tolist() == [7, 7, 0, 0]
    assert buf.slot_mapping[:5].tolist() == [7] * 5 and buf.slot_mapping[5:12].tolist() == [-1] * 7
    assert buf.input_ids[5:12].tolist() == [0] * 7 == buf.positions[5:12].tolist()
    assert buf.input_ids[12:].tolist() == [7] * 4                   # past T_pad: untouched


@pytest.mark.parametrize("max_num_seqs, cap", [(16, 4)])
def test_padded_verify_shapes_keep_greedy_output(tiny_qwen2, max_num_seqs, cap):
    # requests end at different steps: later steps have fewer requests than the rows the buffers held before
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    prompts = PROMPTS[:3] if cap else PROMPTS     # with the cap: 3 requests (then 2, 1), padded to the size 4
    params = params[:len(prompts)]
    base = LLM(tiny_qwen2, device="cpu", max_num_seqs=16).generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": cap, "min_acceptance_rate": 0}
    llm = LLM(tiny_qwen2, device="cpu", max_num_seqs=max_num_seqs, speculative_config=spec)
    runner = llm.llm_engine.runner
    runner.decode_runner = CUDAGraphRunner.for_runner(runner, use_graphs=False)   # the graphs' padded shapes, eagerly
    assert runner.decode_runner.verify_width == 4
    if cap:   # no step has proposals above disable_by_batch_size: sizes up to the first one >= it
        assert runner.decode_runner.verify_sizes == [1, 2, 4]
    llm.llm_engine.scheduler.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids
                                                             for o in base])
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(base)
    assert runner.decode_runner.num_verify_runs > 0 and runner.decode_runner.num_verify_replays == 0
    m = llm.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
