"""Host-time cuts of issue #17 (T5's W9): the heap frozen out of the garbage collector while LLM.generate runs (and
unfrozen after), and add_request's checks of token ids in C with the same answers and errors as the per-item
loop."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.engine.input_processor import InputProcessor, first_out_of_vocab
from hayabusa.errors import HayabusaValidationError


def test_generate_freezes_the_heap_while_it_runs(tiny_llama):
    """LLM.generate runs with the heap it found frozen (gc.freeze: full collections skip it) and unfreezes it at the
    end, so nothing stays out of the collector's reach; a heap frozen already (the server's) stays frozen."""
    llm = LLM(tiny_llama, device="cpu", max_num_seqs=4, max_model_len=64)
    engine = llm.llm_engine
    seen = []
    step = engine.step

    def recording_step():
        seen.append(gc.get_freeze_count())
        return step()

    engine.step = recording_step
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert gc.get_freeze_count() == 0
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert len(seen) == 3 and min(seen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False)
        # still frozen (a few frozen objects were freed by reference counting meanwhile)
        assert frozen - 1000 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_first_out_of_vocab():
    assert first_out_of_vocab([0, 5, 9], 10) is None
    assert first_out_of_vocab([], 10) is None
    assert first_out_of_vocab([3, 10, 11], 10) == 1
    assert first_out_of_vocab([3, 4, -1, 20], 10) == 2


def test_as_ids_fast_path_copies_and_refuses_as_before():
    ids = [1, 2, 3]
    got = InputProcessor._as_ids(ids)
    assert got == [1, 2, 3] and got is not ids                  # a copy: the caller's list stays theirs
    assert InputProcessor._as_ids((1, 2)) == [1, 2]
    got = InputProcessor._as_ids([np.int64(4), 5])              # numpy ints: the per-item path, plain ints out
    assert got == [4, 5] and all(type(t) is int for t in got)
    for bad, pos in (([1, True], 1), ([1, 2.0], 1), (["3"], 0)):
        with pytest.raises(HayabusaValidationError, match=f"position {pos}") as e:
            InputProcessor._as_ids(bad)
        assert e.value.parameter == "prompt_token_ids"


def test_cross_slots_vectorised():
    """Encoder tokens' cache slots: request i's token j at position j of its cross blocks (block_size 4)."""
    from hayabusa.worker.encoder_decoder import EncoderDecoderRunner

    r = EncoderDecoderRunner.__new__(EncoderDecoderRunner)
    r.block_size = 4
    slots = r.cross_slots([[7, 2], [5], [9, 3, 1]], np.array([6, 1, 9]))
    assert slots.dtype == np.int64
    assert slots.tolist() == [28, 29, 30, 31, 8, 9,                     # blocks 7 | 2
                              20,                                       # block 5
                              36, 37, 38, 39, 12, 13, 14, 15, 4]        # blocks 9 | 3 | 1


def test_encoder_bias_is_a_corner_of_one_table():
    """The encoder's position bias for any length is the top-left corner of the one cached table, equal to the
    bias computed for that length directly (bidirectional buckets of key - query)."""
    import torch
    from transformers import T5Config

    from hayabusa.model.t5 import T5ForConditionalGeneration, _Padding, relative_position_bucket

    cfg = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, n_positions=37)
    model = T5ForConditionalGeneration(cfg, torch.float32, torch.device("cpu"), max_position=20)
    assert model.max_encoder_len == 37           # the model's limit (n_positions), not the decoder's max_position
    torch.nn.init.normal_(model.enc_rel_bias.weight)
    for L in (1, 5, 37, 50):
        pos = torch.arange(L)
        want = model.enc_rel_bias(relative_position_bucket(pos[None, :] - pos[:, None], True, 8, 16))
        got = model._encoder_bias(L, _Padding([L, L], torch.device("cpu")), torch.float32)
        assert got.shape == (1, 2, L, L) and torch.equal(got[0], want.permute(2, 0, 1))
    assert model._enc_bias.shape[-1] == 64        # grown once past max_encoder_len (48: 37 rounded up to 16) for 50
    ragged = model._encoder_bias(5, _Padding([5, 3], torch.device("cpu")), torch.float32)     # padding keys masked
    assert ragged.shape == (2, 2, 5, 5) and (ragged[1, :, :, 3:] < -1e30).all() and torch.isfinite(ragged[0]).all()


def test_progress_bar_counts_every_prompt_and_redraws_per_interval_not_per_request(tiny_llama, monkeypatch):
    """use_tqdm: the bar counts every prompt (updated once per step with that step's finished requests) and is
    redrawn by tqdm's own mininterval, never once per finished request (a forced redraw per request cost ~40 us
    each: 80 ms of W9's 2,000 requests inside the bench's timer)."""
    import tqdm.auto

    bars = []

    class RecordingBar(tqdm.auto.tqdm):
        def __init__(self, *a, **kw):
            self.redraws, self.updates = 0, []
            super().__init__(*a, **{**kw, "mininterval": 1e9, "disable": False})   # only forced redraws
            bars.append(self)

        def refresh(self, *a, **kw):
            self.redraws += 1
            return super().refresh(*a, **kw)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    llm = LLM(tiny_llama, device="cpu", max_num_seqs=32, max_model_len=64)
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i % 6, ignore_eos=True) for i in range(24)]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(24)]
    outs = llm.generate(prompts, params, use_tqdm=True)
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1 + i % 6 for i in range(24)]
    (bar,) = bars
    assert bar.n == 24 and sum(bar.updates) == 24
    assert len(bar.updates) == 6 and max(bar.updates) == 4      # one update per step that finished requests
    assert bar.redraws <= 2                                     # not one per finished request (24)
    assert "tok/s" in bar.postfix
