"""The runner's side of encoder-decoder models (T5): encoder inputs, encoder runs, cross-attention metadata.

Per request the runner keeps the encoder input's token ids (from NewRequestData, kept across preemption); per row
its cross-attention block table and encoder length. A step that admits (or resumes) requests runs their encoders in
one varlen pass, and each decoder layer's cross-attention K/V of that output are written into the requests' cross
blocks of the paged KV cache (``model.store_cross_kv``); later steps only read them.

Cross-attention of a step's decoder tokens is paged attention with one one-token "sequence" per query token:

    query_start_loc = 0, 1, ..., T          (every token is its own sequence)
    seq_lens[t]     = encoder length of token t's request
    block_table[t]  = cross blocks of token t's request
    a one-token sequence of length S sits at position S - 1, so the causal kernel lets it see all S encoder keys

For a decode step (T = R) this is one row per request, in device buffers at fixed addresses: CUDA graphs replay it
(padding rows get seq_len 0 and are skipped).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
from hayabusa.core.kv_cache_manager import cdiv
from hayabusa.core.scheduler_output import SchedulerOutput


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without blocking the host: through pinned memory on CUDA (a copy from pageable
    memory would wait for the work already queued on the stream, undoing async scheduling; PyTorch's caching host
    allocator keeps the pinned block alive until the copy has run)."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class EncoderDecoderRunner:
    """Encoder inputs, cross block tables and the encoder runs of an encoder-decoder model.

    Args:
        model: the model (``encode``, ``store_cross_kv``).
        block_size: tokens per KV block.
        max_num_reqs: rows (max_num_seqs).
        max_num_tokens: tokens per step at most (max_num_batched_tokens).
        max_encoder_len: the longest encoder input (the input processor refuses longer ones).
        device: where the model runs.
    """

    def __init__(self, model, block_size: int, max_num_reqs: int, max_num_tokens: int, max_encoder_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.max_cross_blocks = cdiv(max_encoder_len, block_size)
        self.encoder_ids: dict[str, np.ndarray] = {}                  # request id -> encoder input [n] int64
        R, T = max_num_reqs, max_num_tokens
        self.cross_table = np.zeros((R, self.max_cross_blocks), dtype=np.int32)   # [rows, max_cross_blocks]
        self.enc_lens = np.zeros(R, dtype=np.int32)                                # [rows]
        # per-token cross-attention metadata (device; fixed addresses for the decode graphs)
        self.query_start_loc = torch.arange(T + 1, dtype=torch.int32, device=device)       # [T + 1]
        self.seq_lens = torch.zeros(T, dtype=torch.int32, device=device)                    # [T]
        self.block_table = torch.zeros(T, self.max_cross_blocks, dtype=torch.int32, device=device)  # [T, B_x]
        self._no_slots = torch.empty(0, dtype=torch.int64, device=device)
        self.max_seq_len = 1
        self.max_num_reqs = R
        # the token rows whose metadata the device buffers hold now (None: unknown); a step with the same rows
        # (steady decode) and no row changed since finds it there and copies nothing
        self._prepared_rows: np.ndarray | None = None
        self.num_encoder_tokens = 0       # encoder tokens run (statistics)

    # ------------------------------------------------------------------ state
    def update_states(self, out: SchedulerOutput, row_of: dict[str, int]) -> None:
        """After the runner's own update_states: remember new requests' encoder inputs, and give the rows of new
        and resumed requests their cross block tables."""
        for rid in out.finished_req_ids:
            self.encoder_ids.pop(rid, None)
        for new in out.scheduled_new_reqs:
            if new.encoder_prompt_token_ids is not None:
                self.encoder_ids[new.req_id] = np.array(new.encoder_prompt_token_ids, dtype=np.int64)
                self._set_row(row_of[new.req_id], new.cross_block_ids, len(new.encoder_prompt_token_ids))
        for rid, blocks in out.scheduled_cached_reqs.cross_block_ids.items():
            self._set_row(row_of[rid], blocks, len(self.encoder_ids[rid]))

    def _set_row(self, row: int, blocks: list[int], enc_len: int) -> None:
        assert len(blocks) == cdiv(enc_len, self.block_size), (len(blocks), enc_len)
        self._prepared_rows = None
        self.cross_table[row, :len(blocks)] = blocks
        self.enc_lens[row] = enc_len

    @torch.inference_mode()
    def warm_up_prefill(self, kv_caches, backend, buffers) -> None:
        """Compile the decoder self-attention's prefill variant (with the position bias) now, so the first request
        with a multi-token decoder prompt, or the recompute after a preemption, does not wait for Triton (decode
        variants are compiled by the graph capture). Reads block 0, writes only a scratch tensor; q is a view into
        a fused qkv row as in the model, and the metadata the runner's buffers, so the variant is the one steps
        use."""
        cfg = self.model.config
        H, D = cfg.num_heads, cfg.d_kv
        k_cache, v_cache = kv_caches[0]
        dtype = self.model.shared.weight.dtype
        q = torch.zeros(2, 3 * H * D, dtype=dtype, device=self.device).view(2, 3, H, D).unbind(1)[0]   # [2, H, D]
        out = torch.empty(2, H, D, dtype=dtype, device=self.device)
        qsl, seq_lens, block_table = buffers.query_start_loc[:2], buffers.seq_lens[:1], buffers.block_table[:1]
        qsl.copy_(torch.tensor([0, 2], dtype=torch.int32))
        seq_lens.fill_(2)
        block_table.zero_()
        backend.paged_attention(q, k_cache, v_cache, out, qsl, seq_lens, block_table, 1.0, 2, num_seqs=1,
                                position_bias=self.model.decoder_bias_table())

    # ------------------------------------------------------------------ one step
    def run_encoders(self, out: SchedulerOutput, kv_caches, backend) -> None:
        """Run the encoders of the requests in ``out.scheduled_encoder_prompt_req_ids`` as one varlen batch and
        write every decoder layer's cross-attention K/V into their cross blocks."""
        rids = out.scheduled_encoder_prompt_req_ids
        if not rids:
            return
        new_blocks = {r.req_id: r.cross_block_ids for r in out.scheduled_new_reqs}
        new_blocks.update(out.scheduled_cached_reqs.cross_block_ids)
        enc = [self.encoder_ids[rid] for rid in rids]
        lens = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))          # [R_e]
        ids = np.concatenate(enc)                                                  # [T_e] int64
        slots_t = _to_device(self.cross_slots([new_blocks[rid] for rid in rids], lens), self.device)
        ids_t = _to_device(ids, self.device)
        enc_out = self.model.encode(ids_t, lens.tolist())                         # [T_e, d_model]
        self.model.store_cross_kv(enc_out, slots_t, ForwardContext(None, kv_caches, backend))
        self.num_encoder_tokens += len(ids)

    def cross_slots(self, blocks: list[list[int]], lens: np.ndarray) -> np.ndarray:
        """Cache slots of the encoder tokens [T_e] int64: request i's token j (j < lens[i]) goes to position j of
        its cross blocks ``blocks[i]`` (each ``cdiv(lens[i], block_size)`` block ids). Every slot of every block
        in one broadcast, then the unused tail of each request's last block dropped:

            blocks [7, 2], lens 6, bs 4:  7*4 + 0..3 | 2*4 + 0..3  ->  28 29 30 31 8 9 (10 11 dropped)
        """
        bs = self.block_size
        flat = np.fromiter(itertools.chain.from_iterable(blocks), dtype=np.int64)      # [B_x] every block id
        slots = (flat[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)     # [B_x * bs]
        nb = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))       # [R_e] blocks per request
        tail = nb * bs - lens                                                        # [R_e] unused slots
        if not tail.any():
            return slots
        keep = np.ones(len(slots), dtype=bool)
        ends = np.cumsum(nb * bs)
        for end, n in zip(ends[tail > 0].tolist(), tail[tail > 0].tolist()):      # ragged requests only
            keep[end - n:end] = False
        return slots[keep]

    def prepare(self, rows: np.ndarray, num_scheduled: np.ndarray) -> None:
        """Per-token cross-attention metadata of the step (rows [R] int64, num_scheduled [R] int32) into the
        device buffers; up to max_num_reqs entries after the step's tokens get seq_len 0 (decode-graph padding)."""
        tok_rows = rows if len(rows) == int(num_scheduled.sum()) else np.repeat(rows, num_scheduled)
        prev = self._prepared_rows
        if prev is not None and np.array_equal(prev, tok_rows):
            return      # the buffers hold this step's metadata already (steady decode: the same rows)
        self._prepared_rows = tok_rows.copy()
        T = len(tok_rows)
        seq_lens = self.enc_lens[tok_rows]                                                # [T]
        self.max_seq_len = max(int(seq_lens.max()), 1)
        nb = cdiv(self.max_seq_len, self.block_size)
        self.seq_lens[:T].copy_(_to_device(seq_lens, self.device), non_blocking=True)
        self.block_table[:T, :nb].copy_(_to_device(self.cross_table[tok_rows, :nb], self.device), non_blocking=True)
        self.seq_lens[T:T + self.max_num_reqs].zero_()

    def metadata(self, num_tokens: int) -> AttentionMetadata:
        """Cross-attention metadata of the first ``num_tokens`` tokens (views of the device buffers)."""
        T = num_tokens
        return AttentionMetadata(query_start_loc=self.query_start_loc[:T + 1], seq_lens=self.seq_lens[:T],
                                 block_table=self.block_table[:T], slot_mapping=self._no_slots, num_reqs=T,
                                 max_query_len=1, max_seq_len=self.max_seq_len)
