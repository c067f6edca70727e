"""EncoderDecoderRunner.prepare: the per-token cross-attention metadata, copied to the device buffers only when
the step's token rows or a row's cross blocks changed (steady decode copies nothing; issue #17)."""

import numpy as np
import torch

from hayabusa.worker.encoder_decoder import EncoderDecoderRunner


def test_prepare_copies_only_what_changed():
    r = EncoderDecoderRunner(None, block_size=4, max_num_reqs=4, max_num_tokens=8, max_encoder_len=16,
                             device=torch.device("cpu"))
    r._set_row(0, [3], 2)
    r._set_row(1, [5, 6], 7)
    rows, one = np.array([0, 1]), np.ones(2, dtype=np.int32)
    r.prepare(rows, one)
    assert r.seq_lens[:2].tolist() == [2, 7] and r.max_seq_len == 7
    assert r.block_table[:2, :2].tolist() == [[3, 0], [5, 6]]
    r.seq_lens[:2] = -5                      # the same rows again: the buffers are taken as they are
    r.prepare(rows, one)
    assert r.seq_lens[:2].tolist() == [-5, -5]
    r._set_row(1, [9], 3)                     # a row's cross blocks changed (a new or resumed request)
    r.prepare(rows, one)
    assert r.seq_lens[:2].tolist() == [2, 3] and r.block_table[1, :1].tolist() == [9] and r.max_seq_len == 3
    r.prepare(np.array([1, 0]), one)          # other rows
    assert r.seq_lens[:2].tolist() == [3, 2] and r.block_table[:2, :1].tolist() == [[9], [3]]
    r.prepare(rows, np.array([2, 1], dtype=np.int32))   # a prefill chunk: one entry per token
    assert r.seq_lens[:3].tolist() == [2, 2, 3] and r.seq_lens[3:7].tolist() == [0, 0, 0, 0]
    r.seq_lens[:3] = -1
    r.prepare(rows, np.array([2, 1], dtype=np.int32))   # the same token rows
    assert r.seq_lens[:3].tolist() == [-1, -1, -1]
    r.prepare(rows, one)                      # decode after it: 2 tokens of other rows than the last step's
    assert r.seq_lens[:2].tolist() == [2, 3]
