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
