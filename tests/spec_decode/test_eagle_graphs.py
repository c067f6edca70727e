"""EAGLE / EAGLE-3 steps on the target's CUDA graph shapes (worker/cuda_graph.py ``eagle_forward``), run eagerly on
the CPU with the torch attention reference: the target's decode and (bs, k + 1) verify graphs also give the head's
input, so a graph-shaped step runs no eager ``target_forward``; greedy ids equal speculation off and the head's
proposals equal those of the eager path. The graphs themselves: tests/spec_decode/test_eagle_graphs_cuda.py."""

from __future__ import annotations

import pytest

from hayabusa import LLM
from hayabusa.worker.cuda_graph import CUDAGraphRunner
from tests.spec_decode.test_eagle import PARAMS, PROMPTS, _ids, _spec, base, heads  # noqa: F401 (fixtures)


def record_eagle_steps(llm: LLM) -> list[tuple[bool, int]]:
    """Record per step (whether the target's forward fits its graph runner: a decode step, or a verify step of at
    most k + 1 tokens a request, of a captured batch size, without prompt logprobs, on graphs that output the
    head's input; the eager ``target_forward`` calls in the step)."""
    runner = llm.llm_engine.runner
    steps = []
    run = runner._run_with_draft

    def spy(inp, T, R, max_q):
        graph_shape = runner.graph_shape(inp, R, max_q) is not None and runner.decode_runner.eagle_forward is not None
        before = runner.draft.num_eager_target_forwards
        out = run(inp, T, R, max_q)
        steps.append((graph_shape, runner.draft.num_eager_target_forwards - before))
        return out

    runner._run_with_draft = spy
    return steps


def record_proposals(llm: LLM) -> list[list[int]]:
    """Every proposal run of the head, as [R_d x k] lists in call order."""
    drafter = llm.llm_engine.runner.draft
    seen, propose = [], drafter.propose

    def record(req_index, num_drafts, *args):
        out = propose(req_index, num_drafts, *args)
        seen.append([out[i, :k].tolist() for i, k in enumerate(num_drafts.tolist())])
        return out

    drafter.propose = record
    return seen


def check_no_eager_target_on_graph_steps(llm: LLM, steps: list[tuple[bool, int]]) -> None:
    """Graph-shaped steps ran no eager target forward; every other step ran exactly one; the counters agree."""
    draft = llm.llm_engine.runner.draft
    graphed = [n for g, n in steps if g]
    assert graphed and graphed == [0] * len(graphed)
    assert [n for g, n in steps if not g] == [1] * (len(steps) - len(graphed))
    assert draft.num_graph_target_steps == len(graphed)
    assert draft.num_eager_target_forwards == len(steps) - len(graphed)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_on_padded_graph_shapes_keeps_greedy_output(heads, base, method, max_num_seqs):  # noqa: F811
    """Padded graph shapes on (the target's decode / verify graph runner run eagerly) and off (every target
    forward eager, as on CUDA without HAYABUSA_EAGLE_GRAPHS): the same greedy ids as speculation off, the same
    proposals; with the padded path no graph-shaped step calls the eager ``target_forward``."""
    target, head = heads[("llama", method)]
    ids, proposals = {}, {}
    for padded in (True, False):
        llm = LLM(target, max_num_seqs=max_num_seqs, device="cpu", speculative_config=_spec(method, head))
        runner = llm.llm_engine.runner
        if padded:
            runner.decode_runner = CUDAGraphRunner.for_runner(runner, use_graphs=False)
            assert runner.decode_runner.eagle_forward is not None and runner.decode_runner.verify_width == 4
        steps = record_eagle_steps(llm)
        proposals[padded] = record_proposals(llm)
        ids[padded] = _ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
        draft = runner.draft
        if padded:
            check_no_eager_target_on_graph_steps(llm, steps)
            g = runner.decode_runner
            assert g.num_verify_runs > 0 and g.num_verify_replays == 0 == g.num_replays   # no capture on the CPU
            assert g.num_verify_runs + g.num_runs == draft.num_graph_target_steps
        else:
            assert draft.num_graph_target_steps == 0 and draft.num_eager_target_forwards == len(steps)
    assert ids[True] == ids[False] == base["llama"]
    assert proposals[True] == proposals[False] and len(proposals[True]) > 0


@pytest.mark.parametrize("method, kwargs", [
    ("eagle", dict(max_num_seqs=4, num_gpu_blocks_override=10, block_size=4, max_model_len=40)),
    ("eagle3", dict(max_num_seqs=4, enable_prefix_caching=True, block_size=4))])
def test_eagle_padded_graph_shapes_under_preemption_or_prefix_hits(heads, base, method, kwargs):  # noqa: F811
    target, head = heads[("llama", method)]
    llm = LLM(target, device="cpu", speculative_config=_spec(method, head), **kwargs)
    runner = llm.llm_engine.runner
    runner.decode_runner = CUDAGraphRunner.for_runner(runner, use_graphs=False)
    steps = record_eagle_steps(llm)
    rounds = 2 if kwargs.get("enable_prefix_caching") else 1
    for _ in range(rounds):
        assert _ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == base["llama"]
    if rounds == 2:
        assert llm.llm_engine.kv_cache_manager.num_hit_tokens > 0
    else:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    check_no_eager_target_on_graph_steps(llm, steps)


def test_eagle_graphs_are_opt_in_on_cuda(heads, monkeypatch):  # noqa: F811
    """Captured graphs (use_graphs=True) serve EAGLE only with USE_EAGLE_GRAPHS: otherwise plain decode graphs
    without the head's input and no verify graphs (EAGLE steps then run eagerly); the padded eager path always
    has both. Nothing is captured here (capture() is never called)."""
    from hayabusa.worker import eagle

    target, head = heads[("llama", "eagle3")]
    runner = LLM(target, device="cpu", max_num_seqs=4,
                 speculative_config=_spec("eagle3", head)).llm_engine.runner
    monkeypatch.setattr(eagle, "USE_EAGLE_GRAPHS", False)
    off = CUDAGraphRunner.for_runner(runner, use_graphs=True)
    assert off.eagle_forward is None and off.verify_width == 0 and off.verify_sizes == []
    padded = CUDAGraphRunner.for_runner(runner, use_graphs=False)
    assert padded.eagle_forward is not None and padded.verify_width == 4
    monkeypatch.setattr(eagle, "USE_EAGLE_GRAPHS", True)
    on = CUDAGraphRunner.for_runner(runner, use_graphs=True)
    assert on.eagle_forward is not None and on.verify_width == 4 and on.verify_sizes == [1, 2, 4]
