"""The draft model of speculative decoding ("draft_model"): a smaller checkpoint of the target's vocabulary with
its own paged KV cache, indexed by the target's block ids (the scheduler's), so it stays in step with the target
by construction: every forward the target runs, the draft runs on the same tokens, positions and slots
(``mirror``), so prefix-hit blocks, recomputed prompts after preemption and rolled-back positions hold the same
tokens in both caches; the CPU KV tier (``worker/kv_swap.py``) copies a block of both caches, so swapped-out and
restored prefix blocks hold both models' KV too. At the start of a verify step the draft proposes its k greedy tokens per request
(``propose``: k one-token forwards, batched over the requests); they go into the step's input ids on the device.

  target step (verify):   | last | d_0 | ... | d_{k-1} |     slots s_0 .. s_k of the scheduler's blocks
  draft step j (0..k-1):  input d_{j-1} (j = 0: last) at position N - 1 + j, slot s_j -> argmax = d_j
  mirror:                 the target's step again on the draft (rewrites s_0 .. s_k, so s_k holds d_{k-1})

CUDA graphs (``make_graphs``): the proposal forwards replay decode graphs on buffers of their own (their inputs
change between the k forwards); the mirror of a step the target replays (a decode step, or a verify step padded to
(bs, k + 1)) replays the draft's graph of the same shape on the target's buffers, which already hold the step
(``mirror_graphed``): no copies, no eager forward. Steps the target runs eagerly (prefill, mixed, prompt logprobs)
are mirrored eagerly (``mirror``). The draft's KV is written at the same slots as before either way: after a
partial acceptance the rejected proposals' slots hold KV that the next step's positions overwrite or never read
(their seq_lens stop before them), as in the target's cache.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch

from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
from hayabusa.config import EngineConfig
from hayabusa.envs import env_flag
from hayabusa.model.loader import build_model
from hayabusa.worker.kv_cache import allocate_kv_buffer, kv_cache_views
from hayabusa.worker.spec_verify import draft_batch, to_device

# The draft's mirror of the target's decode / verify steps replayed from CUDA graphs (``mirror_graphs``). Its
# padded path runs eagerly in the CPU tests; on an H200 (2026-12-02, tests/spec_decode/test_spec_perf_cuda.py) the
# graphed mirror's greedy ids equal eager and off at batch 1, 3 and 16, and self-draft W3 on the 0.5b shape went
# from 5.25 to 1.58 ms TPOT, so it is on by default. HAYABUSA_DRAFT_MIRROR_GRAPHS=0 (read at import) or
# USE_MIRROR_GRAPHS = False (read when the graphs are made) runs every mirror eagerly as before.
USE_MIRROR_GRAPHS = env_flag("HAYABUSA_DRAFT_MIRROR_GRAPHS", True)


class DraftModel:
    """The draft's weights and KV cache (rows of the target's block table).

    Args:
        cfg: the engine config (``draft_model_config`` set).
        device: the device.
    """

    def __init__(self, cfg: EngineConfig, device: torch.device) -> None:
        self.cfg = dataclasses.replace(cfg, model_config=cfg.draft_model_config)
        self.device = device
        self.model = build_model(cfg.draft_model_config, device)
        self.kv_buffer: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs = None        # CUDAGraphRunner of the draft's one-token forwards (make_graphs), or None
        self.mirror_graphs = None  # CUDAGraphRunner of its mirror of the target's decode / verify steps, or None
        self.num_graph_steps = 0  # proposal forwards run through ``graphs`` (replayed, or eager on its padded shapes)
        self.num_graph_mirrors = 0  # mirrors run through ``mirror_graphs`` (replayed, or eager on padded shapes)
        self.num_eager_forwards = 0  # forwards outside both (prefill / mixed mirrors, proposals past the sizes)

    def allocate(self, num_blocks: int) -> None:
        """Its KV cache: as many blocks as the target's (the same block ids)."""
        self.kv_buffer = allocate_kv_buffer(self.cfg, num_blocks)   # [L, 2, num_blocks, block_size, H_kv, D]
        self.kv_caches = kv_cache_views(self.kv_buffer)

    def make_graphs(self, runner, use_graphs: bool = True) -> None:
        """Two CUDAGraphRunners (worker/cuda_graph.py) of the draft, captured when ``use_graphs``, else run eagerly
        on the same padded shapes (enforce_eager, and the CPU tests): ``graphs``, its one-token proposal forwards
        (``propose``) on StepBuffers of their own, with logits; ``mirror_graphs``, its mirror of the target's
        decode and (bs, k + 1) verify steps on the target's StepBuffers (the step's inputs already there), hidden
        states only (the mirror writes KV; its output is not read). Each has its own graph pool, so a replay never
        overwrites the target's graph outputs. ``runner``: the ModelRunner (its buffers, backend, config and
        sizes)."""
        from hayabusa.worker.cuda_graph import CUDAGraphRunner
        from hayabusa.worker.step_buffers import StepBuffers

        R = runner.max_num_reqs
        self.graphs = CUDAGraphRunner(self.model, self.kv_caches, runner.backend,
                                      StepBuffers(R, R, runner.max_blocks_per_req, self.device), runner.cfg,
                                      max_num_reqs=R, max_num_tokens=R, device=self.device, use_graphs=use_graphs)
        self.mirror_graphs = None
        if not use_graphs or USE_MIRROR_GRAPHS:
            self.mirror_graphs = CUDAGraphRunner(self.model, self.kv_caches, runner.backend, runner.buffers,
                                                 runner.cfg, max_num_reqs=R, max_num_tokens=runner.max_num_tokens,
                                                 device=self.device, verify=True, with_logits=False,
                                                 use_graphs=use_graphs)
        if use_graphs:
            self.graphs.capture()
            if self.mirror_graphs is not None:
                self.mirror_graphs.capture()

    def _step_logits(self, tokens: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                     block_table: torch.Tensor, backend) -> torch.Tensor:
        """One proposal forward: [R_d] tokens at positions ``pos`` -> logits [R_d, V]; through ``graphs`` when it
        has a size for R_d (inputs copied into its buffers on the device; padding rows write no KV)."""
        R_d = len(tokens)
        g = self.graphs
        if g is None or not g.can_run(R_d):
            self.num_eager_forwards += 1
            hidden = self.model(tokens, pos, ForwardContext(meta, self.kv_caches, backend))
            return self.model.compute_logits(hidden)
        buf = g.buffers
        buf.input_ids[:R_d].copy_(tokens)
        buf.positions[:R_d].copy_(pos)
        buf.slot_mapping[:R_d].copy_(meta.slot_mapping)
        buf.seq_lens[:R_d].copy_(meta.seq_lens)
        buf.block_table[:R_d, :block_table.shape[1]].copy_(block_table)
        self.num_graph_steps += 1
        return g.run(SimpleNamespace(num_reqs=R_d))                          # [R_d, V], a view: read it now

    def mirror(self, attn_metadata: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
               backend) -> None:
        """Run the target's step on the draft eagerly (KV only; no logits)."""
        self.num_eager_forwards += 1
        self.model(input_ids, positions, ForwardContext(attn_metadata, self.kv_caches, backend))

    def can_mirror_graphed(self, num_reqs: int, max_query_len: int, verify: bool) -> bool:
        """Whether ``mirror_graphed`` has a shape for a step of ``num_reqs`` requests (a verify step: none with
        more than k + 1 tokens; else one token each)."""
        g = self.mirror_graphs
        if g is None:
            return False
        return g.can_run_verify(num_reqs, max_query_len) if verify else max_query_len == 1 and g.can_run(num_reqs)

    def mirror_graphed(self, inp, verify: bool) -> None:
        """Run the target's step on the draft through ``mirror_graphs`` (replayed, or eager on the padded shapes):
        the step's inputs are those in the target's StepBuffers (``inp``: the step's StepInputs, ``num_reqs`` and
        ``input_ids`` read; a verify step pads them to (bs, k + 1) as the target's replay did, a decode step to
        bs rows). Call only when ``can_mirror_graphed``."""
        self.num_graph_mirrors += 1
        if verify:
            self.mirror_graphs.run_verify(inp)
        else:
            self.mirror_graphs.run(inp)

    def propose(self, req_index: np.ndarray, num_drafts: np.ndarray, query_start_loc: np.ndarray,
                positions: np.ndarray, slot_mapping: np.ndarray, input_ids: torch.Tensor,
                block_table: torch.Tensor, backend) -> torch.Tensor:
        """Greedy proposals of the draft, written into ``input_ids`` (the step's device input ids) right after each
        request's last token.

        Args:
            req_index: [R_d] int64, the requests (indices in the step's batch) with proposal slots.
            num_drafts: [R_d] int64, each one's k (>= 1).
            query_start_loc: [R + 1] the step's token offsets (host).
            positions, slot_mapping: [T] the step's token positions and slots (host).
            input_ids: [T] int64 device, the step's input ids (proposal slots overwritten here).
            block_table: [R, W] int32 device, the step's block table rows.
            backend: the attention backend.

        Returns:
            [R_d, K] int64 device, the proposals (K = max k; columns >= k are unused).
        """
        dev, K = self.device, int(num_drafts.max())
        db = draft_batch(req_index, query_start_loc, block_table, dev)
        first = db.first                                                     # [R_d] token index of the last token
        tokens = input_ids[to_device(first, np.int64, dev)]                   # [R_d] step 0's inputs
        drafts = []
        for j in range(K):
            valid = j < num_drafts                                            # rows past their k: no KV write
            meta, pos = db.metadata(first + np.minimum(j, num_drafts - 1), valid, positions, slot_mapping)
            tokens = self._step_logits(tokens, pos, meta, db.block_table, backend).argmax(dim=-1)   # [R_d] d_j
            drafts.append(tokens)
            rows = np.flatnonzero(valid)
            input_ids[to_device(first[rows] + 1 + j, np.int64, dev)] = tokens[to_device(rows, np.int64, dev)]
        return torch.stack(drafts, dim=1)
