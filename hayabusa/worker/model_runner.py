"""ModelRunner: owns every device tensor; turns a SchedulerOutput into sampled tokens.

The runner keeps its own state of every request (``CachedRequestState``, rows of ``InputBatch``: token ids, block
table, sampling settings, generator), built from the plain-data SchedulerOutputs alone: it never sees a scheduler
``Request``. Per step: update the persistent batch, build positions / input ids (one gather from the rows' token
ids) / slot_mapping / query_start_loc with vectorised numpy on the host, copy them to persistent device buffers in one go, run the model (a CUDA
graph when the step is decode-only and fits a captured size), compute logits only for requests whose prompt is
fully computed, sample, and copy the sampled ids to the host: one sync per step.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hayabusa.attention.backends import get_attention_backend
from hayabusa.attention.metadata import ForwardContext
from hayabusa.config import EngineConfig
from hayabusa.core.kv_cache_manager import cdiv
from hayabusa.core.scheduler_output import SchedulerOutput
from hayabusa.distributed.config import get_pp_indices
from hayabusa.distributed.parallel_state import broadcast_from_last_stage, pp_rank, pp_size, tp_rank, tp_size
from hayabusa.model.layers.pipeline import run_stage
from hayabusa.model.layers.tensor_parallel import build_sharded_model
from hayabusa.model.loader import build_model
from hayabusa.sample.bitmask import apply_token_bitmask
from hayabusa.sample.sampler import Sampler
from hayabusa.worker.cpu_offload import maybe_offload
from hayabusa.worker.input_batch import CachedRequestState, InputBatch
from hayabusa.worker.kv_cache import allocate_kv_buffer, determine_num_blocks, kv_cache_views
from hayabusa.worker.spec_verify import SpecStepInputs, plan_verify, verify, write_drafts
from hayabusa.worker.kv_swap import KVSwapper, num_cpu_blocks
from hayabusa.worker.prompt_logprobs import (CHUNK_ROWS, PromptLogprobsPending, PromptLogprobsPlan,
                                             compute_prompt_logprobs, plan_prompt_logprobs)
from hayabusa.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


def release_unreachable_cuda_memory() -> None:
    """Free what an earlier engine of this process left behind before this one loads weights and sizes its KV
    cache: a script that deletes one ``LLM`` and makes the next (report 000 loops over max_num_seqs, report 001 over
    gpu_memory_utilization, each at 0.95) would otherwise see the earlier engine's KV cache, still held by reference
    cycles (CUDA graphs, callbacks) until the garbage collector runs, as memory in use, and fail to fit. As vLLM's
    worker does at start-up: ``gc.collect()``, then ``torch.cuda.empty_cache()``."""
    gc.collect()
    torch.cuda.empty_cache()


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step (host lists).

    Attributes:
        sampled_token_ids: request id -> new token ids ([] for a request still in a partial prefill).
        logprobs: request id -> (token ids [K+1], logprobs [K+1], rank of the sampled token) for requests that
            asked for logprobs; column 0 is the sampled token.
        prompt_logprobs: request id -> (ids [n][k+1], logprobs [n][k+1], ranks [n]) of the next n prompt tokens
            whose logprobs this step computed (column 0: the actual prompt token), for prompt_logprobs requests.
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)


@dataclass
class StepHandle:
    """A launched step: what ``finish`` needs to collect its tokens."""

    req_ids: list[str]                    # every request in the step
    sampled_req_ids: list[str]            # those that sample a token, in the order of `ids`
    ids: torch.Tensor | None              # [R_s] int64 on the host (pinned), valid once `event` completes
    event: torch.cuda.Event | None        # recorded after the device-to-host copies (CUDA)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    rows: np.ndarray | None = None        # [R_s] int64, the sampled requests' rows
    epochs: np.ndarray | None = None      # [R_s] int64, those rows' owners (InputBatch.row_epoch) at launch
    num_logprobs: list[int] | None = None  # [R_s] each sampled request's logprobs (-1 = none)
    prompt_logprobs: PromptLogprobsPending | None = None   # copied with the step's sync
    received: Any = None                  # a pipeline stage before the last: the broadcast of `ids` (a Work)


@dataclass
class PendingSample:
    """A launched step whose forward is queued and whose sampling waits for the grammar bitmask (structured
    outputs): the host fills the bitmask while the device runs the model, then calls ``sample_tokens``."""

    inputs: "StepInputs"
    logits: torch.Tensor
    out: SchedulerOutput


@dataclass
class StepInputs:
    """Host-side inputs of one step (numpy)."""

    req_ids: list[str]          # [R] the step's request ids, in batch order
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
    mm: Any = None              # StepMultiModal (worker/mm_inputs.py): image rows / M-RoPE positions, or None
    prompt_logprobs: PromptLogprobsPlan | None = None       # positions whose prompt logprobs this step computes
    prompt_logprobs_out: PromptLogprobsPending | None = None  # their logprobs (device), set by _run_model
    spec: SpecStepInputs | None = None   # a verify step (speculative decoding): logits_indices cover 1 + k positions
    eagle: Any = None            # EAGLE: (attention metadata, head input [T, H]) for the mirror after sampling

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


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
        if self.device.type == "cuda":
            release_unreachable_cuda_memory()
        # a pipeline stage (pipeline_parallel_size > 1) holds decoder layers [first_layer, end) only, and their KV
        self.pipeline = pp_size() > 1
        self.first_layer, stage = 0, None
        if self.pipeline:
            start, end = get_pp_indices(mc.hf_config.num_hidden_layers, pp_rank(), pp_size())
            self.first_layer, stage = start, (start, end, pp_rank() == 0, pp_rank() == pp_size() - 1)
        self.model = build_model(mc, self.device) if tp_size() == 1 and stage is None else build_sharded_model(
            mc, self.device, tp_rank(), tp_size(), stage)   # a worker keeps its stage's layers, its shard of them
        # cpu_offload_gb: chosen layers' weights to CPU memory, streamed back each forward through a GPU ring (hooks
        # on the layers; before the KV profile, so the cache sizing sees the freed weights and the ring)
        self.offloader = maybe_offload(self.model, cfg, self.device)
        self.draft = None   # speculative decoding's draft model (worker/draft_model.py)
        if cfg.draft_model_config is not None:
            method = cfg.speculative_config.method
            if getattr(self.model, "is_multimodal", False):
                from hayabusa.errors import HayabusaValidationError

                raise HayabusaValidationError("a draft model needs a text-only target model.",
                                              parameter="speculative_config.method", value=method)
            if method in ("eagle", "eagle3"):   # a head on the target's hidden states (worker/eagle.py)
                from hayabusa.worker.eagle import EagleDrafter

                self.draft = EagleDrafter(cfg, self.model, self.device, sc.max_num_seqs)
            else:
                from hayabusa.worker.draft_model import DraftModel

                self.draft = DraftModel(cfg, self.device)
        self.load_seconds = time.perf_counter() - t0
        bi = getattr(mc, "batch_invariant", False)   # batch-invariant mode (hayabusa/batch_invariant.py)
        self.backend = get_attention_backend(self.device, batch_invariant=bi)
        self.sampler = Sampler(batch_invariant=bi)
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_blocks_per_req = cdiv(sc.max_model_len, self.block_size)
        self.requests: dict[str, CachedRequestState] = {}      # every request from its first step to its end
        self.batch = InputBatch(self.max_num_reqs, sc.max_model_len, self.max_blocks_per_req, self.vocab_size,
                                list(mc.eos_token_ids), self.device)
        self.buffers = StepBuffers(self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req, self.device)
        self.encdec = None   # encoder-decoder models (T5): encoder runs and cross-attention metadata
        if getattr(self.model, "is_encoder_decoder", False):
            from hayabusa.worker.encoder_decoder import EncoderDecoderRunner

            self.encdec = EncoderDecoderRunner(self.model, self.block_size, self.max_num_reqs, self.max_num_tokens,
                                               mc.max_encoder_len, self.device, batch_invariant=bi)
        self._alloc_staging_buffers()
        self.kv_buffer: torch.Tensor | None = None   # [L, 2, num_blocks, block_size, H_kv, D], this stage's layers
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []   # by layer; None: another stage's
        self.num_blocks = 0
        self.num_cpu_blocks = 0
        self.graphs = None
        self.decode_runner = None
        # The previous launched step's sampled tokens (device), and for each row that sampled in it its index
        # there (-1 = none): a placeholder input token of this step is read from there.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sample_index = np.full(self.max_num_reqs, -1, dtype=np.int64)    # [rows]
        # A step of one token per request skips the per-token repeats (tests turn it off to compare).
        self.decode_fast_path = True
        # A verify step whose proposing requests are all greedy takes kernels/greedy_verify.py (tests turn it off
        # to compare); the steps that did are counted.
        self.greedy_verify_fast_path = True
        self.num_greedy_verify_steps = 0
        self.mm = None   # MultiModalState: images, encoder cache and M-RoPE positions of a vision model's requests
        if getattr(self.model, "is_multimodal", False):
            from hayabusa.worker.mm_inputs import MultiModalState

            self.mm = MultiModalState(self.model, self.device, batch_invariant=bi)
        # prompt_logprobs: request id -> k while its prompt logprobs are incomplete; -> prompt positions done
        self._prompt_lp_wanted: dict[str, int] = {}
        self._prompt_lp_done: dict[str, int] = {}

    def _alloc_staging_buffers(self) -> None:
        d, T, R = self.device, self.max_num_tokens, self.max_num_reqs
        self.staging = None
        if d.type == "cuda":  # pinned host buffers: H2D copies from them are asynchronous
            def pinned(n: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(n, dtype=dtype, pin_memory=True)

            # Two sets, alternating per step: with async scheduling step N+1 is prepared while step N's copies
            # may still be queued. A pipeline stage has up to pipeline_parallel_size steps in flight: one set each
            # (its step's event is waited for before the set comes round again: launch / worker.EarlierStage).
            self._staging_index = 0
            self._staging_sets = [
                {"input_ids": pinned(T, torch.int64), "positions": pinned(T, torch.int64),
                 "slot_mapping": pinned(T, torch.int64), "query_start_loc": pinned(R + 1, torch.int32),
                 "seq_lens": pinned(R, torch.int32), "block_table": pinned(R * self.max_blocks_per_req, torch.int32),
                 "sampled": pinned(R, torch.int64), "placeholder_dst": pinned(R, torch.int64),
                 "placeholder_src": pinned(R, torch.int64)} for _ in range(max(2, pp_size()))]
            spec = self.cfg.speculative_config
            if spec is not None:   # a verify step's emitted tokens, [R, k + 1]
                for st in self._staging_sets:
                    st["sampled_runs"] = pinned(R * (spec.num_speculative_tokens + 1), torch.int64)
            self.staging = self._staging_sets[0]
            self.block_table_staging = torch.empty(R * self.max_blocks_per_req, dtype=torch.int32, device=d)

    # ------------------------------------------------------------------ KV cache + graphs
    def profile_num_blocks(self) -> int:
        """The KV blocks this runner has room for (peak memory profiled on CUDA; see determine_num_blocks)."""
        peak, non_torch = None, 0
        if self.device.type == "cuda" and self.cfg.cache_config.num_gpu_blocks_override is None \
                and self.cfg.cache_config.kv_cache_memory_bytes is None:
            peak, non_torch = self._profile_peak_memory()
        return determine_num_blocks(self.cfg, peak, non_torch)

    def profile_num_cpu_blocks(self) -> int:
        """The CPU tier's blocks this runner has room for (``swap_space`` over its bytes per block: the target's
        and the draft's KV, this rank's heads)."""
        return num_cpu_blocks(self.cfg)

    def initialize_kv_cache(self, num_blocks: int | None = None, num_cpu_blocks: int | None = None) -> int:
        """Size (``num_blocks``, else profile_num_blocks; ``num_cpu_blocks``, else profile_num_cpu_blocks: a
        tensor-parallel worker is given the minimum over its ranks of each) and allocate the KV cache and its CPU
        tier, capture CUDA graphs. Returns num_blocks."""
        self.num_blocks = self.profile_num_blocks() if num_blocks is None else num_blocks
        self.kv_buffer = allocate_kv_buffer(self.cfg, self.num_blocks)
        self.kv_caches = kv_cache_views(self.kv_buffer, self.first_layer)
        if self.draft is not None:
            self.draft.allocate(self.num_blocks)
        self.kv_swapper = None   # the KV cache's CPU tier (swap_space): copies the scheduler's swap lists
        self.num_cpu_blocks = self.profile_num_cpu_blocks() if num_cpu_blocks is None else num_cpu_blocks
        if self.num_cpu_blocks:   # the draft's cache shares the target's block ids: its blocks move with them
            buffers = [self.kv_buffer] + ([self.draft.kv_buffer] if self.draft is not None else [])
            self.kv_swapper = KVSwapper(buffers, self.num_cpu_blocks)
        if self.device.type == "cuda":
            if not self.pipeline:   # a pipeline stage runs eagerly (its send / recv are outside any graph)
                from hayabusa.worker.cuda_graph import CUDAGraphRunner

                self.decode_runner = CUDAGraphRunner.for_runner(self, use_graphs=not self.cfg.enforce_eager)
                if self.decode_runner.use_graphs:
                    self.decode_runner.capture()
                    self.graphs = self.decode_runner
                if self.draft is not None and hasattr(self.draft, "make_graphs"):   # draft_model's proposals, mirror
                    self.draft.make_graphs(self, use_graphs=not self.cfg.enforce_eager)
                if self.encdec is not None and self.encdec.padded_encoder and not self.cfg.enforce_eager:
                    # admission steps' encoder runs
                    self.encdec.capture_graphs(self.kv_caches, self.backend)
            self._warm_up_prefill_attention()
            if self.encdec is not None:
                self.encdec.warm_up_prefill(self.kv_caches, self.backend, self.buffers)
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
            buf = self.buffers
            qsl, seq_lens = buf.query_start_loc[:2], buf.seq_lens[:1]
            qsl.copy_(torch.tensor([0, 2], dtype=torch.int32))
            seq_lens.fill_(2)
            block_table = buf.block_table[:1]
            block_table.zero_()
            self.backend.paged_attention(q, k_cache, v_cache, out, qsl, seq_lens, block_table, layer.scale, 2,
                                         num_seqs=1, sliding_window=layer.sliding_window, softcap=layer.softcap,
                                         k_scale=layer.k_scale, v_scale=layer.v_scale)
        torch.cuda.synchronize(self.device)
        logger.info("prefill attention kernels ready in %.1f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def _profile_peak_memory(self) -> tuple[int, int]:
        """Run the largest step without a KV cache; returns (torch peak bytes, non-torch bytes in use)."""
        release_unreachable_cuda_memory()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.mm is not None:   # the vision tower at its largest step input
            self.mm.profile(self.cfg)
        T = self.max_num_tokens
        ctx = ForwardContext(None, None, self.backend)
        kwargs = {}
        if self.pipeline and pp_rank() > 0:   # no peer to receive from here: zeros of the stage's input shape
            from hayabusa.model.layers.pipeline import IntermediateTensors

            z = torch.zeros(T, self.cfg.model_config.hidden_size, dtype=self.cfg.model_config.dtype,
                            device=self.device)
            kwargs["intermediate"] = IntermediateTensors(z, z.clone())
        hidden = self.model(self.buffers.input_ids[:T], self.buffers.positions[:T], ctx, **kwargs)
        if not self.pipeline or pp_rank() == pp_size() - 1:
            idx = torch.arange(min(self.max_num_reqs, T), device=self.device)
            logits = self.model.compute_logits(hidden[idx]).float()
            # The sampler's top-p/top-k path sorts the fp32 logits: keep that peak in the profile.
            torch.sort(logits, dim=-1)
            del logits
        del hidden, kwargs
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        if self.encdec is not None and self.encdec.padded_encoder and not self.cfg.enforce_eager \
                and not self.pipeline:
            # the encoder graphs' pool (captured after the cache is allocated) stays beside the cache
            peak += self.encdec.profile_graph_memory()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        torch.cuda.empty_cache()
        return peak, non_torch

    # ------------------------------------------------------------------ one step
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens (a step with constrained requests samples under
        ``out.grammar_bitmask``, as given)."""
        handle = self.launch(out)
        if isinstance(handle, PendingSample):
            handle = self.sample_tokens(handle, out.grammar_bitmask)
        return self.finish(handle)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle | PendingSample:
        """Queue one step's work on the device without waiting for it (the host is free until ``finish``).

        A decode row whose input token was sampled by the previous step but is not back on the host yet
        (a placeholder) reads it from that step's sampled-token tensor on the device.

        A step with constrained requests (``out.structured_output_req_ids``) and no ``grammar_bitmask`` yet
        returns a PendingSample after queueing the model: the caller fills the bitmask meanwhile and passes it to
        ``sample_tokens`` (vLLM's execute_model / sample_tokens split).
        """
        self.update_states(out)
        if out.is_empty:
            self.forget_previous_step()
            return StepHandle([], [], None, None, None)
        if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_write_through \
                or out.write_through_fence:   # before the forward (worker/kv_swap.py)
            self.kv_swapper.execute(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_write_through,
                                    out.step_id, out.write_through_fence)
        if self.staging is not None:
            self._staging_index = (self._staging_index + 1) % len(self._staging_sets)
            self.staging = self._staging_sets[self._staging_index]
        inp = self.prepare_inputs(out)
        if self.encdec is not None:   # encoders of admitted / resumed requests, then the cross metadata
            self.encdec.run_encoders(out, self.kv_caches, self.backend)
            self.encdec.prepare(inp.rows, inp.num_scheduled)
        if self.mm is not None:   # vision-tower runs, image rows and M-RoPE positions of the step
            inp.positions, inp.mm = self.mm.prepare(out, inp.req_ids, inp.positions, inp.query_start_loc,
                                                    out.batch_num_computed_tokens)
        logits = self._run_model(inp)                       # [R_s, V]
        if out.structured_output_req_ids and out.grammar_bitmask is None:
            return PendingSample(inp, logits, out)
        if out.grammar_bitmask is not None and logits is not None:
            self._apply_grammar_bitmask(out.structured_output_req_ids, out.grammar_bitmask, inp, logits)
        handle = self._with_prompt_logprobs(self._sample(inp, logits), inp)
        if self.pipeline and handle.event is None and self.staging is not None:
            # a stage before the last (or a step that samples nothing): finish still waits for this step's work,
            # so its staging set is free once the step is finished
            handle.event = torch.cuda.Event()
            handle.event.record()
        return handle

    @torch.inference_mode()
    def sample_tokens(self, pending: PendingSample, bitmask: np.ndarray | None) -> StepHandle:
        """Sample a PendingSample's step, its constrained rows under ``bitmask`` (rows in the order of
        ``structured_output_req_ids``; None: no mask)."""
        if bitmask is not None:
            self._apply_grammar_bitmask(pending.out.structured_output_req_ids, bitmask, pending.inputs,
                                        pending.logits)
        return self._with_prompt_logprobs(self._sample(pending.inputs, pending.logits), pending.inputs)

    def _with_prompt_logprobs(self, handle: StepHandle, inp: StepInputs) -> StepHandle:
        """Attach the step's prompt logprobs to its handle; on CUDA queue their copy to the host and record the
        event that ``finish`` waits for after it (later on the same stream: it covers the sampled ids too)."""
        pl = inp.prompt_logprobs_out
        if pl is None:
            return handle
        handle.prompt_logprobs = pl
        if self.device.type == "cuda":
            pl.to_host(non_blocking=True)
            handle.event = torch.cuda.Event()
            handle.event.record()
        return handle

    def _apply_grammar_bitmask(self, req_ids: list[str], bitmask: np.ndarray, inp: StepInputs,
                               logits: torch.Tensor) -> None:
        """Forbid, on the device, the tokens the constrained requests' grammars do not allow next (before the
        greedy argmax or the Sampler's penalties, temperature, top-k/p); the other rows are untouched."""
        if len(inp.logits_rows) == inp.num_reqs:
            sampling_ids = inp.req_ids
        else:
            sampling_ids = [inp.req_ids[i] for i in inp.logits_rows.tolist()]
        index = {rid: i for i, rid in enumerate(sampling_ids)}
        rows = np.array([index[rid] for rid in req_ids], dtype=np.int64)
        if inp.spec is not None:   # a verify step: each request's token is sampled at its last logits row
            rows = inp.spec.last_index[rows]
        if self.staging is not None:  # through pinned buffers: the copy must not wait for the queued forward
            n, W = bitmask.shape
            bm = self.grammar_bitmask_buffer(n, W)
            if bitmask.ctypes.data != bm.data_ptr():   # not filled in place (a mask given in the SchedulerOutput)
                bm.numpy()[:] = bitmask
            rws = self.staging["bitmask_rows"][:n]
            rws.numpy()[:] = rows
            bitmask, rows = bm, rws
        apply_token_bitmask(logits, bitmask, rows)

    def grammar_bitmask_buffer(self, n: int, words: int | None = None) -> torch.Tensor | None:
        """The current step's pinned staging buffer for a grammar bitmask of ``n`` constrained requests:
        [n, words] int32 (default ceil(V / 32)), which the scheduler fills in place (CUDA); None on CPU (the mask
        is used where it is)."""
        if self.staging is None:
            return None
        words = cdiv(self.vocab_size, 32) if words is None else words
        if self.staging.get("bitmask") is None or self.staging["bitmask"].shape[1] != words:
            self.staging["bitmask"] = torch.empty(self.max_num_reqs, words, dtype=torch.int32, pin_memory=True)
            self.staging["bitmask_rows"] = torch.empty(self.max_num_reqs, dtype=torch.int64, pin_memory=True)
        return self.staging["bitmask"][:n]

    def forget_previous_step(self) -> None:
        """Drop the link to the previous step's sampled tokens (after a failed step whose requests are aborted):
        no later step may read placeholders from it."""
        self._prev_sampled = None
        self._prev_sample_index.fill(-1)

    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step (the step's one sync), append its tokens to the rows' token ids, and return
        them as host lists."""
        if handle.event is not None:
            handle.event.synchronize()
        if handle.received is not None:   # a pipeline stage before the last: the last stage's tokens
            handle.received.wait()
            handle.received, handle.ids = None, handle.ids.cpu()
        prompt_lps = handle.prompt_logprobs.as_lists() if handle.prompt_logprobs is not None else {}
        if handle.ids is None:
            return ModelRunnerOutput({rid: [] for rid in handle.req_ids}, prompt_logprobs=prompt_lps)
        ids = handle.ids.numpy()
        if ids.ndim == 2:   # a verify step: each row's emitted tokens, -1 padded
            runs = [[t for t in row if t >= 0] for row in ids.tolist()]
            self.batch.write_sampled_runs(handle.rows, handle.epochs, runs)
            sampled = dict(zip(handle.sampled_req_ids, runs))
        else:
            self.batch.write_sampled(handle.rows, handle.epochs, ids)
            sampled = dict(zip(handle.sampled_req_ids, ids.reshape(-1, 1).tolist()))   # rid -> [token]
        if len(sampled) < len(handle.req_ids):  # requests in a partial prefill: no token
            sampled = {rid: sampled.get(rid, []) for rid in handle.req_ids}
        result = ModelRunnerOutput(sampled, prompt_logprobs=prompt_lps)
        if handle.logprobs is not None:
            lp_ids, lp_vals, ranks = (t.tolist() for t in handle.logprobs)
            for i, (rid, k) in enumerate(zip(handle.sampled_req_ids, handle.num_logprobs)):
                if k >= 0:
                    result.logprobs[rid] = (lp_ids[i][:k + 1], lp_vals[i][:k + 1], ranks[i])
        return result

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's changes to the runner's own request states and rows: drop finished requests, give up
        the rows of preempted ones (keeping their state), add new ones, resume preempted ones, append blocks."""
        batch = self.batch
        for rid in out.preempted_req_ids:
            batch.remove(rid)
        for rid in out.finished_req_ids:
            batch.remove(rid)
            self.requests.pop(rid, None)
            self._prompt_lp_wanted.pop(rid, None)
            self._prompt_lp_done.pop(rid, None)
        for new in out.scheduled_new_reqs:
            seed = new.sampling_params.seed
            generator = None
            if seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), new.sampling_params, generator)
            self.requests[new.req_id] = state
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_lp_wanted[new.req_id] = new.sampling_params.prompt_logprobs
            batch.add(state, state.prompt_token_ids, new.block_ids)
        cached = out.scheduled_cached_reqs
        if any(cached.resumed_from_preemption):
            for rid, resumed, token_ids in zip(cached.req_ids, cached.resumed_from_preemption,
                                               cached.new_token_ids):
                if resumed:
                    state = self.requests[rid]
                    batch.add(state, state.prompt_token_ids + list(token_ids), [])
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            if block_ids:
                batch.append_blocks(rid, block_ids)
        if self.encdec is not None:
            self.encdec.update_states(out, batch.row_of)
        if self.mm is not None:
            self.mm.update(out)

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's host inputs: per-request arrays from the SchedulerOutput, per-token ones vectorised."""
        rids = out.scheduled_req_ids
        R = len(rids)
        batch = self.batch
        rows = np.fromiter(map(batch.row_of.__getitem__, rids), dtype=np.int64, count=R)
        T = out.total_num_scheduled_tokens
        decode = T == R and self.decode_fast_path   # one token per request: no per-request counts or repeats
        if decode:
            num_sched = np.ones(R, dtype=np.int32)
        else:
            num_sched = np.fromiter(map(out.num_scheduled_tokens.__getitem__, rids), dtype=np.int32, count=R)
        num_computed = np.array(out.batch_num_computed_tokens, dtype=np.int64)
        qsl = np.zeros(R + 1, dtype=np.int32)
        np.cumsum(num_sched, out=qsl[1:])
        assert int(qsl[-1]) == T, (int(qsl[-1]), T)
        #  |<-- num_computed -->|<-- num_sched -->|
        #  | KV already cached  | computed now     |   positions = num_computed + 0..num_sched-1
        if decode:
            positions, tok_rows = num_computed, rows
        else:
            positions = np.repeat(num_computed - qsl[:-1], num_sched) + np.arange(T, dtype=np.int64)
            tok_rows = np.repeat(rows, num_sched)
        spec = out.scheduled_spec_decode_tokens
        known = write_drafts(batch, rows, rids, spec) if spec else None      # proposals go in as input tokens
        input_ids, ph_dst, ph_src = self._gather_input_ids(tok_rows, positions, known)
        sampling = out.sampling_req_ids
        if len(sampling) == R:
            sampled_rows = np.arange(R, dtype=np.int64)
        else:
            sampled_rows = np.array([i for i, rid in enumerate(rids) if rid in sampling], dtype=np.int64)
        seq_lens = (num_computed + num_sched).astype(np.int32)
        slot_mapping = batch.block_table[tok_rows, positions // self.block_size].astype(np.int64) \
            * self.block_size + positions % self.block_size
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        plan = None
        if self._prompt_lp_wanted:
            plan = plan_prompt_logprobs(rids, rows, num_computed, qsl, self._prompt_lp_wanted, self._prompt_lp_done,
                                        batch.token_ids, batch.num_prompt_tokens)
        logits_indices, verify_plan = (qsl[1:][sampled_rows] - 1).astype(np.int64), None
        if spec:
            logits_indices, verify_plan = plan_verify(rids, sampled_rows, qsl, spec)
        return StepInputs(rids, rows, num_sched, qsl, seq_lens, positions, input_ids, slot_mapping,
                          batch.block_table[rows, :max_blocks], sampled_rows, logits_indices, ph_dst, ph_src,
                          prompt_logprobs=plan, spec=verify_plan)

    def _gather_input_ids(self, tok_rows: np.ndarray, positions: np.ndarray, known: np.ndarray | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Input ids of the step ([T] int64, 0 where a placeholder goes), by one gather from the rows' token ids,
        and the placeholders' (dst, src) pairs ([P] int64 each): dst indexes this step's tokens, src the previous
        step's sampled-token tensor. A placeholder is a token the host does not know yet: the previous step
        sampled it and it is still on the device. ``known``: tokens known per row when it is not
        ``batch.num_tokens`` (a verify step's proposals, written after them)."""
        batch = self.batch
        ids = batch.token_ids[tok_rows, positions].astype(np.int64)
        ph_dst = np.flatnonzero(positions >= (batch.num_tokens if known is None else known)[tok_rows])
        if len(ph_dst) == 0:
            return ids, ph_dst, ph_dst
        ids[ph_dst] = 0
        ph_src = self._prev_sample_index[tok_rows[ph_dst]]
        # a placeholder is the last token known of a row that sampled in the previous step
        assert (ph_src >= 0).all() and (positions[ph_dst] == batch.num_tokens[tok_rows[ph_dst]]).all(), \
            "placeholder input token without a sample of the previous step"
        return ids, ph_dst, ph_src

    def copy_inputs(self, inp: StepInputs) -> None:
        """Host -> persistent device buffers (through pinned staging buffers on CUDA: truly async copies),
        placeholders included."""
        T, R = len(inp.input_ids), inp.num_reqs
        buf = self.buffers
        nb = min(inp.block_table.shape[1], buf.block_table.shape[1])
        st = self.staging
        pairs = [(buf.input_ids[:T], inp.input_ids), (buf.positions[:T], inp.positions),
                 (buf.slot_mapping[:T], inp.slot_mapping), (buf.query_start_loc[:R + 1], inp.query_start_loc),
                 (buf.seq_lens[:R], inp.seq_lens)]
        if st is None:  # CPU: plain copies
            for dst, src in pairs:
                dst.copy_(torch.from_numpy(src))
            buf.block_table[:R, :nb].copy_(torch.from_numpy(inp.block_table[:, :nb]))
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
        buf.block_table[:R, :nb].copy_(bt_dev)      # strided device-side copy into the static table
        self._fill_placeholders(inp)

    def _fill_placeholders(self, inp: StepInputs) -> None:
        """Input ids that the previous step sampled and the host does not know yet, copied on the device."""
        P = len(inp.placeholder_dst)
        if P == 0:
            return
        input_ids = self.buffers.input_ids
        in_order = np.arange(P)
        if np.array_equal(inp.placeholder_dst, in_order) and np.array_equal(inp.placeholder_src, in_order):
            # steady decode: token i's input is the previous step's sample i (same requests, same order)
            input_ids[:P].copy_(self._prev_sampled[:P])
            return
        st = self.staging
        if st is None or P > len(st["placeholder_dst"]):   # CPU (or more placeholders than rows: never seen)
            dst = torch.from_numpy(inp.placeholder_dst).to(self.device, non_blocking=True)
            src = torch.from_numpy(inp.placeholder_src).to(self.device, non_blocking=True)
        else:   # through the step's pinned buffers: a copy from pageable memory would wait for the queued steps
            # (a step that admits or finishes requests, where rows move, would otherwise stall async scheduling)
            dst_host, src_host = st["placeholder_dst"][:P], st["placeholder_src"][:P]
            dst_host.numpy()[:] = inp.placeholder_dst
            src_host.numpy()[:] = inp.placeholder_src
            dst = dst_host.to(self.device, non_blocking=True)
            src = src_host.to(self.device, non_blocking=True)
        input_ids[dst] = self._prev_sampled[src]

    def _run_model(self, inp: StepInputs) -> torch.Tensor:
        T, R = len(inp.input_ids), inp.num_reqs
        max_q = int(inp.num_scheduled.max())
        self.copy_inputs(inp)
        if self.draft is not None:
            return self._run_with_draft(inp, T, R, max_q)
        shape = self.graph_shape(inp, R, max_q) if inp.mm is None else None
        if shape == "mixed":
            # a step with prompt chunks (or a verify step past the verify graphs): a (bs, T_pad) graph
            return self._logits(inp, self.decode_runner.run_mixed(inp))
        if shape == "verify" and self.encdec is None:
            # a verify step (n-gram proposals): padded to a captured (batch, k + 1) size and replayed
            return self._logits(inp, self.decode_runner.run_verify(inp))
        if shape == "decode":
            # Decode-only: padded to a capture size, replayed from a CUDA graph (or run eagerly on the same padded
            # shapes with enforce_eager, so both give the same numbers).
            return self._graph_decode_logits(inp, R)
        buf = self.buffers
        ctx = ForwardContext(buf.attn_metadata(R, T, max_q, int(inp.seq_lens.max())), self.kv_caches, self.backend,
                             None if self.encdec is None else self.encdec.metadata(T))
        if inp.mm is not None:   # image rows into the input embeddings, [3, T] M-RoPE positions
            hidden = inp.mm.run(self.model, buf.input_ids[:T], buf.positions[:T], ctx)
        elif self.pipeline:      # this stage's layers between a recv and a send (None before the last stage)
            mc = self.cfg.model_config
            hidden = run_stage(self.model, buf.input_ids[:T], buf.positions[:T], ctx, mc.hidden_size, mc.dtype)
        else:
            hidden = self.model(buf.input_ids[:T], buf.positions[:T], ctx)       # [T, hidden]
        return self._logits(inp, hidden)                                            # [R_s, V]

    def _logits(self, inp: StepInputs, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """The step's prompt logprobs (when asked) and the logits of its sampling rows ([R_s, V]) from hidden states
        (None before the last pipeline stage: no logits there)."""
        if hidden is None:
            return None
        if inp.prompt_logprobs is not None:
            inp.prompt_logprobs_out = compute_prompt_logprobs(
                hidden, inp.prompt_logprobs, self.model.compute_logits, min(CHUNK_ROWS, self.max_num_reqs),
                log_softmax=self.sampler.log_softmax if self.sampler.batch_invariant else None)
        if len(inp.logits_indices) == 0:
            return hidden.new_empty(0, self.vocab_size)
        idx = torch.from_numpy(inp.logits_indices).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[idx])

    def _sample(self, inp: StepInputs, logits: torch.Tensor | None) -> StepHandle:
        """Sample on the device and queue the copy of the tokens to the host (no wait here). Pipeline stages:
        the last stage samples and broadcasts the tokens; the earlier ones (``logits`` None) receive them."""
        if len(inp.logits_rows) == inp.num_reqs:  # every request samples (decode)
            rids, rows = inp.req_ids, inp.rows
        else:
            rids, rows = [inp.req_ids[i] for i in inp.logits_rows.tolist()], inp.rows[inp.logits_rows]
        self._prev_sample_index.fill(-1)
        self._prev_sample_index[rows] = np.arange(len(rows))
        if len(rows) == 0:
            self._prev_sampled = None
            self._eagle_mirror(inp, None)
            return StepHandle(inp.req_ids, [], None, None, None)
        batch = self.batch
        # outputs before this step's sample, placeholders included: the sequence so far minus the prompt
        num_output = inp.seq_lens[inp.logits_rows].astype(np.int64) - batch.num_prompt_tokens[rows]
        if inp.spec is not None:   # a verify step: [R_s, K + 1] tokens; the next step knows them (synchronous)
            num_output = num_output - inp.spec.num_drafts
            ids, lp, greedy = verify(lambda lg, r, n: self._sample_one(inp, lg, r, n), batch, rows, num_output,
                                     inp.spec, logits, self.greedy_verify_fast_path)
            self.num_greedy_verify_steps += greedy
            self._prev_sample_index.fill(-1)
        elif logits is None:    # an earlier pipeline stage: the last stage's tokens, received by finish
            ids = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            self._prev_sampled = None   # no placeholder reads them (the scheduler waits for pipelined samples)
            return StepHandle(inp.req_ids, rids, ids, None, None, rows, batch.row_epoch[rows].copy(),
                              received=broadcast_from_last_stage(ids, async_op=True))
        else:
            ids, lp = self._sample_one(inp, logits, rows, num_output)
            ids = broadcast_from_last_stage(ids)   # pipeline stages only: the earlier stages' inputs
        self._prev_sampled = ids                               # [R_s] int64, read by the next step's placeholders
        self._eagle_mirror(inp, ids)
        handle = StepHandle(inp.req_ids, rids, ids, None, lp, rows, batch.row_epoch[rows].copy(),
                            batch.num_logprobs[rows].tolist() if lp is not None else None)
        if self.device.type != "cuda":
            return handle
        if ids.ndim == 2:
            handle.ids = self.staging["sampled_runs"][:ids.numel()].view(ids.shape)
        else:
            handle.ids = self.staging["sampled"][:len(rids)]
        handle.ids.copy_(ids, non_blocking=True)
        if lp is not None:
            handle.logprobs = tuple(t.to("cpu", non_blocking=True) for t in lp)
        handle.event = torch.cuda.Event()
        handle.event.record()
        return handle

    def _sample_one(self, inp: StepInputs, logits: torch.Tensor, rows: np.ndarray, num_output: np.ndarray
                    ) -> tuple[torch.Tensor, tuple | None]:
        """One token per row of logits [R_s, V] (device): (ids [R_s] int64, (logprob ids, logprobs, ranks) or
        None)."""
        batch = self.batch
        if batch.is_plain_greedy(rows, num_output):  # fast path: argmax, no sampling metadata
            return logits.argmax(dim=-1), None
        pending = None
        if batch.has_penalties[rows].any() or batch.has_bad_words[rows].any():
            last = inp.logits_indices if inp.spec is None else inp.logits_indices[inp.spec.last_index]
            idx = torch.from_numpy(last).to(self.device, non_blocking=True)
            pending = self.buffers.input_ids[idx]                # [R_s] each row's last input token
        sampled = self.sampler(logits, batch.sampling_metadata(rows, num_output, pending))
        lp = None
        if sampled.logprobs is not None:
            lp = (sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_token_ranks)
        return sampled.sampled_token_ids, lp

    def _graph_decode_logits(self, inp, R: int) -> torch.Tensor:
        """A decode step from decode_runner (padded to a capture size; replayed, or eager on the same shapes):
        logits [R_s, V] of the rows that sample (``inp.logits_rows``); all R rows are a view of the graph's."""
        logits = self.decode_runner.run(inp)            # [R, V]
        if len(inp.logits_rows) < R:
            logits = logits[torch.from_numpy(inp.logits_rows).to(self.device)]
        return logits

    def graph_shape(self, inp: StepInputs, R: int, max_q: int) -> str | None:
        """Which of the target's captured shapes a step of R requests (longest query max_q) fits: "verify" (it has
        proposals and fits a (bs, k + 1) size), "decode" (one token each, fits a batch size), "mixed" (any other
        step that fits a (bs, T_pad) mixed-step size: prompt chunks; only runners without a draft, encoder or
        images have them), or None (runs eagerly: no graph runner, prompt logprobs asked, or too large). Host ints
        only."""
        g = self.decode_runner
        if g is None or inp.prompt_logprobs is not None:
            return None
        if inp.spec is not None and g.can_run_verify(R, max_q):
            return "verify"
        if inp.spec is None and max_q == 1 and g.can_run(R):
            return "decode"
        return "mixed" if g.mixed_size(R, len(inp.input_ids)) is not None else None

    def _run_with_draft(self, inp: StepInputs, T: int, R: int, max_q: int) -> torch.Tensor:
        """A step with a draft model: its proposals into the input ids first (verify steps), then the target, then
        the same step on the draft, which keeps its KV cache in step with the target's. A step the target replays
        from its decode or verify graphs is mirrored by the draft's graph of the same shape (``mirror_graphed``:
        the padded step in the target's buffers); the others run eagerly on both."""
        buf = self.buffers
        meta = buf.attn_metadata(R, T, max_q, int(inp.seq_lens.max()))
        eagle = getattr(self.draft, "is_eagle", False)
        if inp.spec is not None:
            sel = np.flatnonzero(inp.spec.num_drafts > 0)
            if len(sel):
                req_index = inp.logits_rows[sel]
                if eagle:
                    inp.spec.draft_ids_dev = self.draft.propose(
                        req_index, inp.spec.num_drafts[sel], inp.rows[req_index], inp.query_start_loc,
                        inp.positions, inp.slot_mapping, buf.input_ids, buf.block_table, self.backend)
                else:
                    inp.spec.draft_ids_dev = self.draft.propose(
                        req_index, inp.spec.num_drafts[sel], inp.query_start_loc, inp.positions,
                        inp.slot_mapping, buf.input_ids, buf.block_table, self.backend)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        shape, verify = self.graph_shape(inp, R, max_q), inp.spec is not None
        if eagle:   # the head runs after sampling (it needs the emitted tokens): _eagle_mirror
            return self._run_eagle_target(inp, meta, ctx, T, shape)
        if shape == "verify":
            # the target's verify forward replayed from a (bs, k + 1) graph; the graph's output is read after the
            # mirror (the draft's graphs have a pool of their own)
            hidden = self.decode_runner.run_verify(inp)
        elif shape == "decode":
            logits = self._graph_decode_logits(inp, R)
            self._mirror(inp, meta, T, R, max_q, verify)
            return logits
        else:
            hidden = self.model(buf.input_ids[:T], buf.positions[:T], ctx)
            self.draft.mirror(meta, buf.input_ids[:T], buf.positions[:T], self.backend)
            return self._logits(inp, hidden)
        self._mirror(inp, meta, T, R, max_q, verify)
        return self._logits(inp, hidden)

    def _run_eagle_target(self, inp: StepInputs, meta, ctx: ForwardContext, T: int, shape: str | None
                          ) -> torch.Tensor:
        """EAGLE's target forward: from the target's decode or (bs, k + 1) verify graph when the step fits one and
        the graphs output the head's input (``eagle_forward``: worker/cuda_graph.py), else eagerly
        (``target_forward``). Either way the head's input [T, H_head] is kept in ``inp.eagle`` for the mirror
        after sampling (a graph's: a view of its static output, read before the next replay: EAGLE steps are
        synchronous). Returns the logits of the sampling rows [R_s, V]."""
        buf, draft, graphs = self.buffers, self.draft, self.decode_runner
        if shape is not None and graphs.eagle_forward is not None:
            if shape == "verify":
                hidden = graphs.run_verify(inp)
                draft.num_graph_target_steps += 1
                inp.eagle = (meta, graphs.head_input)
                return self._logits(inp, hidden)
            if shape == "decode":
                logits = self._graph_decode_logits(inp, inp.num_reqs)
                draft.num_graph_target_steps += 1
                inp.eagle = (meta, graphs.head_input)
                return logits
        draft.num_eager_target_forwards += 1
        hidden, head_input = draft.target_forward(self.model, buf.input_ids[:T], buf.positions[:T], ctx)
        inp.eagle = (meta, head_input)
        return self._logits(inp, hidden)

    def _mirror(self, inp: StepInputs, meta, T: int, R: int, max_q: int, verify: bool) -> None:
        """The draft's mirror of a step the target ran on its padded graph shapes (the buffers hold them): through
        the draft's own graphs of that shape when it has them, else eagerly on the step's own rows."""
        if self.draft.can_mirror_graphed(R, max_q, verify):
            self.draft.mirror_graphed(inp, verify)
        else:
            buf = self.buffers
            self.draft.mirror(meta, buf.input_ids[:T], buf.positions[:T], self.backend)

    def _eagle_mirror(self, inp: StepInputs, ids: torch.Tensor | None) -> None:
        """EAGLE: the head over the step's tokens once its sampled tokens are known (worker/eagle.py)."""
        if inp.eagle is None:
            return
        meta, head_input = inp.eagle
        inp.eagle = None
        T = len(inp.input_ids)
        batch = self.batch
        last_pos = inp.positions[inp.query_start_loc[1:].astype(np.int64) - 1]
        next_known = batch.token_ids[inp.rows, np.minimum(last_pos + 1, batch.token_ids.shape[1] - 1)]
        num_drafts = inp.spec.num_drafts if inp.spec is not None else np.zeros(len(inp.logits_rows), dtype=np.int64)
        emitted = None if ids is None else (ids if ids.ndim == 2 else ids[:, None])
        self.draft.mirror(meta, self.buffers.input_ids[:T], self.buffers.positions[:T], head_input,
                          inp.query_start_loc, next_known.astype(np.int64), inp.rows, inp.logits_rows, num_drafts,
                          emitted, self.backend)
