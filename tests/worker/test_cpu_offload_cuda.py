"""cpu_offload_gb on CUDA (run on the device): greedy ids equal with offload on and off, eager and with CUDA graphs;
the weights' GPU memory lower by the offloaded bytes minus the ring, and the KV cache larger by about as much; a
captured graph re-streams the weights from CPU memory on every replay."""

from __future__ import annotations

import gc

import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.worker.test_cpu_offload import Stack

pytestmark = pytest.mark.cuda

# The bench's random checkpoints carry no tokenizer: token-id prompts (inside the 0.5b shape's vocabulary)
PROMPTS = [{"prompt_token_ids": [(97 * r + 13 * i) % 150000 + 10 for i in range(5 + 3 * r)]} for r in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
KW = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.2,
          swap_space=0, skip_tokenizer_init=True)
OFFLOAD_GB = 0.3    # qwen2.5-0.5b shape: ~28 MiB per decoder layer -> 11 of 24 layers


def _free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _run(path: str, **kw) -> dict:
    from hayabusa.worker.kv_cache import bytes_per_block

    llm = LLM(path, **KW, **kw)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    runner = llm.llm_engine.runner
    off = runner.offloader
    info = {"ids": out, "num_blocks": runner.num_blocks, "graphs": runner.graphs is not None,
            "bytes_per_block": bytes_per_block(llm.llm_engine.config),
            "offload": None if off is None else (list(off.layer_indices), off.num_slots, off.saved_bytes)}
    del llm, runner, off
    _free()
    return info


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_greedy_ids_equal_with_offload(q05_dir, enforce_eager):
    base = _run(q05_dir, enforce_eager=enforce_eager)
    off = _run(q05_dir, enforce_eager=enforce_eager, cpu_offload_gb=OFFLOAD_GB)
    assert base["offload"] is None and off["offload"] is not None
    layers, num_slots, saved = off["offload"]
    assert 8 <= len(layers) <= 14 and num_slots == 2 and saved > 0
    assert off["graphs"] == (not enforce_eager) == base["graphs"]
    assert off["ids"] == base["ids"]
    # KV sizing: the cache grew by about the bytes the offload freed (offloaded weights - ring)
    grown = (off["num_blocks"] - base["num_blocks"]) * base["bytes_per_block"]
    assert grown >= 0.8 * saved, (grown, saved)


def test_weight_memory_lower_by_offloaded_minus_ring(q05_dir):
    from hayabusa.config import EngineArgs
    from hayabusa.model.loader import build_model
    from hayabusa.worker.cpu_offload import WeightOffloader

    cfg = EngineArgs(model=q05_dir, **KW).create_engine_config()
    _free()
    before = torch.cuda.memory_allocated()
    model = build_model(cfg.model_config, torch.device("cuda"))
    _free()
    weights = torch.cuda.memory_allocated() - before
    off = WeightOffloader(model, int(OFFLOAD_GB * 2**30), torch.device("cuda"))
    _free()
    resident = torch.cuda.memory_allocated() - before
    assert off.offloaded_bytes >= OFFLOAD_GB * 2**30 and off.ring_bytes < off.offloaded_bytes / 4
    # within 1 % of the 256 MiB saved: alone this is exact to 1 MiB (run U); after the greedy tests in the same
    # process the device measured 1.5 MiB more freed (run V: small tensors of earlier engines released between
    # the two readings), which says nothing about the offloader
    assert abs((weights - resident) - off.saved_bytes) < off.saved_bytes / 100, (weights, resident, off.saved_bytes)
    assert all(not p.host.is_cuda and p.host.is_pinned() for p in off.packed)
    del model, off
    _free()


def test_captured_graph_restreams_weights_each_replay():
    torch.manual_seed(0)
    model = Stack(6).cuda()
    x = torch.randn(4, 8, device="cuda")
    from hayabusa.worker.cpu_offload import WeightOffloader

    off = WeightOffloader(model, 10**9, torch.device("cuda"))
    assert off.layer_indices == list(range(6)) and off.num_slots == 2
    want = model(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):      # warm-up on a side stream, as torch.cuda.graph expects
        model(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(x)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, want, rtol=0, atol=1e-6)
    # change layer 3's weights in CPU memory: the replay copies them again, and matches an eager forward
    pl = off.packed[3]
    pl.host.copy_(off.packed[2].host)
    eager = model(x)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.allclose(eager, want, rtol=0, atol=1e-3) and torch.allclose(out, eager, rtol=0, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_ranks_offload_their_shards(q05_dir):
    kw = {**KW, "tensor_parallel_size": 2}
    runs = []
    for extra in ({}, {"cpu_offload_gb": OFFLOAD_GB / 2}):
        llm = LLM(q05_dir, **kw, **extra)
        try:
            runs.append(([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)],
                         llm.llm_engine.kv_cache_capacity_tokens))
        finally:
            llm.llm_engine.shutdown()
        del llm
        _free()
    (base_ids, base_tokens), (off_ids, off_tokens) = runs
    assert off_ids == base_ids
    assert off_tokens > base_tokens     # each rank's KV cache grew by what its offload freed
