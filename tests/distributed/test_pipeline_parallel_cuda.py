"""pipeline_parallel_size on CUDA (NCCL send / recv between stages, the sampled ids broadcast from the last stage;
run on the device): greedy ids equal the one-GPU engine's (float32, eager: a stage runs without CUDA graphs) on
tiny Llama (3 layers: stages of 2 and 1) and GPT-2, two micro-batches in flight (stage 0 runs step N + 1 while
stage 1 runs step N) and seeded n > 1 samples; each stage profiles its own KV capacity (the 1-layer stage has room for about twice the blocks) and the
engine takes the minimum (the reference sizes its cache in bytes); tensor_parallel_size=2 x pipeline_parallel_size=2 on 4 GPUs."""

from __future__ import annotations

import gc

import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import PROMPTS, _build

pytestmark = pytest.mark.cuda

KW = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8, swap_space=0, max_num_batched_tokens=32)
# the one-GPU reference sizes its KV cache in bytes (a GPU fraction would count memory that earlier engines of this
# process still hold); the 2-GPU pipeline engine profiles each stage (worker processes, ended before the reference)
BY_BYTES = dict(kv_cache_memory_bytes=1 << 30)
PROFILED = dict(gpu_memory_utilization=0.3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True, n=2, seed=7)


def _run(path: str, **kw) -> dict:
    llm = LLM(path, **KW, **kw)
    engine = llm.llm_engine
    try:
        got = {"greedy": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)],
               "seeded": [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], SEEDED,
                                                                                   use_tqdm=False)],
               "num_blocks": engine.num_blocks, "in_flight": engine.most_steps_in_flight,
               "per_rank": getattr(engine.runner, "num_blocks_per_rank", None)}
    finally:
        engine.shutdown()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return got


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pp2_equals_one_gpu(arch, tmp_path):
    path = _build(arch, tmp_path / arch, num_layers=3 if arch == "llama" else 2)
    got = _run(path, pipeline_parallel_size=2, **PROFILED)
    ref = _run(path, enforce_eager=True, **BY_BYTES)
    assert all(len(ids) == 24 for ids in got["greedy"])
    assert got["greedy"] == ref["greedy"]
    assert got["seeded"] == ref["seeded"]
    assert got["in_flight"] == 2 and ref["in_flight"] == 0
    per_rank = got["per_rank"]
    assert len(per_rank) == 2 and got["num_blocks"] == min(per_rank)
    if arch == "llama":   # stage 0 holds 2 layers' KV per block, stage 1 one
        assert per_rank[1] > 1.5 * per_rank[0]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_tp2_pp2_equals_one_gpu(tmp_path):
    path = _build("qwen2", tmp_path / "m", num_layers=3)
    got = _run(path, tensor_parallel_size=2, pipeline_parallel_size=2, **BY_BYTES)
    ref = _run(path, enforce_eager=True, **BY_BYTES)
    # 1 GiB over each rank's bytes per block: ranks 0, 1 hold 2 layers, ranks 2, 3 one (1 KV head each)
    assert got["per_rank"][2] == got["per_rank"][3] == 2 * got["per_rank"][0] == 2 * got["per_rank"][1]
    assert got["in_flight"] == 2
    assert got["greedy"] == ref["greedy"]
    assert got["seeded"] == ref["seeded"]
