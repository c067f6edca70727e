"""Persistent per-request state of the runner: one row per running request, with its block table.

Rows are assigned when a request is first scheduled (or resumed after preemption) and released when it leaves;
the block table of a row only grows, by the block ids the scheduler appends.
"""

from __future__ import annotations

import numpy as np

# argmax_from of a request whose token always needs the sampler.
NEVER_ARGMAX = np.iinfo(np.int64).max


class InputBatch:
    """Rows of block tables, and what each row's sampling needs, kept in preallocated numpy arrays.

    Args:
        max_num_reqs: rows (max_num_seqs).
        max_blocks_per_req: columns: cdiv(max_model_len, block_size).
    """

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)  # [rows, max_blocks]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)                          # [rows]
        # Output tokens from which the row's next token is a plain argmax of its logits (greedy, no logprobs, no
        # penalties, min_tokens reached); NEVER_ARGMAX when it always needs the sampler.
        self.argmax_from = np.zeros(max_num_reqs, dtype=np.int64)                         # [rows]
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, req_id: str, block_ids: list[int], argmax_from: int = NEVER_ARGMAX) -> int:
        """Give ``req_id`` a row holding ``block_ids`` (and its ``argmax_from``); returns the row."""
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        n = len(block_ids)
        self.block_table[row, :n] = block_ids
        self.num_blocks[row] = n
        self.argmax_from[row] = argmax_from
        return row

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[req_id]
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self._free_rows.append(row)
