"""Speculative decoding's speed paths on the device: the draft model's proposal forwards and its mirror of the
target's decode / verify steps replayed from its own CUDA graphs give the same greedy ids as eager and as
speculation off (the target as its own draft: every proposal accepted), and no draft forward runs eagerly after
a request's prefill; with async scheduling (the CUDA default) steps in which no request may propose overlap the
previous step, with unchanged ids."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from tests.spec_decode.test_draft_model import check_no_eager_draft_after_prefill, record_draft_steps
from tests.spec_decode.test_spec_engine import PROMPTS, _ids

pytestmark = pytest.mark.cuda

PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KW = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_draft_graphs_equal_eager_and_off(tiny_llama, max_num_seqs, monkeypatch):
    from hayabusa.worker import draft_model

    monkeypatch.setattr(draft_model, "USE_MIRROR_GRAPHS", True)   # the default; set so HAYABUSA_DRAFT_MIRROR_GRAPHS=0 cannot skip it
    base = _ids(LLM(tiny_llama, max_num_seqs=max_num_seqs, **KW).generate(PROMPTS, PARAMS, use_tqdm=False))
    spec = {"model": tiny_llama, "num_speculative_tokens": 4}
    ids = {}
    for eager in (False, True):
        llm = LLM(tiny_llama, max_num_seqs=max_num_seqs, enforce_eager=eager, speculative_config=spec, **KW)
        steps = record_draft_steps(llm)
        ids[eager] = _ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        draft, m = llm.llm_engine.runner.draft, llm.get_metrics()
        assert m["spec_decode_num_draft_tokens"] > 0
        assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]
        assert draft.num_graph_steps > 0
        assert bool(draft.graphs.graphs) is (not eager)      # captured unless enforce_eager
        target = llm.llm_engine.runner.decode_runner          # the target's verify steps: (bs, k + 1) graphs
        assert target.num_verify_runs > 0 and target.num_verify_replays == (0 if eager else target.num_verify_runs)
        assert llm.llm_engine.async_scheduling              # the CUDA default, with speculation too
        check_no_eager_draft_after_prefill(llm, steps)        # steady decode: the draft's mirror on its graphs too
        mirror = draft.mirror_graphs
        assert mirror.num_verify_runs == target.num_verify_runs
        assert mirror.num_verify_replays == (0 if eager else mirror.num_verify_runs)
        assert bool(mirror.verify_graphs) is (not eager)
        print(f"max_num_seqs={max_num_seqs} eager={eager}: steps {len(steps)}, graph-shape steps "
              f"{sum(g for g, _ in steps)}, eager draft forwards {draft.num_eager_forwards}, draft mirrors "
              f"replayed {mirror.num_verify_replays + mirror.num_replays}")
    assert ids[False] == ids[True] == base


def test_ngram_above_batch_threshold_overlaps(tiny_llama):
    base = LLM(tiny_llama, max_num_seqs=8, **KW)
    ids_off = _ids(base.generate(PROMPTS, PARAMS, use_tqdm=False))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
            "disable_by_batch_size": 2}
    llm = LLM(tiny_llama, max_num_seqs=8, speculative_config=spec, **KW)
    assert _ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == ids_off
    s, s_off = llm.llm_engine.stats, base.llm_engine.stats
    # while more than 2 requests run no step may propose: those steps overlap as with speculation off
    assert s["num_overlapped_steps"] > 0.5 * s["num_steps"]
    assert s_off["num_overlapped_steps"] == s_off["num_steps"] - 1
