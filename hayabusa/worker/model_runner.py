"""ModelRunner: owns every device tensor; turns a SchedulerOutput into sampled tokens.

Per step: update the persistent batch (rows, block tables), build positions / slot_mapping / query_start_loc
with vectorised numpy on the host, copy them to persistent device buffers in one go, run the model (a CUDA
graph when the step is decode-only and fits a captured size), compute logits only for requests whose prompt is
fully computed, sample, and copy the sampled ids to the host: one sync per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hayabusa.attention.backends import get_attention_backend
from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
from hayabusa.config import EngineConfig
from hayabusa.core.kv_cache_manager import cdiv
from hayabusa.core.request import Request
from hayabusa.core.scheduler import SchedulerOutput
from hayabusa.model.loader import build_model
from hayabusa.sample.metadata import build_sampling_metadata
from hayabusa.sample.sampler import Sampler
from hayabusa.sampling_params import SamplingParams
from hayabusa.worker.input_batch import NEVER_ARGMAX, InputBatch
from hayabusa.worker.kv_cache import allocate_kv_caches, determine_num_blocks

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step (host lists).

    Attributes:
        sampled_token_ids: request id -> new token ids ([] for a request still in a partial prefill).
        logprobs: request id -> (token ids [K+1], logprobs [K+1], rank of the sampled token) for requests that
            asked for logprobs; column 0 is the sampled token.
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)


@dataclass
class StepHandle:
    """A launched step: what ``finish`` needs to collect its tokens."""

    reqs: list[Request]                   # every request in the step
    sampled_reqs: list[Request]           # those that sample a token, in the order of `ids`
    ids: torch.Tensor | None              # [R_s] int64 on the host (pinned), valid once `event` completes
    event: torch.cuda.Event | None        # recorded after the device-to-host copies (CUDA)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


@dataclass
class StepInputs:
    """Host-side inputs of one step (numpy)."""

    reqs: list[Request]
    req_ids: list[str]          # [R] their request ids
    rows: np.ndarray            # [R] int64, each request's row in the persistent batch
    num_scheduled: np.ndarray   # [R] int32
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray        # [R] int32
    positions: np.ndarray       # [T] int64
    input_ids: np.ndarray       # [T] int64
    slot_mapping: np.ndarray    # [T] int64
    block_table: np.ndarray     # [R, max_blocks_in_step] int32
    logits_rows: np.ndarray     # [R_s] int64, rows (in reqs) whose next token is sampled this step
    logits_indices: np.ndarray  # [R_s] int64, token index of each such row's last token
    placeholder_dst: np.ndarray  # [P] int64, token indices whose id comes from the previous step's samples
    placeholder_src: np.ndarray  # [P] int64, rows of the previous step's sampled-token tensor


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, captures CUDA graphs, and runs steps.

    Args:
        cfg: the engine config.
    """

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = cfg.device_config.device
        mc, sc = cfg.model_config, cfg.scheduler_config
        self.block_size = cfg.cache_config.block_size
        self.vocab_size = mc.vocab_size
        t0 = time.perf_counter()
        self.model = build_model(mc, self.device)
        self.load_seconds = time.perf_counter() - t0
        self.backend = get_attention_backend(self.device)
        self.sampler = Sampler()
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_blocks_per_req = cdiv(sc.max_model_len, self.block_size)
        self.batch = InputBatch(self.max_num_reqs, self.max_blocks_per_req)
        self._alloc_device_buffers()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.graphs = None
        self.decode_runner = None
        # The previous launched step's sampled tokens (device) and each sampling request's row in them: a
        # placeholder input token of this step is read from there.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sample_row: dict[str, int] = {}
        self._eos = list(mc.eos_token_ids)

    def _alloc_device_buffers(self) -> None:
        d, T, R = self.device, self.max_num_tokens, self.max_num_reqs
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=d)
        self.positions = torch.zeros(T, dtype=torch.int64, device=d)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=d)
        self.query_start_loc = torch.zeros(R + 1, dtype=torch.int32, device=d)
        self.seq_lens = torch.zeros(R, dtype=torch.int32, device=d)
        self.block_table = torch.zeros(R, self.max_blocks_per_req, dtype=torch.int32, device=d)
        self.staging = None
        if d.type == "cuda":  # pinned host buffers: H2D copies from them are asynchronous
            def pinned(n: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(n, dtype=dtype, pin_memory=True)

            # Two sets, alternating per step: with async scheduling step N+1 is prepared while step N's copies
            # may still be queued.
            self._staging_sets = [
                {"input_ids": pinned(T, torch.int64), "positions": pinned(T, torch.int64),
                 "slot_mapping": pinned(T, torch.int64), "query_start_loc": pinned(R + 1, torch.int32),
                 "seq_lens": pinned(R, torch.int32), "block_table": pinned(R * self.max_blocks_per_req, torch.int32),
                 "sampled": pinned(R, torch.int64)} for _ in range(2)]
            self.staging = self._staging_sets[0]
            self.block_table_staging = torch.empty(R * self.max_blocks_per_req, dtype=torch.int32, device=d)

    # ------------------------------------------------------------------ KV cache + graphs
    def initialize_kv_cache(self) -> int:
        """Profile peak memory (CUDA), size and allocate the KV cache, capture CUDA graphs. Returns num_blocks."""
        peak, non_torch = None, 0
        if self.device.type == "cuda" and self.cfg.cache_config.num_gpu_blocks_override is None \
                and self.cfg.cache_config.kv_cache_memory_bytes is None:
            peak, non_torch = self._profile_peak_memory()
        self.num_blocks = determine_num_blocks(self.cfg, peak, non_torch)
        self.kv_caches = allocate_kv_caches(self.cfg, self.num_blocks)
        if self.device.type == "cuda":
            from hayabusa.worker.cuda_graph import CUDAGraphRunner

            self.decode_runner = CUDAGraphRunner(self, use_graphs=not self.cfg.enforce_eager)
            if self.decode_runner.use_graphs:
                self.decode_runner.capture()
                self.graphs = self.decode_runner
            self._warm_up_prefill_attention()
        return self.num_blocks

    @torch.inference_mode()
    def _warm_up_prefill_attention(self) -> None:
        """Compile the prefill variant of the attention kernel now, once per distinct layer kind (window,
        soft-cap, heads), so the first request does not wait for Triton (the decode variants are compiled by the
        graph capture, and the memory profile runs without a cache). Reads block 0, writes only a scratch tensor."""
        from hayabusa.model.layers.attention import Attention

        seen = set()
        t0 = time.perf_counter()
        for layer in self.model.modules():
            if not isinstance(layer, Attention):
                continue
            kind = (layer.num_heads, layer.num_kv_heads, layer.head_dim, bool(layer.sliding_window),
                    bool(layer.softcap))
            if kind in seen:
                continue
            seen.add(kind)
            k_cache, v_cache = self.kv_caches[layer.layer_idx]
            # Triton specializes on strides (== 1, % 16): q is a view into a fused qkv row as in the model, and
            # the block table is the runner's own buffer, so the variant compiled here is the one steps use.
            H, H_kv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
            qkv = torch.zeros(2, (H + 2 * H_kv) * D, dtype=self.cfg.model_config.dtype, device=self.device)
            q = qkv.view(2, H + 2 * H_kv, D)[:, :H]
            out = torch.empty(2, H, D, dtype=q.dtype, device=self.device)
            qsl, seq_lens = self.query_start_loc[:2], self.seq_lens[:1]
            qsl.copy_(torch.tensor([0, 2], dtype=torch.int32))
            seq_lens.fill_(2)
            block_table = self.block_table[:1]
            block_table.zero_()
            self.backend.paged_attention(q, k_cache, v_cache, out, qsl, seq_lens, block_table, layer.scale, 2,
                                         num_seqs=1, sliding_window=layer.sliding_window, softcap=layer.softcap,
                                         k_scale=layer.k_scale, v_scale=layer.v_scale)
        torch.cuda.synchronize(self.device)
        logger.info("prefill attention kernels ready in %.1f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def _profile_peak_memory(self) -> tuple[int, int]:
        """Run the largest step without a KV cache; returns (torch peak bytes, non-torch bytes in use)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        T = self.max_num_tokens
        ctx = ForwardContext(None, None, self.backend)
        hidden = self.model(self.input_ids[:T], self.positions[:T], ctx)
        idx = torch.arange(min(self.max_num_reqs, T), device=self.device)
        logits = self.model.compute_logits(hidden[idx]).float()
        # The sampler's top-p/top-k path sorts the fp32 logits: keep that peak in the profile.
        torch.sort(logits, dim=-1)
        del hidden, logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        torch.cuda.empty_cache()
        return peak, non_torch

    # ------------------------------------------------------------------ one step
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        return self.finish(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> "StepHandle":
        """Queue one step's work on the device without waiting for it (the host is free until ``finish``).

        A decode row whose input token was sampled by the previous step but is not back on the host yet
        (a placeholder) reads it from that step's sampled-token tensor on the device.
        """
        self._update_batch(out)
        if out.is_empty:
            self._prev_sampled, self._prev_sample_row = None, {}
            return StepHandle([], [], None, None, None)
        if self.staging is not None:
            self.staging = self._staging_sets[1] if self.staging is self._staging_sets[0] else self._staging_sets[0]
        inp = self._prepare_inputs(out)
        logits = self._run_model(inp)                       # [R_s, V]
        return self._sample(inp, logits)

    def forget_previous_step(self) -> None:
        """Drop the link to the previous step's sampled tokens (after a failed step whose requests are aborted):
        no later step may read placeholders from it."""
        self._prev_sampled, self._prev_sample_row = None, {}

    def finish(self, handle: "StepHandle") -> ModelRunnerOutput:
        """Wait for a launched step (the step's one sync) and return its tokens as host lists."""
        if handle.ids is None:
            return ModelRunnerOutput({r.request_id: [] for r in handle.reqs})
        if handle.event is not None:
            handle.event.synchronize()
        sampled = {req.request_id: [tok] for req, tok in zip(handle.sampled_reqs, handle.ids.tolist())}
        if len(sampled) < len(handle.reqs):  # requests in a partial prefill: no token
            sampled = {r.request_id: sampled.get(r.request_id, []) for r in handle.reqs}
        result = ModelRunnerOutput(sampled)
        if handle.logprobs is not None:
            lp_ids, lp_vals, ranks = (t.tolist() for t in handle.logprobs)
            for i, req in enumerate(handle.sampled_reqs):
                k = req.sampling_params.logprobs
                if k is not None:
                    result.logprobs[req.request_id] = (lp_ids[i][:k + 1], lp_vals[i][:k + 1], ranks[i])
        return result

    def _update_batch(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.batch.remove(rid)
        new = out.scheduled_new_reqs
        if new:
            for req in out.scheduled_reqs:
                if req.request_id in new:
                    self.batch.add(req.request_id, out.new_block_ids[req.request_id],
                                   self._argmax_from(req.sampling_params))
        for rid, block_ids in out.new_block_ids.items():
            if block_ids and rid not in new:
                self.batch.append_blocks(rid, block_ids)

    @staticmethod
    def _argmax_from(p: SamplingParams) -> int:
        """Output tokens from which a request's next token is a plain argmax of its logits: min_tokens when it is
        greedy with no logprobs and no penalties, else never (NEVER_ARGMAX)."""
        if not p.greedy or p.logprobs is not None or p.has_penalties:
            return NEVER_ARGMAX
        return p.min_tokens

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        reqs = out.scheduled_reqs
        R = len(reqs)
        rids = [r.request_id for r in reqs]
        rows = np.fromiter(map(self.batch.row_of.__getitem__, rids), dtype=np.int64, count=R)
        T = out.total_num_scheduled_tokens
        decode = T == R                      # one token per request: no per-request counts or slices
        if decode:
            num_sched = np.ones(R, dtype=np.int32)
        else:
            num_sched = np.fromiter(map(out.num_scheduled_tokens.__getitem__, rids), dtype=np.int32, count=R)
        num_computed = np.fromiter(map(out.num_computed_tokens.__getitem__, rids), dtype=np.int64, count=R)
        qsl = np.zeros(R + 1, dtype=np.int32)
        np.cumsum(num_sched, out=qsl[1:])
        assert int(qsl[-1]) == T, (int(qsl[-1]), T)
        #  |<-- num_computed -->|<-- num_sched -->|
        #  | KV already cached  | computed now     |   positions = num_computed + 0..num_sched-1
        positions = np.repeat(num_computed - qsl[:-1], num_sched) + np.arange(T, dtype=np.int64)
        if decode:
            input_ids, ph_dst, ph_src = self._gather_decode_ids(reqs, rids, num_computed)
        else:
            input_ids, ph_dst, ph_src = self._gather_input_ids(reqs, num_computed.tolist(), num_sched.tolist(),
                                                               qsl, T)
        sampling = out.sampling_req_ids
        if len(sampling) == R:
            sampled_rows = np.arange(R, dtype=np.int64)
        else:
            sampled_rows = np.array([i for i, rid in enumerate(rids) if rid in sampling], dtype=np.int64)
        seq_lens = (num_computed + num_sched).astype(np.int32)
        tok_rows = np.repeat(rows, num_sched)
        bt = self.batch.block_table
        slot_mapping = bt[tok_rows, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        return StepInputs(reqs, rids, rows, num_sched, qsl, seq_lens, positions, input_ids, slot_mapping,
                          bt[rows, :max_blocks], sampled_rows, (qsl[1:][sampled_rows] - 1).astype(np.int64),
                          ph_dst, ph_src)

    def _gather_input_ids(self, reqs: list[Request], computed: list[int], num_sched: list[int], qsl: np.ndarray,
                          T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Input ids of the step ([T] int64, 0 where a placeholder goes) and the placeholders' (dst, src)
        pairs ([P] int64 each): dst indexes this step's tokens, src the previous step's sampled-token tensor."""
        ids = np.zeros(T, dtype=np.int64)
        ph_dst: list[int] = []
        ph_src: list[int] = []
        prev = self._prev_sample_row
        for i, (r, c, n) in enumerate(zip(reqs, computed, num_sched)):
            toks = r.all_token_ids[c:c + n]
            start = int(qsl[i])
            ids[start:start + len(toks)] = toks
            if len(toks) < n:  # the last input token was sampled by the previous step, still on the device
                assert len(toks) == n - 1 and r.request_id in prev, (r, c, n)
                ph_dst.append(start + n - 1)
                ph_src.append(prev[r.request_id])
        return ids, np.array(ph_dst, dtype=np.int64), np.array(ph_src, dtype=np.int64)

    def _gather_decode_ids(self, reqs: list[Request], rids: list[str],
                           num_computed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_gather_input_ids`` for a step of one token per request (T == R), without per-request numpy
        writes: request i's input is its token at position num_computed[i], or a placeholder when that token
        was sampled by the previous step and is not back yet (num_computed[i] == num_tokens)."""
        PLACEHOLDER = -1
        ids = np.fromiter((toks[c] if c < len(toks) else PLACEHOLDER
                           for toks, c in zip([r.all_token_ids for r in reqs], num_computed.tolist())),
                          dtype=np.int64, count=len(reqs))
        ph_dst = np.flatnonzero(ids == PLACEHOLDER)
        if len(ph_dst) == 0:
            return ids, ph_dst, ph_dst
        ids[ph_dst] = 0
        # a placeholder's request sampled in the previous step (a KeyError here is a broken invariant)
        ph_src = np.fromiter(map(self._prev_sample_row.__getitem__, [rids[i] for i in ph_dst.tolist()]),
                             dtype=np.int64, count=len(ph_dst))
        return ids, ph_dst, ph_src

    def _copy_inputs(self, inp: StepInputs) -> None:
        """Host -> persistent device buffers (through pinned staging buffers on CUDA: truly async copies)."""
        T, R = len(inp.input_ids), len(inp.reqs)
        nb = min(inp.block_table.shape[1], self.block_table.shape[1])
        st = self.staging
        pairs = [(self.input_ids[:T], inp.input_ids), (self.positions[:T], inp.positions),
                 (self.slot_mapping[:T], inp.slot_mapping), (self.query_start_loc[:R + 1], inp.query_start_loc),
                 (self.seq_lens[:R], inp.seq_lens)]
        if st is None:  # CPU: plain copies
            for dst, src in pairs:
                dst.copy_(torch.from_numpy(src))
            self.block_table[:R, :nb].copy_(torch.from_numpy(inp.block_table[:, :nb]))
            self._fill_placeholders(inp)
            return
        for (dst, src), name in zip(pairs, ("input_ids", "positions", "slot_mapping", "query_start_loc",
                                            "seq_lens")):
            host = st[name][:len(src)]
            host.numpy()[:] = src
            dst.copy_(host, non_blocking=True)
        bt_host = st["block_table"][:R * nb].view(R, nb)
        bt_host.numpy()[:] = inp.block_table[:, :nb]
        bt_dev = self.block_table_staging[:R * nb].view(R, nb)
        bt_dev.copy_(bt_host, non_blocking=True)
        self.block_table[:R, :nb].copy_(bt_dev)      # strided device-side copy into the static table
        self._fill_placeholders(inp)

    def _fill_placeholders(self, inp: StepInputs) -> None:
        """Input ids that the previous step sampled and the host does not know yet, copied on the device."""
        P = len(inp.placeholder_dst)
        if P == 0:
            return
        in_order = np.arange(P)
        if np.array_equal(inp.placeholder_dst, in_order) and np.array_equal(inp.placeholder_src, in_order):
            # steady decode: token i's input is the previous step's sample i (same requests, same order)
            self.input_ids[:P].copy_(self._prev_sampled[:P])
            return
        dst = torch.from_numpy(inp.placeholder_dst).to(self.device, non_blocking=True)
        src = torch.from_numpy(inp.placeholder_src).to(self.device, non_blocking=True)
        self.input_ids[dst] = self._prev_sampled[src]

    def attn_metadata(self, R: int, T: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.query_start_loc[:R + 1], seq_lens=self.seq_lens[:R],
                                 block_table=self.block_table[:R], slot_mapping=self.slot_mapping[:T], num_reqs=R,
                                 max_query_len=max_query_len, max_seq_len=max_seq_len)

    def _run_model(self, inp: StepInputs) -> torch.Tensor:
        T, R = len(inp.input_ids), len(inp.reqs)
        max_q = int(inp.num_scheduled.max())
        if self.decode_runner is not None and max_q == 1 and self.decode_runner.can_run(R):
            # Decode-only: padded to a capture size, replayed from a CUDA graph (or run eagerly on the same padded
            # shapes with enforce_eager, so both give the same numbers).
            logits = self.decode_runner.run(inp)            # [R, V]
            if len(inp.logits_rows) < R:
                logits = logits[torch.from_numpy(inp.logits_rows).to(self.device)]
            return logits
        self._copy_inputs(inp)
        ctx = ForwardContext(self.attn_metadata(R, T, max_q, int(inp.seq_lens.max())), self.kv_caches, self.backend)
        hidden = self.model(self.input_ids[:T], self.positions[:T], ctx)           # [T, hidden]
        if len(inp.logits_indices) == 0:
            return hidden.new_empty(0, self.vocab_size)
        idx = torch.from_numpy(inp.logits_indices).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[idx])                               # [R_s, V]

    def _is_plain_greedy(self, reqs: list[Request], rows: np.ndarray) -> bool:
        """Every row is greedy with nothing that needs the sampler (logprobs, penalties, pending min_tokens).

        Args:
            reqs: the sampled requests.
            rows: [R_s] int64, their rows in the persistent batch.
        """
        argmax_from = self.batch.argmax_from[rows]               # [R_s] int64
        latest = int(argmax_from.max()) if len(rows) else 0
        if latest == 0:
            return True
        if latest == NEVER_ARGMAX:
            return False
        num_output = np.fromiter((len(r.output_token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        return bool((num_output >= argmax_from).all())

    def _sample(self, inp: StepInputs, logits: torch.Tensor) -> StepHandle:
        """Sample on the device and queue the copy of the tokens to the host (no wait here)."""
        if len(inp.logits_rows) == len(inp.reqs):  # every request samples (decode)
            reqs, rids = inp.reqs, inp.req_ids
        else:
            rows = inp.logits_rows.tolist()
            reqs, rids = [inp.reqs[i] for i in rows], [inp.req_ids[i] for i in rows]
        self._prev_sample_row = dict(zip(rids, range(len(rids))))
        if logits.shape[0] == 0:
            self._prev_sampled = None
            return StepHandle(inp.reqs, [], None, None, None)
        lp = None
        if self._is_plain_greedy(reqs, inp.rows[inp.logits_rows]):  # fast path: argmax, no sampling metadata
            ids = logits.argmax(dim=-1)
        else:
            meta = build_sampling_metadata(
                [r.sampling_params for r in reqs], [r.prompt_token_ids for r in reqs],
                [r.output_token_ids for r in reqs], [self._generator(r) for r in reqs],
                eos_token_id=self._eos, vocab_size=self.vocab_size, device=self.device)
            sampled = self.sampler(logits, meta)
            ids = sampled.sampled_token_ids
            if sampled.logprobs is not None:
                lp = (sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_token_ranks)
        self._prev_sampled = ids                               # [R_s] int64, read by the next step's placeholders
        if self.device.type != "cuda":
            return StepHandle(inp.reqs, reqs, ids, None, lp)
        host = self.staging["sampled"][:len(reqs)]
        host.copy_(ids, non_blocking=True)
        if lp is not None:
            lp = tuple(t.to("cpu", non_blocking=True) for t in lp)
        event = torch.cuda.Event()
        event.record()
        return StepHandle(inp.reqs, reqs, host, event, lp)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = getattr(req, "generator", None)
        if gen is None:  # lives on the request, so it survives preemption
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            req.generator = gen
        return gen
