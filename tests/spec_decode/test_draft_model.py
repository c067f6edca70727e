"""Speculative decoding with a draft model: a smaller random checkpoint of the same vocabulary keeps greedy output
unchanged; the target as its own draft has every proposal accepted."""

from __future__ import annotations

import pytest
import torch

from hayabusa import LLM, HayabusaValidationError, SamplingParams
from tests.spec_decode.test_spec_engine import MAX_TOKENS, PROMPTS, _ids


@pytest.fixture(scope="module")
def small_draft(tiny_llama, tmp_path_factory) -> str:
    """A 1-layer, 32-wide random Llama with tiny_llama's tokenizer and vocabulary."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    out = tmp_path_factory.mktemp("small_draft")
    LlamaForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def base(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return LLM(tiny_llama, max_num_seqs=16, device="cpu").generate(PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize("max_num_seqs", [1, 16])
def test_small_draft_keeps_greedy_output(tiny_llama, small_draft, base, max_num_seqs):
    llm = LLM(tiny_llama, max_num_seqs=max_num_seqs, device="cpu",
              speculative_config={"method": "draft_model", "model": small_draft, "num_speculative_tokens": 3})
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    assert _ids(out) == _ids(base)
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    assert llm.llm_engine.runner.num_greedy_verify_steps > 0   # the greedy verify path, proposals on the device


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=3), dict(max_num_seqs=8, num_gpu_blocks_override=20,
                                                                block_size=4, max_model_len=64)])
def test_target_as_its_own_draft_accepts_everything(tiny_llama, base, kwargs):
    llm = LLM(tiny_llama, device="cpu", speculative_config={"model": tiny_llama, "num_speculative_tokens": 3},
              **kwargs)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    assert _ids(out) == _ids(base)
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"] == 1.0
    assert all(o.metrics.spec_acceptance_rate == 1.0 for o in out)
    # everything accepted: a verify step emits its k = 3 proposals and the bonus token (fewer where max_tokens cut
    # the proposals), so the mean accepted length (the bonus counted, vLLM's) is in (2, 4]
    for o in out:
        m = o.metrics
        assert m.spec_mean_accepted_length == 1 + m.spec_num_accepted_tokens / m.spec_num_steps
        assert 2.0 < m.spec_mean_accepted_length <= 4.0 and m.spec_num_accepted_tokens == m.spec_num_draft_tokens
    if "num_gpu_blocks_override" in kwargs:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_own_draft_after_prefix_hits_accepts_everything(tiny_llama, base):
    # the second generate() hits the prefix cache: the draft's cache must hold those blocks too (same block ids)
    llm = LLM(tiny_llama, device="cpu", max_num_seqs=4, enable_prefix_caching=True, block_size=4,
              speculative_config={"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    hits0 = llm.llm_engine.kv_cache_manager.num_hit_tokens
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.kv_cache_manager.num_hit_tokens > hits0
    assert _ids(out) == _ids(base)
    assert all(o.metrics.spec_num_draft_tokens > 0 and o.metrics.spec_acceptance_rate == 1.0 for o in out)


def test_draft_model_config_errors(tiny_llama, tiny_qwen2):
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError) as e:
        LLM(tiny_llama, device="cpu", speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    assert e.value.parameter == "speculative_config.model"
    with pytest.raises(HayabusaValidationError) as e:   # another vocabulary
        LLM(tiny_llama, device="cpu", speculative_config={"model": tiny_qwen2, "num_speculative_tokens": 2})
    assert e.value.parameter == "speculative_config.model"


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_missing_draft_checkpoint_is_named_as_speculative_config_model(tiny_llama, tmp_path, method):
    # the target loads fine; the error must say it is the draft's path, not the target's `model`
    for bad in (str(tmp_path / "nonexistent"), str(tmp_path)):   # no such folder / a folder without config.json
        with pytest.raises(HayabusaValidationError) as e:
            LLM(tiny_llama, device="cpu",
                speculative_config={"method": method, "model": bad, "num_speculative_tokens": 2})
        assert e.value.parameter == "speculative_config.model" and e.value.value == bad
        assert str(e.value).startswith("speculative_config.model=") and bad in str(e.value)


def test_draft_shorter_than_max_model_len_is_named_as_the_draft(tiny_llama, small_draft, tmp_path):
    # the draft's own limit, not the target's: the message must say it is the draft's
    import json
    import shutil

    short = tmp_path / "short_draft"
    shutil.copytree(small_draft, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (short / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HayabusaValidationError) as e:
        LLM(tiny_llama, device="cpu", max_model_len=64,
            speculative_config={"model": str(short), "num_speculative_tokens": 2})
    assert e.value.parameter == "max_model_len"
    assert f"speculative_config.model={str(short)!r}" in str(e.value) and "16" in str(e.value)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_own_draft_with_swap_preemption_and_cpu_prefix_restores_accepts_everything(tiny_llama, mode):
    # A tight cache: requests are preempted and shared prefixes evicted to the CPU KV tier (swap_space), and come
    # back from it. The tier holds the draft's KV as well as the target's (the same block ids), so a restored
    # block holds both and the draft stays in step: acceptance 1.0. (Restoring the target's KV only dropped a
    # self-draft's acceptance to 0.2.)
    prompts = ["a b c d a b c d a b c d a b c " * 2 + f"{i} a b c d a b c d a b c d a b c " * 2 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kwargs = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=24, block_size=16, swap_space=0.05,
                  enable_prefix_caching=True, max_num_seqs=6)
    ref = LLM(tiny_llama, **{**kwargs, "swap_space": 0}).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, speculative_config={"model": tiny_llama, "num_speculative_tokens": 3},
              preemption_mode=mode, **kwargs)
    runner, kv = llm.llm_engine.runner, llm.llm_engine.kv_cache_manager
    assert runner.num_cpu_blocks > 0 and len(runner.kv_swapper.cpu_caches) == 2   # the target's and the draft's
    for _ in range(3):   # later rounds meet the earlier prefixes (hit ones are kept in the CPU tier when evicted)
        out = llm.generate(prompts, params, use_tqdm=False)
        assert _ids(out) == _ids(ref)
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions > 0 and kv.num_blocks_swapped_in > 0
    if mode == "recompute":   # (with swap preemption the shared blocks stay in use on the GPU: no CPU prefix hit)
        assert kv.num_cpu_hit_blocks > 0
    assert sched.num_swap_preemptions == (sched.num_preemptions if mode == "swap" else 0)
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"] > 0


def record_draft_steps(llm: LLM) -> list[tuple[bool, int]]:
    """Record per step with a draft model (whether the target ran on its graph shapes: a decode step, or a verify
    step of at most k + 1 tokens a request, of a captured batch size, without prompt logprobs; the draft's eager
    forwards in the step)."""
    runner = llm.llm_engine.runner
    steps = []
    run = runner._run_with_draft

    def spy(inp, T, R, max_q):
        graph_shape = runner.graph_shape(inp, R, max_q) is not None
        before = runner.draft.num_eager_forwards
        out = run(inp, T, R, max_q)
        steps.append((graph_shape, runner.draft.num_eager_forwards - before))
        return out

    runner._run_with_draft = spy
    return steps


def _padded_graph_shapes(llm: LLM) -> list[tuple[bool, int]]:
    """Put the target and the draft on their CUDA graphs' padded shapes, run eagerly (as enforce_eager does; on
    the CPU the engine builds no graph runners); record_draft_steps."""
    from hayabusa.worker.cuda_graph import CUDAGraphRunner

    runner = llm.llm_engine.runner
    runner.draft.make_graphs(runner, use_graphs=False)
    runner.decode_runner = CUDAGraphRunner.for_runner(runner, use_graphs=False)
    return record_draft_steps(llm)


def check_no_eager_draft_after_prefill(llm: LLM, steps: list[tuple[bool, int]]) -> None:
    """Steps the target ran on its graph shapes ran no eager draft forward (proposals and mirror through the
    draft's graph runners); each prefill / mixed step ran one (its mirror)."""
    draft = llm.llm_engine.runner.draft
    graphed = [n for g, n in steps if g]
    assert graphed and graphed == [0] * len(graphed)            # decode / verify steps: no eager draft forward
    assert [n for g, n in steps if not g] == [1] * (len(steps) - len(graphed))   # prefills: the mirror, eagerly
    assert draft.num_graph_mirrors == len(graphed)
    assert draft.num_eager_forwards == len(steps) - len(graphed)
    assert draft.mirror_graphs.num_verify_runs > 0


@pytest.fixture(scope="module")
def base_qwen2(tiny_qwen2):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return LLM(tiny_qwen2, max_num_seqs=16, device="cpu").generate(PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
@pytest.mark.parametrize("pair", ["llama_self", "llama_small", "qwen2_self"])
def test_draft_on_padded_graph_shapes_keeps_greedy_output(request, base, base_qwen2, pair, max_num_seqs):
    """The draft's proposal forwards and its mirror of the target's decode / verify steps through its own
    CUDAGraphRunners' padded shapes (run eagerly on the CPU: worker/draft_model.py make_graphs): greedy ids as
    speculation off; the target as its own draft accepts every proposal, the small draft only some (the rejected
    proposals' KV slots rewritten by later steps); after a request's prefill no draft forward runs eagerly."""
    target, draft_path, ref = {"llama_self": ("tiny_llama", "tiny_llama", base),
                               "llama_small": ("tiny_llama", "small_draft", base),
                               "qwen2_self": ("tiny_qwen2", "tiny_qwen2", base_qwen2)}[pair]
    llm = LLM(request.getfixturevalue(target), max_num_seqs=max_num_seqs, device="cpu",
              speculative_config={"model": request.getfixturevalue(draft_path), "num_speculative_tokens": 3})
    steps = _padded_graph_shapes(llm)
    runner = llm.llm_engine.runner
    draft = runner.draft
    assert draft.graphs.sizes == draft.mirror_graphs.sizes == runner.decode_runner.sizes
    assert not draft.graphs.verify_width and draft.mirror_graphs.verify_width == runner.decode_runner.verify_width == 4
    assert draft.mirror_graphs.verify_sizes == runner.decode_runner.verify_sizes
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    assert _ids(out) == _ids(ref)
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    if draft_path == target:
        assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]
    else:
        assert m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert draft.num_graph_steps > 0 and not draft.graphs.graphs    # padded shapes, no capture on the CPU
    assert runner.decode_runner.num_verify_runs > 0
    assert draft.mirror_graphs.num_verify_runs == runner.decode_runner.num_verify_runs
    check_no_eager_draft_after_prefill(llm, steps)
    assert not draft.mirror_graphs.verify_graphs and not draft.mirror_graphs.graphs   # no capture on the CPU


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=8, num_gpu_blocks_override=20, block_size=4, max_model_len=64),
                                    dict(max_num_seqs=4, enable_prefix_caching=True, block_size=4)])
def test_own_draft_on_padded_graph_shapes_with_preemption_or_prefix_hits(tiny_llama, base, kwargs):
    """The mirror through the draft's padded graph shapes keeps its cache in step across preemption (recompute)
    and prefix-cache hits (a second generate): every proposal of the target as its own draft accepted."""
    llm = LLM(tiny_llama, device="cpu", speculative_config={"model": tiny_llama, "num_speculative_tokens": 3},
              **kwargs)
    steps = _padded_graph_shapes(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rounds = 2 if kwargs.get("enable_prefix_caching") else 1
    for _ in range(rounds):
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        assert _ids(out) == _ids(base)
        assert all(o.metrics.spec_num_draft_tokens > 0 and o.metrics.spec_acceptance_rate == 1.0 for o in out)
    if rounds == 2:
        assert llm.llm_engine.kv_cache_manager.num_hit_tokens > 0
    else:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    check_no_eager_draft_after_prefill(llm, steps)


def test_graph_runner_verify_needs_a_speculative_config(tiny_llama):
    from hayabusa.worker.cuda_graph import CUDAGraphRunner

    runner = LLM(tiny_llama, device="cpu").llm_engine.runner
    with pytest.raises(HayabusaValidationError) as e:
        CUDAGraphRunner(runner.model, runner.kv_caches, runner.backend, runner.buffers, runner.cfg,
                        max_num_reqs=runner.max_num_reqs, max_num_tokens=runner.max_num_tokens,
                        device=runner.device, verify=True)
    assert e.value.parameter == "verify"
    assert CUDAGraphRunner.for_runner(runner, use_graphs=False).verify_width == 0


def _stop_params(tokenizer, base_out, include: bool) -> list[SamplingParams]:
    """Per prompt, a stop string whose first occurrence in the greedy output ends with output token 5, 6 or 7 (so
    inside a verify step's run of accepted tokens, not at its end)."""
    params = []
    for i, o in enumerate(base_out):
        ids = o.outputs[0].token_ids
        text = o.outputs[0].text
        for j in range(5 + i % 3, len(ids) - 4):
            end = len(tokenizer.decode(ids[:j + 1]))
            stop = text[max(end - 2, 0):end]
            if stop.strip() and text.find(stop) + len(stop) == end and len(tokenizer.decode(ids[:j])) < end:
                break
        else:
            raise AssertionError(f"no stop string found in {text!r}")
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop],
                                     include_stop_str_in_output=include))
    return params


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_accepted_run_keeps_output_of_speculation_off(tiny_llama, base, include):
    # a verify step accepts several tokens at once; a stop string completed by one of them must end the output
    # there (token ids, logprob-free usage counts, text), as with speculation off, where the later tokens are never
    # generated
    off = LLM(tiny_llama, max_num_seqs=4, device="cpu")
    params = _stop_params(off.get_tokenizer(), base, include)
    ref = off.generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_llama, max_num_seqs=4, device="cpu",
              speculative_config={"model": tiny_llama, "num_speculative_tokens": 3})
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(r.outputs[0].token_ids) < MAX_TOKENS for r in ref)   # every stop string did stop
    for r, o in zip(ref, out):
        a, b = r.outputs[0], o.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, "stop", a.stop_reason)
        assert o.metrics.num_generation_tokens == len(a.token_ids)
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
