"""StepBuffers: the persistent device tensors a step's inputs are copied into (the CUDA graphs' static inputs)."""

from __future__ import annotations

import torch

from hayabusa.attention.metadata import AttentionMetadata


class StepBuffers:
    """Device buffers sized for the largest step; a step uses their first T tokens / R requests.

    Args:
        max_num_tokens: T at most (max_num_batched_tokens).
        max_num_reqs: R at most (max_num_seqs).
        max_blocks_per_req: block-table columns.
        device: where they live.
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        T, R, d = max_num_tokens, max_num_reqs, device
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=d)            # [T]
        self.positions = torch.zeros(T, dtype=torch.int64, device=d)            # [T]
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=d)   # [T], -1 = padding
        self.query_start_loc = torch.zeros(R + 1, dtype=torch.int32, device=d)  # [R + 1]
        self.seq_lens = torch.zeros(R, dtype=torch.int32, device=d)             # [R]
        self.block_table = torch.zeros(R, max_blocks_per_req, dtype=torch.int32, device=d)  # [R, max_blocks]
        self._arange = torch.arange(R + 1, dtype=torch.int32, device=d)

    def attn_metadata(self, R: int, T: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        """Views of the first R requests / T tokens."""
        return AttentionMetadata(query_start_loc=self.query_start_loc[:R + 1], seq_lens=self.seq_lens[:R],
                                 block_table=self.block_table[:R], slot_mapping=self.slot_mapping[:T], num_reqs=R,
                                 max_query_len=max_query_len, max_seq_len=max_seq_len)

    def pad_decode(self, R: int, bs: int) -> None:
        """Make rows R..bs-1 of a decode step (one token per row) padding: slot -1 (no KV write), seq_len 0 (the
        attention kernel skips them)."""
        self.input_ids[R:bs].zero_()
        self.positions[R:bs].zero_()
        self.slot_mapping[R:bs].fill_(-1)
        self.seq_lens[R:bs].zero_()
        self.query_start_loc[:bs + 1].copy_(self._arange[:bs + 1])  # decode: one query token per row

    def pad_verify(self, T: int, R: int, bs: int, T_pad: int) -> None:
        """Make a verify step of R requests / T tokens the shape of a captured (bs, Q) graph (T_pad = bs x Q):
        tokens T..T_pad-1 padding (input 0, position 0, slot -1: no KV write, in no request's query range),
        requests R..bs-1 without queries (query_start_loc = T) and seq_len 0 (the attention kernel skips them)."""
        self.input_ids[T:T_pad].zero_()
        self.positions[T:T_pad].zero_()
        self.slot_mapping[T:T_pad].fill_(-1)
        self.seq_lens[R:bs].zero_()
        if R == 0:
            self.query_start_loc[:1].zero_()
        self.query_start_loc[R + 1:bs + 1].fill_(T)
