"""Rejection sampling preserves the target distribution; greedy verification accepts the longest agreeing prefix."""

from __future__ import annotations

import torch

from hayabusa.sample.rejection_sampler import rejection_sample
from hayabusa.sample.sampler import sample_from_probs

# chi-square critical values at significance 0.001 (df = V - 1), from the chi-square table
CHI2_CRIT_0001 = {4: 18.467, 5: 20.515}
N = 10_000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _emit(target: torch.Tensor, draft: torch.Tensor | None, draft_ids: torch.Tensor, bonus_p: torch.Tensor,
          seed: int) -> torch.Tensor:
    """N rows, K proposals each; returns [N, K + 1] emitted tokens."""
    torch.manual_seed(seed)
    n, K = draft_ids.shape
    V = target.shape[-1]
    target_probs = target.expand(n, K, V).contiguous()
    bonus = sample_from_probs(bonus_p.expand(n, V).contiguous(), {})
    return rejection_sample(draft_ids, torch.full((n,), K), target_probs.argmax(-1), target_probs, bonus,
                            torch.zeros(n, dtype=torch.bool), {},
                            None if draft is None else draft.expand(n, K, V).contiguous())


def test_draft_model_rejection_sampling_matches_target_distribution():
    # target p and draft q over V = 5 differ a lot; 10,000 seeded samples of the first emitted token ~ p
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5])
    torch.manual_seed(1)
    draft_ids = sample_from_probs(q.expand(N * 2, 5).contiguous(), {}).view(N, 2)   # i.i.d. proposals from q
    out = _emit(p, q, draft_ids, p, seed=2)
    first = torch.bincount(out[:, 0], minlength=5).float()
    assert chi_square(first, p) < CHI2_CRIT_0001[4], first
    # sanity: the statistic does reject the draft's distribution (the test can fail)
    assert chi_square(first, q) > 1000
    # the second token (emitted where the first proposal was accepted) is ~ p as well
    second = out[:, 1][out[:, 1] >= 0]
    assert len(second) > 1000
    assert chi_square(torch.bincount(second, minlength=5).float(), p) < CHI2_CRIT_0001[4]


def test_deterministic_proposal_rejection_sampling_matches_target_distribution():
    # n-gram: q = one-hot(proposal); proposing token 3 every time must still give p for the first token
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.06, 0.04])
    draft_ids = torch.full((N, 1), 3)
    out = _emit(p, None, draft_ids, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), seed=3)
    first = torch.bincount(out[:, 0], minlength=6).float()
    assert chi_square(first, p) < CHI2_CRIT_0001[5], first
    # accepted (token 3) rows carry the bonus token (5, the bonus distribution's only token) next
    assert bool((out[out[:, 0] == 3][:, 1] == 5).all())
    assert bool((out[out[:, 0] != 3][:, 1] == -1).all())


def test_greedy_accepts_longest_agreeing_prefix_plus_one():
    argmax = torch.tensor([[4, 7, 1], [4, 7, 1], [4, 7, 1], [2, 0, 0]])
    drafts = torch.tensor([[4, 7, 1], [4, 9, 1], [5, 7, 1], [0, 0, 0]])
    num = torch.tensor([3, 3, 3, 0])
    out = rejection_sample(drafts, num, argmax, None, torch.tensor([8, 8, 8, 2]), torch.ones(4, dtype=torch.bool),
                           {})
    assert out.tolist() == [[4, 7, 1, 8], [4, 7, -1, -1], [4, -1, -1, -1], [2, -1, -1, -1]]


def test_seeded_rows_reproduce():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).expand(3, 2, 4).contiguous()
    drafts = torch.tensor([[1, 2], [1, 2], [1, 2]])

    def run() -> list:
        g = torch.Generator().manual_seed(7)
        torch.manual_seed(torch.randint(0, 1000, ()).item())    # the unseeded rows' noise differs per run
        return rejection_sample(drafts, torch.tensor([2, 2, 2]), p.argmax(-1), p, torch.tensor([0, 0, 0]),
                                torch.zeros(3, dtype=torch.bool), {1: g}).tolist()[1]

    assert run() == run()
