"""On a GPU (issue #17, W9's host cuts): T5 under async scheduling with requests admitted and finished while others
decode (rows move, so decode inputs sampled by the previous step are placed through the pinned placeholder
buffers, and encoders of new requests run with the cached position bias, equal and ragged lengths): greedy token ids
are identical with CUDA graphs on, off (enforce_eager: the same padded shapes, eagerly) and without async
scheduling (no placeholders), in float32."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.models._t5 import save_tiny_t5

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5_host"), "v1.1", initializer_factor=1.0)


def _requests():
    rng = np.random.default_rng(0)
    prompts, params = [], []
    for i in range(40):
        n = 32 if i % 2 else int(rng.integers(3, 90))       # W9-like equal lengths, and ragged ones
        prompts.append({"prompt_token_ids": rng.integers(5, 1000, size=n).tolist()})
        params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 20)), ignore_eos=True))
    return prompts, params


def _run(model_dir: str, **kw):
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128,
              kv_cache_memory_bytes=256 << 20, **kw)
    runner = llm.llm_engine.runner
    moved = [0]
    fill = runner._fill_placeholders

    def counting(inp):
        P = len(inp.placeholder_dst)
        if P and not (np.array_equal(inp.placeholder_dst, np.arange(P))
                      and np.array_equal(inp.placeholder_src, np.arange(P))):
            moved[0] += 1
        return fill(inp)

    runner._fill_placeholders = counting
    prompts, params = _requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    ids = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(x) for x in ids] == [p.max_tokens for p in params]
    runner._fill_placeholders = fill
    del llm, engine, runner, fill, counting   # (the closure held the runner: freed before the next engine sizes)
    gc.collect()
    torch.cuda.empty_cache()
    return ids, moved[0]


def test_t5_graphs_and_placeholders_do_not_change_greedy_output(t5_dir):
    graphs, moved = _run(t5_dir)
    assert moved > 0          # steps where rows moved: placeholders through the pinned buffers
    eager, _ = _run(t5_dir, enforce_eager=True)
    sync, moved_sync = _run(t5_dir, async_scheduling=False)
    assert moved_sync == 0
    assert graphs == eager
    assert graphs == sync
