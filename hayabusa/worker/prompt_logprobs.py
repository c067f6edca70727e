"""Prompt logprobs (``SamplingParams.prompt_logprobs``), computed in the prefill forward that fills the KV cache.

The hidden state of prompt position p gives the distribution of the token at p + 1; so a step that computes
prompt positions [c, c + n) of a request yields the logprobs of prompt tokens c + 1 .. min(c + n, P - 1) (P =
prompt length; position P - 1 predicts the first output token, which the sampler handles). Only the top k ids and
values and the actual token's logprob and rank are kept on the device, in chunks of ``CHUNK_ROWS`` positions, so
memory stays at ``CHUNK_ROWS x V`` fp32 whatever the step size; the host gets them with the step's one sync.

    prompt:    t0   t1   t2   t3   t4        (P = 5)
    position:  0    1    2    3    4
    predicts:  t1   t2   t3   t4   (output)
    step 1 computes [0, 3) -> logprobs of t1, t2, t3; step 2 computes [3, 5) -> t4 (position 4 samples)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Most prompt positions whose [rows, V] fp32 logits exist at once. The runner passes min(CHUNK_ROWS, max_num_seqs):
# the memory profile already holds the sampler's sort of [max_num_seqs, V] logits (values + int64 indices), which
# is at least what a chunk takes (model-dtype and fp32 logits, fp32 logprobs, a bool mask).
CHUNK_ROWS = 256


@dataclass
class PromptLogprobsPlan:
    """Which of the step's tokens give prompt logprobs (host, numpy), built by ``plan_prompt_logprobs``."""

    req_ids: list[str]            # requests with prompt logprobs in this step, in batch order
    counts: list[int]             # positions of each, in the same order
    token_index: np.ndarray       # [N] int64, index of the position's token in the step
    target_ids: np.ndarray        # [N] int64, the prompt token each position predicts
    num_logprobs: np.ndarray      # [N] int64, each position's request's k


@dataclass
class PromptLogprobsPending:
    """Prompt logprobs of one step, on the device until the step's sync (then on the host).

    ``ids`` / ``values`` [N, K+1]: column 0 is the actual prompt token, then the top K (K = the step's largest k);
    ``ranks`` [N]: the actual token's 1-based rank.
    """

    plan: PromptLogprobsPlan
    ids: torch.Tensor
    values: torch.Tensor
    ranks: torch.Tensor

    def to_host(self, non_blocking: bool) -> None:
        """Queue the copies to the host (CUDA: the caller records its event after this)."""
        self.ids, self.values, self.ranks = (t.to("cpu", non_blocking=non_blocking)
                                             for t in (self.ids, self.values, self.ranks))

    def as_lists(self) -> dict[str, tuple[list[list[int]], list[list[float]], list[int]]]:
        """Per request: (ids [n][k+1], logprobs [n][k+1], ranks [n]), each request's own k. Call after the sync."""
        ids, vals, ranks = self.ids.tolist(), self.values.tolist(), self.ranks.tolist()
        out, start = {}, 0
        for rid, n in zip(self.plan.req_ids, self.plan.counts):
            k = int(self.plan.num_logprobs[start]) + 1
            out[rid] = ([r[:k] for r in ids[start:start + n]], [r[:k] for r in vals[start:start + n]],
                        ranks[start:start + n])
            start += n
        return out


def plan_prompt_logprobs(req_ids: list[str], rows: np.ndarray, num_computed: np.ndarray,
                         query_start_loc: np.ndarray, wanted: dict[str, int], done: dict[str, int],
                         token_ids: np.ndarray, num_prompt_tokens: np.ndarray) -> PromptLogprobsPlan | None:
    """The step's prompt-logprob positions, or None when it has none.

    Args:
        req_ids, rows: the step's requests and their rows in the persistent batch.
        num_computed: [R] tokens computed before this step; query_start_loc: [R + 1].
        wanted: request id -> k, for requests whose prompt logprobs are not complete.
        done: request id -> prompt positions already returned (after a preemption the prompt is recomputed;
            those positions are not returned twice). Updated here.
        token_ids: the batch's [rows, max_model_len] token ids; num_prompt_tokens: [rows].

    Returns:
        The plan; requests that finish their prompt logprobs here are removed from ``wanted``.
    """
    plan_ids, counts, index, targets, ks = [], [], [], [], []
    for i, rid in enumerate(req_ids):
        k = wanted.get(rid)
        if k is None:
            continue
        row = int(rows[i])
        P = int(num_prompt_tokens[row])
        c, n = int(num_computed[i]), int(query_start_loc[i + 1] - query_start_loc[i])
        first, end = max(c, done.get(rid, 0)), min(c + n, P - 1)
        if end > first:
            plan_ids.append(rid)
            counts.append(end - first)
            index.append(np.arange(first, end, dtype=np.int64) - c + int(query_start_loc[i]))
            targets.append(token_ids[row, first + 1:end + 1].astype(np.int64))
            ks.append(np.full(end - first, k, dtype=np.int64))
            done[rid] = end
        if done.get(rid, 0) >= P - 1:
            del wanted[rid]
    if not plan_ids:
        return None
    return PromptLogprobsPlan(plan_ids, counts, np.concatenate(index), np.concatenate(targets), np.concatenate(ks))


def compute_prompt_logprobs(hidden: torch.Tensor, plan: PromptLogprobsPlan, compute_logits,
                            chunk_rows: int = CHUNK_ROWS, log_softmax=None) -> PromptLogprobsPending:
    """Logprobs of the plan's positions from the step's hidden states [T, hidden], ``chunk_rows`` positions at a
    time.

    Args:
        hidden: the step's hidden states.
        plan: which tokens and which targets.
        compute_logits: the model's hidden [N, hidden] -> logits [N, V].
        chunk_rows: positions per chunk (bounds the [chunk_rows, V] fp32 logits alive at once).
        log_softmax: logits [N, V] -> fp32 log-probabilities (default torch's; the sampler's in batch-invariant
            mode).
    """
    device = hidden.device
    index = torch.from_numpy(plan.token_index).to(device, non_blocking=True)
    targets = torch.from_numpy(plan.target_ids).to(device, non_blocking=True)
    K = int(plan.num_logprobs.max())
    ids, vals, ranks = [], [], []
    for s in range(0, len(plan.token_index), chunk_rows):
        logits = compute_logits(hidden[index[s:s + chunk_rows]])
        logprobs = log_softmax(logits) if log_softmax is not None else torch.log_softmax(logits.float(), dim=-1)
        tgt = targets[s:s + chunk_rows, None]                                                          # [n, 1]
        actual = logprobs.gather(1, tgt)                                                               # [n, 1]
        ranks.append((logprobs > actual).sum(-1) + 1)
        if K > 0:
            top_vals, top_ids = logprobs.topk(K, dim=-1)
            ids.append(torch.cat([tgt, top_ids], 1))
            vals.append(torch.cat([actual, top_vals], 1))
        else:
            ids.append(tgt)
            vals.append(actual)
    return PromptLogprobsPending(plan, torch.cat(ids), torch.cat(vals), torch.cat(ranks))
