"""cpu_offload_gb in the engine, through the test-only fake-device mode on CPU (HAYABUSA_FAKE_DEVICE_OFFLOAD=1:
the offload path runs with CPU copies): greedy output unchanged for Llama / Qwen2, plain and int8-quantized; the
ring's order in a real model; the combinations refused by name."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.config import EngineArgs
from hayabusa.errors import HayabusaValidationError
from hayabusa.worker.cpu_offload import FAKE_ENV

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL = dict(max_model_len=64, swap_space=0)
ALL = 1.0     # GiB: more than any tiny model has
ONE_LAYER = 1e-9


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv(FAKE_ENV, "1")


# 2-layer models: one layer offloaded (spread: the 2nd, one slot), or both (two slots)
@pytest.mark.parametrize("model, gb, layers", [("tiny_llama", ONE_LAYER, [1]), ("tiny_qwen2", ALL, [0, 1])])
def test_greedy_output_unchanged_with_offload(request, model, gb, layers, example_prompts, monkeypatch):
    path = request.getfixturevalue(model)
    prompts = example_prompts[::2]                              # English and Japanese
    base = ids(LLM(path, **SMALL).generate(prompts, GREEDY, use_tqdm=False))
    monkeypatch.setenv(FAKE_ENV, "1")
    llm = LLM(path, cpu_offload_gb=gb, **SMALL)
    off = llm.llm_engine.runner.offloader
    assert off is not None and off.layer_indices == layers and off.num_slots == len(layers)
    assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == base
    assert ("compute", layers[-1], len(layers) - 1) in off.trace


def test_ring_order_in_a_five_layer_model_and_int8(stories_dir, monkeypatch):
    prompts = ["Once upon a time", "The little dog", "Lily and Tom"]
    # every forward: layers 0, 1 into slots 0, 1 up front; then layer i+2 into layer i's slot once layer i ran
    one = [("copy", 0, 0), ("copy", 1, 1), ("compute", 0, 0), ("copy", 2, 0), ("compute", 1, 1),
           ("copy", 3, 1), ("compute", 2, 0), ("copy", 4, 0), ("compute", 3, 1), ("compute", 4, 0)]
    moved = {}
    for quantization in (None, "int8"):
        monkeypatch.delenv(FAKE_ENV, raising=False)
        base = ids(LLM(stories_dir, quantization=quantization, **SMALL).generate(prompts, GREEDY,
                                                                                          use_tqdm=False))
        monkeypatch.setenv(FAKE_ENV, "1")
        llm = LLM(stories_dir, quantization=quantization, cpu_offload_gb=ALL, **SMALL)
        off = llm.llm_engine.runner.offloader
        assert off.layer_indices == [0, 1, 2, 3, 4] and off.num_slots == 2
        off.trace.clear()
        assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == base
        forwards = len(off.trace) // len(one)
        assert forwards >= GREEDY.max_tokens and off.trace == one * forwards
        moved[quantization] = off.offloaded_bytes
    # int8: the packed int8 weights move (the float32 model's linear weights are 4 bytes each)
    assert moved["int8"] < moved[None] / 2


def test_draft_model_speculation_with_offload(stories_dir, monkeypatch):
    """The target's layers stream through the ring, its draft (here itself, as a second model) stays resident:
    every proposal accepted, output unchanged."""
    prompts = ["Once upon a time", "Lily and Tom"]
    base = ids(LLM(stories_dir, **SMALL).generate(prompts, GREEDY, use_tqdm=False))
    monkeypatch.setenv(FAKE_ENV, "1")
    llm = LLM(stories_dir, cpu_offload_gb=ALL, speculative_config={"model": stories_dir, "num_speculative_tokens": 3},
              **SMALL)
    runner = llm.llm_engine.runner
    assert runner.offloader.layer_indices == [0, 1, 2, 3, 4] and runner.draft.model is not runner.model
    assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == base
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0 and m["spec_decode_num_accepted_tokens"] == m[
        "spec_decode_num_draft_tokens"]


def test_encoder_decoder_refused_by_name(tmp_path, monkeypatch):
    from tests.models._t5 import save_tiny_t5

    path = save_tiny_t5(tmp_path / "t5", "v1.0")
    monkeypatch.setenv(FAKE_ENV, "1")
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=path, device="cpu", cpu_offload_gb=1).create_engine_config()
    assert e.value.parameter == "cpu_offload_gb" and "encoder-decoder" in str(e.value)
    monkeypatch.delenv(FAKE_ENV)     # on a CPU device too: a CPU trial run learns what the GPU would refuse
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=path, device="cpu", cpu_offload_gb=1).create_engine_config()
    assert e.value.parameter == "cpu_offload_gb"


def test_speculative_verify_steps_with_offload(tiny_qwen2, example_prompts, monkeypatch):
    """Verify steps (1 + k positions per request) run through the offloaded layers: proposals from the reference
    continuation, some corrupted (tests/spec_decode's OracleProposer), so tokens are accepted and rejected."""
    from tests.spec_decode.test_spec_engine import OracleProposer

    prompts = example_prompts[:3]
    base = LLM(tiny_qwen2, **SMALL).generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.setenv(FAKE_ENV, "1")
    llm = LLM(tiny_qwen2, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, cpu_offload_gb=ALL,
              **SMALL)
    llm.llm_engine.scheduler.spec.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids
                                                             for o in base])
    assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == ids(base)
    m = llm.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_offload_with_forced_preemption_keeps_greedy_output_and_leaks_no_block(tiny_qwen2, example_prompts,
                                                                                monkeypatch, mode):
    """The two halves of issue #20 together (the seed's users at the edge of GPU memory): weights streamed
    through the ring while a 20-block KV cache preempts, by swapping to the CPU tier or by recompute; the ids
    equal the run without offload or preemption, and every GPU and CPU block comes back."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = ids(LLM(tiny_qwen2, **SMALL).generate(example_prompts, params, use_tqdm=False))
    monkeypatch.setenv(FAKE_ENV, "1")
    llm = LLM(tiny_qwen2, cpu_offload_gb=ALL, block_size=4, num_gpu_blocks_override=20, max_model_len=64,
              swap_space=0.01, preemption_mode=mode)
    assert llm.llm_engine.runner.offloader.layer_indices == [0, 1]
    assert ids(llm.generate(example_prompts, params, use_tqdm=False)) == base
    sched, kv = llm.llm_engine.scheduler, llm.llm_engine.kv_cache_manager
    assert sched.num_preemptions > 0
    assert sched.num_swap_preemptions == (sched.num_preemptions if mode == "swap" else 0)
    assert (kv.num_blocks_swapped_in > 0) == (mode == "swap")
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == kv.block_pool.num_blocks == 20
    assert kv.num_used_cpu_blocks == 0 and not kv.req_to_cpu_blocks and not kv.has_pending_swaps
