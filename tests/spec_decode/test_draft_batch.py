"""worker/spec_verify.py's DraftBatch: what the draft model's and the EAGLE head's ``propose`` share (the proposing
requests' last-token indices, block-table rows and the metadata of one batched one-token forward); exact values."""

import numpy as np
import torch

from hayabusa.worker.spec_verify import draft_batch, to_device


def test_draft_batch_and_one_token_metadata():
    qsl = np.array([0, 3, 4, 8], dtype=np.int32)                     # 3 requests: 3, 1 and 4 tokens
    table = torch.tensor([[5, 6], [7, 8], [9, 10]], dtype=torch.int32)
    db = draft_batch(np.array([0, 2]), qsl, table, torch.device("cpu"))   # requests 0 and 2 propose
    assert db.first.tolist() == [0, 4] and db.first.dtype == np.int64
    assert db.query_start_loc.tolist() == [0, 1, 2] and db.query_start_loc.dtype == torch.int32
    assert db.block_table.tolist() == [[5, 6], [9, 10]]
    positions = np.array([10, 11, 12, 3, 20, 21, 22, 23], dtype=np.int64)
    slots = np.array([40, 41, 42, 30, 80, 81, 82, 83], dtype=np.int64)
    meta, pos = db.metadata(np.array([1, 6]), np.array([True, False]), positions, slots)
    assert pos.tolist() == [11, 22] and pos.dtype == torch.int64
    assert meta.seq_lens.tolist() == [12, 23] and meta.seq_lens.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [41, -1] and meta.slot_mapping.dtype == torch.int64   # not valid: no write
    assert (meta.num_reqs, meta.max_query_len, meta.max_seq_len) == (2, 1, 23)
    assert meta.query_start_loc is db.query_start_loc and meta.block_table is db.block_table


def test_to_device_copies_with_the_dtype():
    a = np.array([[1, 2], [3, 4]], dtype=np.int64)[:, 1]            # not contiguous
    t = to_device(a, np.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [2, 4]
