"""The runner's side of speculative decoding: where a verify step's proposals go in the input, which logits it
computes, and how its tokens are chosen (``hayabusa/sample/rejection_sampler.py``).

A request with k proposals is scheduled 1 + k tokens: its last token, then the proposals. Its logits are computed
at all 1 + k positions: position j < k predicts proposal j (verified), position k gives the bonus token.

  input:   | last | d_0 | d_1 | ... | d_{k-1} |
  logits:  |  p_0 | p_1 | p_2 | ... |   p_k   |     p_j verifies d_j; p_k samples the bonus token
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hayabusa.attention.metadata import AttentionMetadata
from hayabusa.envs import env_flag
from hayabusa.kernels.greedy_verify import greedy_verify, greedy_verify_ref
from hayabusa.sample.rejection_sampler import rejection_sample
from hayabusa.sample.sampler import Sampler
from hayabusa.sampling_params import SAMPLING_EPS
from hayabusa.worker.input_batch import InputBatch

# The greedy path's last step on CUDA: the Triton kernel (one launch) or its plain-torch form (6 small ops, the CPU
# path). On an H200 (2026-12-02) tests/spec_decode/test_greedy_verify_cuda.py and tests/kernels/test_greedy_verify.py
# passed and benchmarks/verify_host.py measured 4 aten ops against 10 and 192 against 417 us a verify call at
# batch 8 (189 against 199 at batch 1), ids identical: the kernel is the default on CUDA.
# HAYABUSA_GREEDY_VERIFY_TRITON=0 (read at import) or USE_GREEDY_VERIFY_TRITON = False (read at call time) selects
# the torch form.
USE_GREEDY_VERIFY_TRITON = env_flag("HAYABUSA_GREEDY_VERIFY_TRITON", True)


@dataclass
class SpecStepInputs:
    """Host arrays of a verify step, over its R_s sampled requests (in the order of ``logits_rows``)."""

    num_drafts: np.ndarray      # [R_s] int64, proposals per sampled request (0 for those without)
    draft_ids: np.ndarray       # [R_s, K] int64, proposals padded with 0 (K = max proposals)
    last_index: np.ndarray      # [R_s] int64, each request's last position in the step's logits
    draft_index: np.ndarray     # [R_s, K] int64, the logits row that verifies each proposal (padding: last_index)
    draft_ids_dev: torch.Tensor | None = None   # [R_d, K] int64 device: a draft model's proposals (rows with k > 0)


def to_device(a: np.ndarray, dtype, device: torch.device) -> torch.Tensor:
    """A host array as a ``dtype`` (numpy) tensor on ``device``, copied without blocking."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device, non_blocking=True)


@dataclass
class DraftBatch:
    """What a proposer's batched one-token forwards share (EagleDrafter / DraftModel ``propose``), over its R_d
    requests: one query token per request per forward, at a token of the verify step (its position and slot)."""

    first: np.ndarray               # [R_d] int64 host, the step's token index of each request's last token
    query_start_loc: torch.Tensor   # [R_d + 1] int32 device, 0 .. R_d
    block_table: torch.Tensor       # [R_d, W] int32 device, the requests' rows of the step's block table
    device: torch.device

    def metadata(self, idx: np.ndarray, valid: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray
                 ) -> tuple[AttentionMetadata, torch.Tensor]:
        """One forward's metadata: request i's query at the step's token ``idx[i]`` ([R_d] int64 host), writing
        its KV at that token's slot when ``valid[i]`` ([R_d] bool; otherwise no write). ``positions`` /
        ``slot_mapping``: [T] host, the step's. Returns (metadata, the queries' positions [R_d] int64 device)."""
        pos = positions[idx]
        slots = np.where(valid, slot_mapping[idx], -1)
        dev = self.device
        meta = AttentionMetadata(self.query_start_loc, to_device(pos + 1, np.int32, dev), self.block_table,
                                 to_device(slots, np.int64, dev), len(idx), 1, int(pos.max()) + 1)
        return meta, to_device(pos, np.int64, dev)


def draft_batch(req_index: np.ndarray, query_start_loc: np.ndarray, block_table: torch.Tensor,
                device: torch.device) -> DraftBatch:
    """The DraftBatch of a verify step's proposing requests.

    Args:
        req_index: [R_d] int64, the requests (indices in the step's batch) with proposal slots.
        query_start_loc: [R + 1] host, the step's token offsets.
        block_table: [R, W] int32 device, the step's block table rows.
        device: the proposer's device.
    """
    first = query_start_loc[req_index].astype(np.int64)
    return DraftBatch(first, to_device(np.arange(len(req_index) + 1), np.int32, device),
                      block_table[to_device(req_index, np.int64, device)], device)


def write_drafts(batch: InputBatch, rows: np.ndarray, req_ids: list[str], spec: dict[str, list[int]]
                 ) -> np.ndarray:
    """Put each request's proposals in its row right after its known tokens (the input gather reads them from
    there; the next write_sampled overwrites them). Returns [rows] int64: tokens known per row, proposals
    included."""
    known = batch.num_tokens.copy()
    for rid, row in zip(req_ids, rows.tolist()):
        drafts = spec.get(rid)
        if drafts:
            n = known[row]
            batch.token_ids[row, n:n + len(drafts)] = drafts
            known[row] = n + len(drafts)
    return known


def plan_verify(req_ids: list[str], sampled_rows: np.ndarray, query_start_loc: np.ndarray,
                spec: dict[str, list[int]]) -> tuple[np.ndarray, SpecStepInputs]:
    """The logits indices of a verify step ([sum(1 + k)] int64 token indices, request by request) and its
    SpecStepInputs."""
    R_s = len(sampled_rows)
    num_drafts = np.array([len(spec.get(req_ids[i], ())) for i in sampled_rows.tolist()], dtype=np.int64)
    width = num_drafts + 1
    ends = query_start_loc[1:][sampled_rows].astype(np.int64)                     # [R_s] one past each last token
    starts = np.cumsum(width) - width                                             # [R_s] first logits row
    logits_indices = np.repeat(ends - width - starts, width) + np.arange(int(width.sum()), dtype=np.int64)
    K = max(int(num_drafts.max()) if R_s else 0, 1)
    draft_ids = np.zeros((R_s, K), dtype=np.int64)
    for i, n in enumerate(num_drafts.tolist()):
        if n:
            draft_ids[i, :n] = spec[req_ids[int(sampled_rows[i])]]
    last_index = starts + num_drafts
    col = np.arange(K)
    draft_index = np.where(col[None, :] < num_drafts[:, None], starts[:, None] + col[None, :], last_index[:, None])
    return logits_indices, SpecStepInputs(num_drafts, draft_ids, last_index, draft_index)


def greedy_plan(spec: SpecStepInputs) -> np.ndarray:
    """The ``plan`` of ``kernels/greedy_verify.py`` for a verify step: [R_s, 2W + 2] int64, W = K + 1 (per request:
    the argmax row of each position 0 .. W-1, capped at its last; its host proposals, -1 padded; num_drafts; its
    row in ``spec.draft_ids_dev`` or -1). Host numpy only."""
    nd = spec.num_drafts
    R_s, K = spec.draft_ids.shape
    W = K + 1
    col = np.arange(W, dtype=np.int64)
    plan = np.empty((R_s, 2 * W + 2), dtype=np.int64)
    plan[:, :W] = (spec.last_index - nd)[:, None] + np.minimum(col[None, :], nd[:, None])
    plan[:, W:2 * W - 1] = np.where(col[None, :K] < nd[:, None], spec.draft_ids, -1)
    plan[:, 2 * W - 1] = -1
    plan[:, 2 * W] = nd
    has = nd > 0
    plan[:, 2 * W + 1] = np.where(has, np.cumsum(has) - 1, -1)
    return plan


def verify(sampler_fn, batch: InputBatch, rows: np.ndarray, num_output: np.ndarray, spec: SpecStepInputs,
           logits: torch.Tensor, greedy_fast_path: bool = True) -> tuple[torch.Tensor, tuple | None, bool]:
    """Choose a verify step's tokens on the device (no host sync).

    When every request with proposals is greedy (temperature 0; the common case) and ``greedy_fast_path``: one
    argmax over all the step's logits rows, one copy of a host plan, and one kernel (``kernels/greedy_verify.py``;
    its torch reference off CUDA) give the tokens; the usual sampler runs only when some request needs it
    (logprobs, penalties, pending min_tokens, temperature > 0 without proposals), for the tokens at the last
    positions. Otherwise proposals go through ``rejection_sample`` (exact for temperature > 0).

    Args:
        sampler_fn: (logits [R_s, V], rows, num_output) -> (ids [R_s], logprobs or None): the runner's usual
            sampling of one token per request, used at each request's last position (its bonus token, or its one
            token when it has no proposals: penalties, logprobs and min_tokens apply there as in any step).
        batch: the runner's rows.
        rows: [R_s] int64, the sampled requests' rows.
        num_output: [R_s] int64, their output tokens before this step (placeholders included).
        spec: the step's SpecStepInputs.
        logits: [sum(1 + k), V], the step's logits (plan_verify's indices).
        greedy_fast_path: allow the greedy path (tests turn it off to compare).

    Returns:
        ([R_s, K + 1] int64 emitted tokens, -1 padded; the last positions' logprobs or None; whether the greedy
        path ran).
    """
    device = logits.device
    if greedy_fast_path and bool((batch.params_np["temperature"][rows[spec.num_drafts > 0]] < SAMPLING_EPS).all()):
        bonus = lp = None
        if not batch.is_plain_greedy(rows, num_output):   # the usual sampler's tokens at the last positions
            last = torch.from_numpy(spec.last_index).to(device, non_blocking=True)
            bonus, lp = sampler_fn(logits[last], rows, num_output)
        plan = to_device(greedy_plan(spec), np.int64, device)
        fn = greedy_verify if device.type == "cuda" and USE_GREEDY_VERIFY_TRITON else greedy_verify_ref
        return fn(logits.argmax(dim=-1), plan, spec.draft_ids_dev, bonus), lp, True
    last = torch.from_numpy(spec.last_index).to(device, non_blocking=True)
    bonus, lp = sampler_fn(logits[last], rows, num_output)
    R_s, K = spec.draft_ids.shape
    out = torch.full((R_s, K + 1), -1, dtype=torch.int64, device=device)
    out[:, 0] = bonus
    sel = np.flatnonzero(spec.num_drafts > 0)           # requests with proposals: eligible ones (no penalties)
    if len(sel) == 0:
        return out, lp, False
    sel_t = torch.from_numpy(sel).to(device, non_blocking=True)
    d_rows = rows[sel]
    index = torch.from_numpy(spec.draft_index[sel]).to(device, non_blocking=True)          # [R_d, K]
    draft_logits = logits[index]                                                           # [R_d, K, V]
    target_argmax = draft_logits.argmax(dim=-1)
    greedy_np = batch.params_np["temperature"][d_rows] < SAMPLING_EPS
    target_probs = None
    generators: dict[int, torch.Generator] = {}
    if not greedy_np.all():
        R_d, V = len(sel), draft_logits.shape[-1]
        md = batch.sampling_metadata(np.repeat(d_rows, K), np.repeat(num_output[sel], K), None)
        flat = Sampler.process_logits(draft_logits.reshape(R_d * K, V), md)
        target_probs = Sampler.compute_probs(flat, md).view(R_d, K, V)
        generators = {i: batch.generators[r] for i, r in enumerate(d_rows.tolist()) if r in batch.generators}
    draft_ids = spec.draft_ids_dev if spec.draft_ids_dev is not None else \
        torch.from_numpy(spec.draft_ids[sel]).to(device, non_blocking=True)
    emitted = rejection_sample(draft_ids,
                               torch.from_numpy(spec.num_drafts[sel]).to(device, non_blocking=True),
                               target_argmax, target_probs, bonus[sel_t],
                               torch.from_numpy(greedy_np).to(device, non_blocking=True), generators)
    out[sel_t] = emitted
    return out, lp, False
