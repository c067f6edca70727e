"""InputBatch: rows, token ids, sampled tokens of a row's previous owner, token histories (CPU, exact values)."""

from __future__ import annotations

import numpy as np
import torch

from hayabusa.sampling_params import SamplingParams
from hayabusa.worker.input_batch import NEVER_ARGMAX, CachedRequestState, InputBatch


def _state(rid, prompt, **kw):
    return CachedRequestState(rid, prompt, SamplingParams(**kw), None)


def _batch():
    return InputBatch(max_num_reqs=3, max_model_len=8, max_blocks_per_req=2, vocab_size=50, eos_token_ids=[2],
                      device=torch.device("cpu"))


def test_rows_tokens_and_a_reused_row():
    b = _batch()
    a = _state("a", [5, 6, 7], temperature=0.0)
    assert b.add(a, [5, 6, 7], [4]) == 0
    assert b.add(_state("b", [8], temperature=0.7), [8], [1, 3]) == 1
    assert b.block_table[1].tolist() == [1, 3] and b.argmax_from.tolist()[:2] == [0, NEVER_ARGMAX]
    rows, epochs = np.array([0, 1]), b.row_epoch[[0, 1]].copy()
    b.remove("a")                                   # row 0 leaves before its sampled token is back ...
    assert b.add(_state("c", [9, 9], temperature=0.0), [9, 9], [0]) == 0     # ... and gets a new owner
    b.write_sampled(rows, epochs, np.array([11, 12]))
    assert b.num_tokens[0] == 2 and 11 not in b.token_ids[0].tolist()        # not written into c's row
    assert b.token_ids[1, :2].tolist() == [8, 12] and b.num_tokens[1] == 2
    # a request added again without giving its row up keeps one row (no leak)
    b.add(_state("c", [9, 9], temperature=0.0), [9, 9, 13], [0])
    assert sorted(b.row_of.values()) == [0, 1] and len(b.row_of) == 2


def test_token_matrix_pads_and_marks_unknown_tokens():
    b = _batch()
    b.add(_state("a", [5, 6, 7]), [5, 6, 7, 20], [0])    # prompt 3 + one known output
    b.add(_state("b", [8]), [8], [1])
    rows = np.array([0, 1])
    out, pending = b.token_matrix(rows, b.num_prompt_tokens[rows], np.array([2, 1]))
    assert out.tolist() == [[20, 50], [50, 50]]             # unknown and outside cells padded with V
    assert pending.tolist() == [[False, True], [True, False]]


def test_sampling_metadata_from_rows():
    b = _batch()
    b.add(_state("g", [5], temperature=0.0), [5], [0])
    b.add(_state("r", [6, 7], temperature=0.5, top_k=3, min_tokens=2, stop_token_ids=[9],
                 repetition_penalty=1.2), [6, 7, 30], [1])
    rows = np.array([1, 0])
    meta = b.sampling_metadata(rows, np.array([1, 0]), pending_tokens=torch.tensor([31, 0]))
    assert meta.temperature.tolist() == [0.5, 0.0] and not meta.all_greedy and not meta.all_random
    assert meta.top_k.tolist() == [3, 50] and meta.top_p is None and meta.min_p is None
    assert meta.min_tokens == {0: {2, 9}}                    # r has 1 output < 2: EOS and its stop id masked
    assert meta.prompt_token_ids.tolist() == [[6, 7], [5, 50]]
    assert meta.output_token_ids.tolist() == [[30], [50]]
    assert meta.repetition_penalties.tolist() == [1.2000000476837158, 1.0]


def test_bad_words_read_only_the_output_tail(monkeypatch):
    """A row's bad-word test reads the last (longest word - 1) output tokens, not its whole output (host work per
    step must not grow with the output), and bans the same tokens as over the whole output."""
    import hayabusa.worker.input_batch as ib
    from hayabusa.sample.metadata import bad_word_bans

    b = InputBatch(max_num_reqs=2, max_model_len=600, max_blocks_per_req=2, vocab_size=50, eos_token_ids=[2],
                   device=torch.device("cpu"))
    p = SamplingParams(temperature=0.0, bad_words=["x"])
    p.bad_words_token_ids = [[5], [7, 8, 9], [3, 4]]
    out = [1] * 497 + [7, 8]                             # 499 outputs after a 1-token prompt
    b.add(CachedRequestState("a", [6], p, None), [6] + out, [0])
    seen = []

    def spy(words, known, num_output):
        seen.append(len(known))
        return bad_word_bans(words, known, num_output)

    monkeypatch.setattr(ib, "bad_word_bans", spy)
    rows = np.array([0])
    _, (_, ids, banned), _ = b._logit_edits(rows, np.array([499]), None)          # every output known
    assert dict(zip(ids.tolist(), banned.tolist())) == {5: True, 9: True}
    _, (_, ids, banned), _ = b._logit_edits(rows, np.array([500]), torch.tensor([3]))   # the last on the device
    assert dict(zip(ids.tolist(), banned.tolist())) == {5: True, 4: True}
    _, (_, ids, banned), _ = b._logit_edits(rows, np.array([500]), torch.tensor([1]))
    assert dict(zip(ids.tolist(), banned.tolist())) == {5: True, 4: False}
    assert seen == [2, 2, 2]                             # the longest word is 3 tokens: 2 tokens read, not 499


def test_allowed_ids_and_biases_made_once_per_request(monkeypatch):
    """A row's allowed_token_ids and logit_bias become device tensors when it gets its row, not every step (a list
    of up to a vocabulary of ids was rebuilt each step); a step's tensors equal those built from the params."""
    import hayabusa.worker.input_batch as ib
    from hayabusa.sample.metadata import logit_edit_row_tensors, logit_edit_tensors

    made = []

    def spy(p, device):
        made.append(p)
        return logit_edit_row_tensors(p, device)

    monkeypatch.setattr(ib, "logit_edit_row_tensors", spy)
    b = _batch()
    pa = SamplingParams(temperature=0.0, allowed_token_ids=[3, 4, 9], logit_bias={4: 2.5})
    pb = SamplingParams(temperature=0.5)
    pc = SamplingParams(temperature=0.0, allowed_token_ids=[7], logit_bias={1: -1.0, 8: 3.0})
    for rid, p in (("a", pa), ("b", pb), ("c", pc)):
        b.add(CachedRequestState(rid, [5], p, None), [5], [0])
    rows = np.array([2, 1, 0])                        # logits order: c, b, a
    for _ in range(3):                                # three steps
        allowed, bad, bias = b._logit_edits(rows, np.array([0, 0, 0]), None)
    assert len(made) == 2 and bad is None
    ref_allowed, _, ref_bias = logit_edit_tensors([pc, pb, pa], [[], [], []], None, "cpu")
    assert [t.tolist() for t in allowed] == [[0, 2], [0, 1, 1, 1], [7, 3, 4, 9]]
    assert [t.tolist() for t in allowed] == [t.tolist() for t in ref_allowed]
    assert [t.tolist() for t in bias] == [[0, 0, 2], [1, 8, 4], [-1.0, 3.0, 2.5]]
    assert [t.tolist() for t in bias] == [t.tolist() for t in ref_bias]
    b.remove("a")
    assert b.row_edits[0] is None
