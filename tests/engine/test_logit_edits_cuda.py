"""logit_bias / allowed_token_ids / bad_words on a GPU: async scheduling (the bad words' test of the last output
token on the device), CUDA graphs for decode (edits applied to the logits outside the graph), mixed batches.
stories260K; a few seconds in all."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The little dog", "Lily and her mom", "One day, Tom"]
GIRL = [298, 315, 421]          # " girl": "▁g", "ir", "l"


def greedy(max_tokens=32, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def ids_of(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_edits_on_cuda_match_the_cpu_and_leave_plain_requests_alone(stories_dir, enforce_eager):
    llm = LLM(stories_dir, dtype="float32", enforce_eager=enforce_eager)
    assert llm.llm_engine.async_scheduling          # the CUDA default: the pending-token path runs
    plain = ids_of(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    params = [greedy(bad_words=["girl", "Lily"]), greedy(), greedy(logit_bias={77: 100.0}),
              greedy(allowed_token_ids=[261, 298, 13, 317]), greedy(),
              SamplingParams(temperature=0.8, seed=5, max_tokens=32, ignore_eos=True, bad_words=["girl"], n=2)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[3], PROMPTS[0]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    ids = ids_of(outs)
    assert ids[1] == plain[1] and ids[4] == plain[3]                    # plain rows: as without the others
    assert not contains(ids[0], GIRL) and 317 not in ids[0]
    assert ids[2] == [77] * 32 and set(ids[3]) <= {261, 298, 13, 317}
    assert all(not contains(list(c.token_ids), GIRL) for c in outs[5].outputs)
    # synchronous steps (every output token on the host when the bad words are tested): the same tokens
    del llm
    sync = LLM(stories_dir, dtype="float32", enforce_eager=enforce_eager, async_scheduling=False)
    assert ids_of(sync.generate(prompts, params, use_tqdm=False)) == ids


@pytest.mark.cuda
def test_edit_free_batches_keep_the_greedy_fast_path(stories_dir):
    llm = LLM(stories_dir, dtype="float32")
    calls = []
    sampler = llm.llm_engine.runner.sampler
    orig = sampler.forward
    sampler.forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert not calls                                            # plain greedy: argmax only, no Sampler
    llm.generate(PROMPTS, [greedy(logit_bias={5: 1.0})] + [greedy()] * 3, use_tqdm=False)
    assert calls
