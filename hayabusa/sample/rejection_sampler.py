"""Verification of speculative proposals: greedy acceptance and rejection sampling.

Rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): proposal d ~ q at a position
where the target's distribution is p is accepted with probability min(1, p(d) / q(d)); at the first rejection the
token is drawn from the residual norm(max(p - q, 0)) and the rest is dropped; when every proposal is accepted a
bonus token is drawn from the target's distribution at the next position. Each emitted token is then distributed
exactly as p. A deterministic proposer (n-gram) has q = one-hot(d): accept with probability p(d), and the residual
is p with d removed. Greedy rows accept a proposal iff it equals the target's argmax, and a rejection emits the
argmax, so greedy output is the target's own.

Everything runs on the device with no host sync; per-request generators make seeded requests reproducible.
"""

from __future__ import annotations

import torch

from hayabusa.sample.sampler import sample_from_probs


def _uniform(shape: tuple[int, int], generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """[R, K] U[0, 1) draws; rows in ``generators`` draw from their own generator."""
    u = torch.empty(shape, dtype=torch.float32, device=device)
    if len(generators) < shape[0]:
        u.uniform_()
    for row, g in generators.items():
        u[row].uniform_(generator=g)
    return u


def rejection_sample(draft_ids: torch.Tensor, num_drafts: torch.Tensor, target_argmax: torch.Tensor,
                     target_probs: torch.Tensor | None, bonus_ids: torch.Tensor, greedy: torch.Tensor,
                     generators: dict[int, torch.Generator], draft_probs: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Verify each row's proposals; returns the tokens each row emits.

    Args:
        draft_ids: [R, K] int64, the proposals (columns >= num_drafts are padding, any value).
        num_drafts: [R] int64, proposals per row (0..K).
        target_argmax: [R, K] int64, the target's argmax at each proposal position (greedy rows).
        target_probs: [R, K, V] fp32, the target's sampling distribution at each proposal position
            (temperature, top-k/p/min-p applied); None when every row is greedy.
        bonus_ids: [R] int64, a token drawn from the target at the position after each row's last proposal.
        greedy: [R] bool, rows that accept by argmax.
        generators: row -> generator (seeded rows).
        draft_probs: [R, K, V] fp32, the proposer's distributions; None = deterministic proposals (one-hot).

    Returns:
        [R, K + 1] int64: the accepted proposals, then one recovered or bonus token, then -1 padding.
    """
    R, K = draft_ids.shape
    device = draft_ids.device
    pos = torch.arange(K, device=device)
    valid = pos[None, :] < num_drafts[:, None]                               # [R, K]
    d = draft_ids.clamp(min=0)
    accept = d == target_argmax                                              # greedy rule
    recovered = target_argmax
    if target_probs is not None:   # some row samples (the caller knows it on the host: no sync here)
        p_d = target_probs.gather(-1, d[..., None]).squeeze(-1)              # [R, K]
        q_d = 1.0 if draft_probs is None else draft_probs.gather(-1, d[..., None]).squeeze(-1)
        u = _uniform((R, K), generators, device)
        accept = torch.where(greedy[:, None], accept, u * q_d < p_d)        # u < p / q, without dividing by 0
        if draft_probs is None:
            residual = target_probs.scatter(-1, d[..., None], 0.0)          # p with d removed
        else:
            residual = (target_probs - draft_probs).clamp_min(0.0)
        # p == q leaves no residual (and the proposal is always accepted): fall back to p to keep it finite
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs)
        flat_gens = {r * K + j: g for r, g in generators.items() for j in range(K)}
        drawn = sample_from_probs(residual.view(R * K, -1), flat_gens).view(R, K)
        recovered = torch.where(greedy[:, None], target_argmax, drawn)
    accept &= valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)          # [R] longest accepted prefix
    out = torch.full((R, K + 1), -1, dtype=torch.int64, device=device)
    out[:, :K] = torch.where(pos[None, :] < num_accepted[:, None], d, -1)
    at = recovered.gather(1, num_accepted.clamp(max=max(K - 1, 0))[:, None]).squeeze(1) if K else bonus_ids
    last = torch.where(num_accepted < num_drafts, at, bonus_ids)
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return out
