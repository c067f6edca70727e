"""The n-gram proposer (pinned ids), and n-gram speculation on a trained model (SmolLM2-135M-Instruct) with a
copy-heavy prompt: proposals get accepted and the greedy text is unchanged."""

from __future__ import annotations

import pytest

from hayabusa.spec_decode.ngram import NgramProposer
from tests.helpers import smollm2_checkpoint


def test_longest_ngram_then_latest_occurrence():
    p = NgramProposer(min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix (2?) 6 7: the 3-gram [2, 6, 7] never occurred before; [6, 7] did at 1 and 5: the latest (5) wins
    assert p.propose(seq, 3) == [9, 2, 6]
    assert p.propose(seq, 1) == [9]
    assert NgramProposer(3, 3).propose(seq, 3) == []          # no earlier 3-gram match
    assert p.propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]          # proposals stop at the sequence's end
    assert p.propose([4], 2) == [] and p.propose([4, 4], 0) == []


def test_longer_match_wins_over_later_shorter_one():
    p = NgramProposer(min_n=1, max_n=2)
    seq = [3, 4, 10, 11, 4, 12, 3, 4]   # [3, 4] at 0 (then 10); [4] alone later at 4 (then 12)
    assert p.propose(seq, 2) == [10, 11]


def test_lookup_equals_the_sliding_window_reference():
    import random

    from hayabusa.spec_decode.ngram import ngram_propose_ref

    rng = random.Random(0)
    for vocab in (2, 3, 7, 1000):          # small vocabularies: many candidates and long overlapping matches
        for _ in range(150):
            seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
            lo = rng.randrange(1, 5)
            hi, k = rng.randrange(lo, 7), rng.randrange(0, 6)
            assert NgramProposer(lo, hi).propose(seq, k) == ngram_propose_ref(seq, k, lo, hi), (seq, lo, hi, k)


def test_batched_lookup_equals_the_single_lookups():
    import random

    import numpy as np

    rng = random.Random(1)
    for vocab in (2, 3, 7, 1000):
        for _ in range(80):
            lo = rng.randrange(1, 5)
            p = NgramProposer(lo, rng.randrange(lo, 7))
            B = rng.randrange(0, 9)
            seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 120))] for _ in range(B)]
            ks = [rng.randrange(0, 6) for _ in range(B)]
            got = p.propose_batch([np.array(q, dtype=np.int64) for q in seqs], ks)
            assert got == [p.propose(q, k) for q, k in zip(seqs, ks)], (seqs, ks, p.min_n, p.max_n)
    # pinned: the first two find matches (the second's stops at its end), the third has none, k = 0 gives none
    p = NgramProposer(1, 3)
    seqs = [[5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7], [1, 2, 3, 1, 2], [1, 2, 3], [4, 4, 4]]
    assert p.propose_batch(seqs, [3, 5, 2, 0]) == [[9, 2, 6], [3, 1, 2], [], []]
    with pytest.raises(ValueError, match="ks"):
        p.propose_batch(seqs, [3])


def test_token_history_appends_only_new_tokens():
    from hayabusa.spec_decode.ngram import TokenHistory

    h, ids = TokenHistory(), list(range(300))
    assert h.sync(ids[:10]).tolist() == ids[:10]
    h.buf[3] = -7                           # only tokens past the last sync are copied again
    assert h.sync(ids[:12]).tolist() == ids[:3] + [-7] + ids[4:12]
    assert h.sync(ids).tolist()[280:] == ids[280:] and len(h.buf) >= 300    # grown past its first 256


@pytest.mark.slow
def test_ngram_on_smollm2_accepts_and_keeps_greedy_text():
    from hayabusa import LLM, SamplingParams

    path = smollm2_checkpoint()
    doc = ("Invoice 4471. Customer: Marta Kowalska, 12 Linden Street, Gdansk. Items: 3 x blue ceramic mug at 8.50 "
           "EUR; 1 x oak cutting board at 24.00 EUR. Shipping: 5.00 EUR. Total: 54.50 EUR.")
    # the answer is started with the document's first words, so the model goes on copying it
    prompt = f"<|im_start|>user\nCopy this text: {doc}<|im_end|>\n<|im_start|>assistant\n{doc[:30]}"
    params = SamplingParams(temperature=0.0, max_tokens=48)
    base = LLM(path, max_model_len=512, max_num_seqs=2, device="cpu").generate([prompt], params, use_tqdm=False)
    llm = LLM(path, max_model_len=512, max_num_seqs=2, device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2})
    out = llm.generate([prompt], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == base[0].outputs[0].token_ids
    assert out[0].outputs[0].text == base[0].outputs[0].text
    m = out[0].metrics
    print(f"SmolLM2 n-gram: proposed {m.spec_num_draft_tokens}, accepted {m.spec_num_accepted_tokens}, "
          f"acceptance rate {m.spec_acceptance_rate:.2f}, mean accepted length {m.spec_mean_accepted_length:.2f}")
    assert m.spec_num_draft_tokens > 0 and m.spec_acceptance_rate > 0.5
    assert m.spec_mean_accepted_length > 2.0
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] == m.spec_num_accepted_tokens
