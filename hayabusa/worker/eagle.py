"""EAGLE / EAGLE-3 proposals in the runner (speculative methods "eagle" / "eagle3"; the head: model/eagle.py).

The head's one-layer paged KV cache is indexed by the target's block ids (the scheduler's), like the draft model's
(worker/draft_model.py). Its entry at position p holds (token_{p+1}, the target's state at p), so it can only be
written once token_{p+1} is known: after each step's sampling, ``mirror`` runs the head over every token the target
ran in that step, on the same positions and slots, with the next tokens (the step's inputs shifted by one; at each
sampled request's end the tokens it emitted) and the target's hidden states of that step. Entries past a verify
step's accepted run hold rejected tokens; they are never read: the next step writes those positions before it
attends to them (as for the target). Prefix hits, preemption and rollback thus keep both caches in step.

At the last accepted position the head's output already gives the first proposal; ``mirror`` keeps it and the
head's hidden state there per row (device tensors), for every request of the step (a prompt chunk's last position
too: a request whose last prompt token is computed alone gets proposals in that step). A verify step then (``propose``) writes that first proposal
into the step's input ids and runs k - 1 more one-token head steps (input: the previous proposal and the head's own
previous hidden state, at the step's own positions and slots, allocated by the scheduler for the verify step).

  verify step of a request at position c:   | b (c) | d_0 (c+1) | ... | d_{k-1} (c+k) |
  propose:   d_0 = kept; head step j = 1..k-1 at position c + j - 1 with token d_{j-1} -> d_j
  mirror:    head over positions c .. c+k with tokens d_0 .. d_{a-1}, e_a (emitted), rejected ones; keeps the
             output at c + a (a = accepted) for the next step.

Known limit: a prefix-cache hit reuses the head's entry at a block's last position, written with the token that
followed it in the request that filled the block; a request that continues differently there gets a slightly
different head state at that one position (acceptance may drop; output never changes: verification is exact).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
from hayabusa.config import EngineConfig
from hayabusa.envs import env_flag
from hayabusa.model.eagle import build_eagle_head
from hayabusa.model.loader import iterate_weights
from hayabusa.worker.kv_cache import allocate_kv_buffer, kv_cache_views
from hayabusa.worker.spec_verify import draft_batch, to_device

# The target's decode / verify CUDA graphs also output the head's input (worker/cuda_graph.py ``eagle_forward``), so
# EAGLE's graph-shaped steps replay them instead of an eager target forward. Their padded path runs eagerly in the
# CPU tests; on the H200 tests/spec_decode/test_eagle_graphs_cuda.py passed for EAGLE and EAGLE-3 at batch 1, 3 and
# 16 (session 13, commit 984f9fb), so it is on by default: HAYABUSA_EAGLE_GRAPHS=0 (read at import) or
# USE_EAGLE_GRAPHS = False (read when the graphs are made) runs every EAGLE step's target forward eagerly.
USE_EAGLE_GRAPHS = env_flag("HAYABUSA_EAGLE_GRAPHS", True)


class EagleDrafter:
    """The head, its KV cache and each row's kept state.

    Args:
        cfg: the engine config (``draft_model_config`` an EagleHeadConfig).
        target: the target model (its embedding / lm_head are shared).
        device: the device.
        max_num_reqs: rows of the runner's batch.
    """

    is_eagle = True

    def __init__(self, cfg: EngineConfig, target: torch.nn.Module, device: torch.device, max_num_reqs: int) -> None:
        hc = cfg.draft_model_config
        self.cfg = dataclasses.replace(cfg, model_config=hc)
        self.device = device
        allow_pt = hc.load_format == "pt"
        self.head = build_eagle_head(hc, target, device, lambda: iterate_weights(hc.model, allow_pt, device))
        self.aux_layers: tuple[int, ...] | None = hc.aux_layer_ids or None   # EAGLE-3: the target's aux states
        H = hc.hf_config.hidden_size
        self.last_hidden = torch.zeros(max_num_reqs, H, dtype=hc.dtype, device=device)     # [rows, H]
        self.first_token = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)     # [rows]
        self.kv_buffer: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_graph_target_steps = 0     # target forwards through the runner's graph runner (replayed or padded)
        self.num_eager_target_forwards = 0  # target forwards run eagerly (``target_forward`` by the runner)

    def allocate(self, num_blocks: int) -> None:
        """Its KV cache: as many blocks as the target's (the same block ids), one layer."""
        self.kv_buffer = allocate_kv_buffer(self.cfg, num_blocks)   # [L, 2, num_blocks, block_size, H_kv, D]
        self.kv_caches = kv_cache_views(self.kv_buffer)

    def target_forward(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                       ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward, also returning the head's input per token: (hidden [T, H] for the logits,
        head input [T, H])."""
        if self.aux_layers is None:
            hidden = model(input_ids, positions, ctx)
            return hidden, hidden
        hidden, aux = model(input_ids, positions, ctx, aux_layers=self.aux_layers)
        return hidden, self.head.combine(aux)

    @torch.inference_mode()
    def propose(self, req_index: np.ndarray, num_drafts: np.ndarray, rows: np.ndarray, query_start_loc: np.ndarray,
                positions: np.ndarray, slot_mapping: np.ndarray, input_ids: torch.Tensor,
                block_table: torch.Tensor, backend) -> torch.Tensor:
        """Greedy proposals, written into ``input_ids`` right after each request's last token.

        Args:
            rows: [R_d] int64, the proposing requests' rows in the runner's batch (the kept state's index).
            the others: as DraftModel.propose (worker/draft_model.py).

        Returns:
            [R_d, K] int64 device, the proposals (K = max k; columns >= k are unused).
        """
        dev, K = self.device, int(num_drafts.max())
        db = draft_batch(req_index, query_start_loc, block_table, dev)
        first = db.first                                                     # [R_d] token index of the last token
        rows_t = to_device(rows, np.int64, dev)
        tokens = self.first_token[rows_t]                                    # [R_d] d_0, kept by the last mirror
        hidden = self.last_hidden[rows_t]
        input_ids[to_device(first + 1, np.int64, dev)] = tokens
        drafts = [tokens]
        for j in range(1, K):
            valid = j < num_drafts                                            # rows past their k: no KV write
            # position c + j - 1
            meta, pos = db.metadata(first + np.minimum(j, num_drafts) - 1, valid, positions, slot_mapping)
            for_logits, hidden = self.head(tokens, pos, hidden, ForwardContext(meta, self.kv_caches, backend))
            tokens = self.head.propose_ids(for_logits)                      # [R_d] d_j
            drafts.append(tokens)
            keep = np.flatnonzero(valid)
            input_ids[to_device(first[keep] + 1 + j, np.int64, dev)] = tokens[to_device(keep, np.int64, dev)]
        return torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def mirror(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
               head_input: torch.Tensor, query_start_loc: np.ndarray, next_known: np.ndarray, req_rows: np.ndarray,
               sampled: np.ndarray, num_drafts: np.ndarray, emitted: torch.Tensor | None, backend) -> None:
        """Run the head over a finished step's tokens (its KV cache) and keep, for every request of the step, the
        first proposal and the head's hidden state at its last known position (a sampled request's last emitted
        token, or a prompt chunk's last token, whose next token is a known prompt token).

        Args:
            meta: the step's attention metadata (the target's).
            input_ids, positions: [T] device, the step's inputs.
            head_input: [T, H] device, ``target_forward``'s head input.
            query_start_loc: [R + 1] host, the step's token offsets.
            next_known: [R] int64 host, the token after each request's last scheduled one when the host knows it
                (a prompt chunk that samples nothing); ignored for sampled requests.
            req_rows: [R] int64, the step's requests' rows in the runner's batch.
            sampled: [R_s] int64, the sampled requests (indices in the step's batch).
            num_drafts: [R_s] int64, their verified proposals (0 without).
            emitted: [R_s, W] int64 device, each sampled request's emitted tokens, -1 padded (W >= 1 + k); None
                when nothing was sampled.
            backend: the attention backend.
        """
        dev, T = self.device, input_ids.shape[0]
        nxt = torch.empty_like(input_ids)
        nxt[:T - 1] = input_ids[1:T]
        last = query_start_loc[1:].astype(np.int64) - 1                        # [R] each request's last token
        nxt[to_device(last, np.int64, dev)] = to_device(next_known, np.int64, dev)
        at = to_device(last, np.int64, dev)                                    # [R] where each request's state is
        if emitted is not None and len(sampled):
            base = last[sampled] - num_drafts                                  # [R_s] index of the run's start
            width = num_drafts + 1
            src_r = np.repeat(np.arange(len(sampled)), width)
            src_j = np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width)
            dst = to_device(np.repeat(base, width) + src_j, np.int64, dev)
            vals = emitted[to_device(src_r, np.int64, dev), to_device(src_j, np.int64, dev)]
            nxt[dst] = torch.where(vals >= 0, vals, nxt[dst])
            accepted = (emitted >= 0).sum(dim=1) - 1                           # [R_s] a: tokens accepted
            # the run's last emitted one
            at[to_device(sampled, np.int64, dev)] = to_device(base, np.int64, dev) + accepted
        for_logits, hidden = self.head(nxt, positions, head_input, ForwardContext(meta, self.kv_caches, backend))
        rows_t = to_device(req_rows, np.int64, dev)
        self.first_token[rows_t] = self.head.propose_ids(for_logits[at])
        self.last_hidden[rows_t] = hidden[at]


__all__ = ["EagleDrafter"]
