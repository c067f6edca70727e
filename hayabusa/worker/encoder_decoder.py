"""The runner's side of encoder-decoder models (T5): encoder inputs, encoder runs, cross-attention metadata.

Per request the runner keeps the encoder input's token ids (from NewRequestData, kept across preemption); per row
its cross-attention block table and encoder length. A step that admits (or resumes) requests runs their encoders in
one varlen pass, and each decoder layer's cross-attention K/V of that output are written into the requests' cross
blocks of the paged KV cache (``model.store_cross_kv``); later steps only read them. In batch-invariant mode each
request's encoder runs alone on the packed path (``batch_invariant``), never padded or from a graph.

Cross-attention of a step's decoder tokens is paged attention with one one-token "sequence" per query token:

    query_start_loc = 0, 1, ..., T          (every token is its own sequence)
    seq_lens[t]     = encoder length of token t's request
    block_table[t]  = cross blocks of token t's request
    a one-token sequence of length S sits at position S - 1, so the causal kernel lets it see all S encoder keys

For a decode step (T = R) this is one row per request, in device buffers at fixed addresses: CUDA graphs replay it
(padding rows get seq_len 0 and are skipped).

The encoder runs of a step (issue #17, W9) take padded shapes when they fit a bucket (B requests, L tokens each;
``encoder_buckets``): request i's input at rows i * L .., the keys past its length masked (``model.encode_padded``),
padding rows' and padding requests' cross-KV slots -1 (not written); requests B_real..B-1 are padding (length L,
token 0). The step's ids, slots and lengths go to the device in one copy into a buffer at a fixed address
([ids B*L | slots B*L | lens B] int64 at its start), so on CUDA the encoder and every decoder layer's cross-K/V write
replay one CUDA graph per bucket (one memory pool, captured largest first); with enforce_eager the same padded shapes
run eagerly. On CPU the default is the packed path (padding only costs there; tests switch ``padded_encoder`` on to
run the padded shapes eagerly). Steps that fit no bucket (more requests or tokens than the largest) run the packed
varlen path (``model.encode``), as does every step with ``padded_encoder`` off.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import torch

from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
from hayabusa.core.kv_cache_manager import cdiv
from hayabusa.core.scheduler_output import SchedulerOutput
from hayabusa.envs import env_flag
from hayabusa.errors import HayabusaValidationError

# Padded encoder runs under CUDA graphs on CUDA: on by default since tests/models/test_t5_encoder_graphs_cuda.py
# passed on the H200 (session 13, commit 984f9fb; W9 wall on t5-small 1.69-2.14 s -> 1.38-1.47 s, session 12).
# HAYABUSA_T5_ENCODER_GRAPHS=0 (read at import) or USE_ENCODER_GRAPHS = False (read when the runner is built) runs
# the packed varlen path instead.
USE_ENCODER_GRAPHS = env_flag("HAYABUSA_T5_ENCODER_GRAPHS", True)

logger = logging.getLogger(__name__)

# Encoder buckets hold at most this many tokens (B x L): their activations live in the graphs' pool, whose size
# the KV sizing reserves (ModelRunner._profile_peak_memory); larger encoder steps run the packed path eagerly.
ENCODER_GRAPH_MAX_TOKENS = 8192
ENCODER_GRAPH_MAX_REQS = 64
ENCODER_GRAPH_MIN_LEN = 32


def encoder_buckets(max_encoder_len: int, max_num_reqs: int, max_tokens: int = ENCODER_GRAPH_MAX_TOKENS
                    ) -> list[tuple[int, int]]:
    """The (B requests, L tokens per request) shapes of padded encoder runs, smallest first.

    B: 1, 2, 4, .. below min(max_num_reqs, ENCODER_GRAPH_MAX_REQS), and that minimum; L: 32, 64, 128, .. below
    max_encoder_len, and max_encoder_len; only pairs with B x L <= max_tokens. Padding is bounded: a step of n
    requests whose longest input has m tokens runs on fewer than 2n x 2m tokens (less when m is near
    max_encoder_len).

    Raises:
        HayabusaValidationError: a non-positive argument (parameter named by the error).
    """
    for name, v in (("max_encoder_len", max_encoder_len), ("max_num_reqs", max_num_reqs),
                    ("max_tokens", max_tokens)):
        if not isinstance(v, int) or v < 1:
            raise HayabusaValidationError(f"{name} must be a positive int, got {v!r}", parameter=name, value=v)

    def doubling(start: int, top: int) -> list[int]:
        out, s = [], start
        while s < top:
            out.append(s)
            s *= 2
        return out + [top]

    bs = doubling(1, min(max_num_reqs, ENCODER_GRAPH_MAX_REQS))
    ls = doubling(min(ENCODER_GRAPH_MIN_LEN, max_encoder_len), max_encoder_len)
    return sorted(((b, n) for b in bs for n in ls if b * n <= max_tokens), key=lambda x: (x[0] * x[1], x))


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
        batch_invariant: batch-invariant mode (hayabusa/batch_invariant.py): every request's encoder runs on its
            own, packed (its shapes then depend on its input alone, not on the step's other inputs or on a
            bucket's padding); no padded runs, no encoder graphs.
    """

    def __init__(self, model, block_size: int, max_num_reqs: int, max_num_tokens: int, max_encoder_len: int,
                 device: torch.device, batch_invariant: bool = False) -> None:
        self.model = model
        self.batch_invariant = batch_invariant
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
        # padded encoder runs (the CUDA-graph shapes): buckets, one input buffer at a fixed address, graphs
        # on CUDA (graphs, or the same shapes eagerly with enforce_eager); on CPU the packed path (padding only
        # costs there), as decode steps take padded graph shapes only on CUDA; tests switch it to compare
        self.padded_encoder = device.type == "cuda" and USE_ENCODER_GRAPHS and not batch_invariant
        self.set_buckets(encoder_buckets(max_encoder_len, max_num_reqs))
        self.enc_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}    # empty: run eagerly
        self.enc_graph_pool = None
        self.enc_graph_pool_bytes = 0     # what the capture added to the allocator's reserved memory (CUDA)
        self.enc_graph_profiled_bytes = 0  # what the KV sizing reserved for that pool (profile_graph_memory)
        self.enc_capture_seconds = 0.0
        self.num_padded_runs = 0          # encoder steps run on a bucket's padded shapes
        self.num_encoder_replays = 0      # of those, replayed from a CUDA graph
        self.num_packed_runs = 0          # packed varlen runs (a step's; in batch-invariant mode a request's)

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
        """Run the encoders of the requests in ``out.scheduled_encoder_prompt_req_ids`` as one varlen batch (in
        batch-invariant mode: one packed run per request) and write every decoder layer's cross-attention K/V
        into their cross blocks."""
        rids = out.scheduled_encoder_prompt_req_ids
        if not rids:
            return
        new_blocks = {r.req_id: r.cross_block_ids for r in out.scheduled_new_reqs}
        new_blocks.update(out.scheduled_cached_reqs.cross_block_ids)
        enc = [self.encoder_ids[rid] for rid in rids]
        blocks = [new_blocks[rid] for rid in rids]
        lens = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))          # [R_e]
        if self.batch_invariant:
            for i in range(len(enc)):
                self._run_packed(enc[i:i + 1], lens[i:i + 1], blocks[i:i + 1], kv_caches, backend)
            return
        bucket = self.bucket_for(len(enc), int(lens.max())) if self.padded_encoder else None
        if bucket is not None:
            self._run_padded(bucket, enc, lens, blocks, kv_caches, backend)
            self.num_encoder_tokens += int(lens.sum())
            return
        self._run_packed(enc, lens, blocks, kv_caches, backend)

    def _run_packed(self, enc: list[np.ndarray], lens: np.ndarray, blocks: list[list[int]], kv_caches,
                    backend) -> None:
        """The packed varlen path: the inputs ``enc`` (lengths ``lens`` [R_e] int64) one after another, each
        request's cross K/V into ``blocks``."""
        self.num_packed_runs += 1
        ids = np.concatenate(enc)                                                  # [T_e] int64
        slots_t = _to_device(self.cross_slots(blocks, lens), self.device)
        ids_t = _to_device(ids, self.device)
        enc_out = self.model.encode(ids_t, lens.tolist())                         # [T_e, d_model]
        self.model.store_cross_kv(enc_out, slots_t, ForwardContext(None, kv_caches, backend))
        self.num_encoder_tokens += len(ids)

    # ------------------------------------------------------------------ padded encoder runs (CUDA graphs)
    def set_buckets(self, buckets: list[tuple[int, int]]) -> None:
        """The (B, L) shapes padded encoder runs take (before any capture; tests pass small ones), and the input
        buffer [ids B*L | slots B*L | lens B] int64 sized for the largest."""
        self.buckets = sorted(buckets, key=lambda x: (x[0] * x[1], x))
        self._bucket_set = set(self.buckets)
        self._bucket_bs = sorted({b for b, _ in self.buckets})
        self._bucket_ls = sorted({n for _, n in self.buckets})
        n_in = max(2 * b * n + b for b, n in self.buckets)
        self._enc_in = torch.zeros(n_in, dtype=torch.int64, device=self.device)

    def bucket_for(self, num_reqs: int, max_len: int) -> tuple[int, int] | None:
        """The smallest bucket (B, L) with B >= num_reqs and L >= max_len, or None (the packed path)."""
        b = next((x for x in self._bucket_bs if x >= num_reqs), None)
        n = next((x for x in self._bucket_ls if x >= max_len), None)
        return (b, n) if (b, n) in self._bucket_set else None

    def _views(self, B: int, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bucket (B, L)'s inputs in the fixed buffer: ids [B * L], slots [B * L], lens [B] (int64 views)."""
        T = B * L
        return self._enc_in[:T], self._enc_in[T:2 * T], self._enc_in[2 * T:2 * T + B]

    def padded_inputs(self, B: int, L: int, enc: list[np.ndarray], lens: np.ndarray, blocks: list[list[int]]
                      ) -> np.ndarray:
        """Bucket (B, L)'s input array [2 * B * L + B] int64: ids (request i's at i * L .., 0 elsewhere), cross
        slots (-1 on padding rows: not written) and lengths (L for the padding requests i >= len(enc))."""
        n, T, bs = len(enc), B * L, self.block_size
        out = np.zeros(2 * T + B, dtype=np.int64)
        ids = out[:T].reshape(B, L)
        for i, e in enumerate(enc):
            ids[i, :len(e)] = e
        nb = cdiv(L, bs)
        table = np.zeros((n, nb), dtype=np.int64)                                   # [n, L / bs] cross blocks
        for i, b in enumerate(blocks):
            table[i, :len(b)] = b
        pos = np.arange(L, dtype=np.int64)
        slots = table[:, pos // bs] * bs + pos % bs                                    # [n, L]
        slots[pos[None, :] >= lens[:, None]] = -1
        out[T:2 * T] = -1
        out[T:T + n * L] = slots.reshape(-1)
        out[2 * T:2 * T + B] = L
        out[2 * T:2 * T + n] = lens
        return out

    def _run_padded(self, bucket: tuple[int, int], enc: list[np.ndarray], lens: np.ndarray,
                    blocks: list[list[int]], kv_caches, backend) -> None:
        B, L = bucket
        arr = self.padded_inputs(B, L, enc, lens, blocks)
        src = torch.from_numpy(arr)
        if self.device.type == "cuda":   # one H2D copy straight into the graphs' buffer, without blocking
            src = src.pin_memory()
        self._enc_in[:len(arr)].copy_(src, non_blocking=True)
        self.num_padded_runs += 1
        self.run_padded_forward(B, L, kv_caches, backend)

    def run_padded_forward(self, B: int, L: int, kv_caches, backend) -> None:
        """Bucket (B, L)'s encoder and cross-K/V writes over the inputs in the buffer: its graph's replay, or
        (no graph captured: CPU, enforce_eager) the same shapes eagerly."""
        graph = self.enc_graphs.get((B, L))
        if graph is not None:
            self.num_encoder_replays += 1
            graph.replay()
            return
        self._padded_forward(B, L, kv_caches, backend)

    def _padded_forward(self, B: int, L: int, kv_caches, backend) -> torch.Tensor:
        ids, slots, lens = self._views(B, L)
        enc_out = self.model.encode_padded(ids, lens, L)                              # [B * L, d_model]
        self.model.store_cross_kv(enc_out, slots, ForwardContext(None, kv_caches, backend))
        return enc_out

    def _fill_padding(self, B: int, L: int) -> None:
        """Inputs of B padding requests (token 0, length L, no cache writes) for a capture or a profile."""
        ids, slots, lens = self._views(B, L)
        ids.zero_()
        slots.fill_(-1)
        lens.fill_(L)

    @torch.inference_mode()
    def capture_graphs(self, kv_caches, backend) -> None:
        """Capture every bucket's padded forward (largest first, one pool: smaller graphs reuse its memory; no
        graph keeps an output, so any replay order is safe); the KV caches' and the buffer's addresses are fixed
        from here on. ``enc_graph_pool_bytes``: the reserved memory the capture added, the warm-ups' cached blocks
        released (the KV sizing reserved ``profile_graph_memory`` for it)."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()   # so the reserved delta is the graphs' pool, not the warm-ups' cached blocks
        reserved = torch.cuda.memory_reserved(self.device)
        for B, L in sorted(self.buckets, key=lambda x: (x[0] * x[1], x[1]), reverse=True):   # the [B, H, L, L] bias
            self._fill_padding(B, L)
            self._padded_forward(B, L, kv_caches, backend)   # warm up: compiles Triton kernels, the bias table
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.enc_graph_pool):
                self._padded_forward(B, L, kv_caches, backend)
            if self.enc_graph_pool is None:
                self.enc_graph_pool = graph.pool()
            self.enc_graphs[(B, L)] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.enc_graph_pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        self.enc_capture_seconds = time.perf_counter() - t0
        logger.info("captured %d encoder CUDA graphs (buckets %s) in %.1f s, %.1f MiB", len(self.enc_graphs),
                    self.buckets, self.enc_capture_seconds, self.enc_graph_pool_bytes / 2**20)

    @torch.inference_mode()
    def profile_graph_memory(self) -> int:
        """Bytes the encoder graphs' pool will hold (CUDA): the peak activations of the largest bucket's padded
        encoder run and one decoder layer's cross K/V projection, run now (no cache). The KV sizing adds it to
        the profiled peak, since the pool stays allocated beside the cache."""
        B, L = max(self.buckets, key=lambda x: (x[0] * x[1], x[1]))     # the largest bucket, then bias
        self._fill_padding(B, L)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids, _, lens = self._views(B, L)
        enc_out = self.model.encode_padded(ids, lens, L)
        kv = self.model.dec_blocks[0].cross_attn.kv(enc_out)
        del enc_out, kv
        torch.cuda.synchronize(self.device)
        self.enc_graph_profiled_bytes = max(torch.cuda.max_memory_allocated(self.device) - base, 0)
        return self.enc_graph_profiled_bytes

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
