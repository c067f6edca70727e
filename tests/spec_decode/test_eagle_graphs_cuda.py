"""EAGLE / EAGLE-3 on the device with the target's decode / verify CUDA graphs that also output the head's input
(HAYABUSA_EAGLE_GRAPHS, turned on here): greedy ids equal enforce_eager (the same padded shapes, eagerly), the
graphs off (every target forward eager, ``target_forward``) and speculation off; after a request's prefill no
target forward runs eagerly (steady decode replays the graphs). Prints each setting's wall time (tiny random
model and heads: a smoke number, seconds in all)."""

from __future__ import annotations

import time

import pytest

from hayabusa import LLM, SamplingParams
from tests.spec_decode.eagle_heads import write_eagle_head
from tests.spec_decode.test_eagle import PROMPTS, _ids, _spec
from tests.spec_decode.test_eagle_graphs import check_no_eager_target_on_graph_steps, record_eagle_steps

pytestmark = pytest.mark.cuda

PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KW = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_eagle_graphs_equal_eager_and_off(tiny_llama, tmp_path, method, max_num_seqs, monkeypatch):
    from hayabusa.worker import eagle

    head = str(tmp_path / method)
    write_eagle_head(tiny_llama, head, eagle3=method == "eagle3", seed=3, aux_ids=[1, 0, 1], draft_vocab_size=300)
    base = _ids(LLM(tiny_llama, max_num_seqs=max_num_seqs, **KW).generate(PROMPTS, PARAMS, use_tqdm=False))
    ids = {}
    for setting in ("graphs", "enforce_eager", "graphs_off"):
        monkeypatch.setattr(eagle, "USE_EAGLE_GRAPHS", setting != "graphs_off")
        llm = LLM(tiny_llama, max_num_seqs=max_num_seqs, enforce_eager=setting == "enforce_eager",
                  speculative_config=_spec(method, head), **KW)
        steps = record_eagle_steps(llm)
        t0 = time.perf_counter()
        ids[setting] = _ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        wall = time.perf_counter() - t0
        runner = llm.llm_engine.runner
        draft, g = runner.draft, runner.decode_runner
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
        if setting == "graphs_off":
            assert g.eagle_forward is None and not g.verify_graphs
            assert draft.num_graph_target_steps == 0 and draft.num_eager_target_forwards == len(steps)
        else:
            check_no_eager_target_on_graph_steps(llm, steps)   # steady decode: no eager target forward
            assert g.num_verify_runs > 0
            captured = setting == "graphs"
            assert bool(g.verify_graphs) is captured and bool(g.verify_head_inputs) is captured
            assert g.num_verify_replays == (g.num_verify_runs if captured else 0)
            assert g.num_replays == (g.num_runs if captured else 0)
        print(f"{method} max_num_seqs={max_num_seqs} {setting}: {wall:.2f} s, steps {len(steps)}, "
              f"graph-shape steps {sum(s for s, _ in steps)}, eager target forwards {draft.num_eager_target_forwards}")
    assert ids["graphs"] == ids["enforce_eager"] == ids["graphs_off"] == base
