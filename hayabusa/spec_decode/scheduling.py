"""Which running requests get proposals in a step, and how many: the scheduler's side of speculative decoding
(plain Python; the scheduler calls ``propose`` for a request about to decode one token)."""

from __future__ import annotations

from hayabusa.core.request import Request
from hayabusa.spec_decode.config import SpeculativeConfig
from hayabusa.spec_decode.ngram import NgramProposer, TokenHistory
from hayabusa.spec_decode.payoff import PayoffRule


def eligible(req: Request) -> bool:
    """Requests that speculation leaves alone (they decode one token per step, unchanged): penalties (their
    history would change within a verified run), logit_bias / allowed_token_ids / bad_words (the verifier
    compares proposals with unedited logits), structured outputs (one bitmask per step), logprobs and
    prompt_logprobs (one entry per step), min_tokens not yet reached (EOS is masked per token), and requests with
    images or an encoder input (their decode steps stay one token)."""
    p = req.sampling_params
    return (req.structured is None and not req.mm_inputs and req.encoder_prompt_token_ids is None and not p.has_penalties
            and not p.has_logit_edits and p.logprobs is None and p.prompt_logprobs is None
            and req.num_output_tokens >= p.min_tokens)


def seeded(req: Request) -> bool:
    """Requests that sample (temperature > 0) with their own ``seed``: the measured turn-off rule leaves them
    alone (their proposals follow the static rules only), so timing never changes their tokens (rejection
    sampling draws from the request's generator once per proposal)."""
    p = req.sampling_params
    return p.seed is not None and not p.greedy


class SpecDecodeScheduling:
    """Proposals for the scheduler.

    Args:
        config: the checked speculative config.
        max_model_len: the context limit (a proposal never runs past it).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # draft_model: the runner's draft makes the proposals at the start of the step; the scheduler sends k
        # slots (-1 ids) for them
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        # the measured turn-off rule (payoff.py), or None when off (disable_by_payoff=False)
        self.payoff = PayoffRule(config.payoff_margin, config.payoff_window, config.payoff_probe_every) \
            if config.disable_by_payoff else None
        # set by the scheduler before each step (``set_step_mode``): the measured rule has speculation off for
        # the step's unseeded requests
        self.measured_off = False

    def set_step_mode(self, num_running: int) -> bool:
        """Before a step with ``num_running`` running requests is scheduled (or asked about): whether the
        measured rule lets unseeded requests propose in it (True without the rule). No side effect but
        ``measured_off``; the step is counted by ``PayoffRule.scheduled`` once it is scheduled."""
        speculate = self.payoff is None or self.payoff.speculate(num_running)
        self.measured_off = not speculate
        return speculate

    def may_propose(self, req: Request) -> bool:
        """Whether the request could get proposals in its next decode step, decided before scheduling it (the
        engine runs a step overlapped with the previous one when no running request may propose): False for
        requests speculation leaves alone, those in a low-acceptance back-off, and unseeded ones while the
        measured rule has speculation off (``set_step_mode``)."""
        return req.num_output_tokens >= req.spec_backoff_until and eligible(req) \
            and not (self.measured_off and not seeded(req))

    def _max_k(self, req: Request) -> int:
        """Proposals the request may get before the step's budget: k, never past max_tokens or max_model_len
        (accepted tokens plus the bonus token always fit); 0 when speculation leaves it alone."""
        if not self.may_propose(req):
            return 0
        return min(self.config.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def lookup_all(self, reqs: list[Request]) -> dict[str, list[int]] | None:
        """The n-gram lookups of a step's decoding requests at once (``NgramProposer.propose_batch``), before
        the scheduler's loop, which then takes each request's (``propose(..., lookups)``): request id -> up to
        its k proposals (only those with some). None for a draft model's method (no host lookup) and for a
        proposer without ``propose_batch`` (its ``propose`` then runs per request, in the scheduler's order)."""
        propose_batch = getattr(self.proposer, "propose_batch", None)
        if propose_batch is None:
            return None
        todo, ks, histories = [], [], []
        for req in reqs:
            k = self._max_k(req)
            if k > 0:
                if req.spec_history is None:
                    req.spec_history = TokenHistory()
                todo.append(req.request_id)
                ks.append(k)
                histories.append(req.spec_history.sync(req.all_token_ids))
        found = propose_batch(histories, ks)
        return {rid: drafts for rid, drafts in zip(todo, found) if drafts}

    def propose(self, req: Request, budget: int, lookups: dict[str, list[int]] | None = None) -> list[int]:
        """Proposed tokens for a request whose step computes its last token (and samples the next one):
        at most k, at most ``budget`` (the step's tokens left after its own one), and never past max_tokens or
        max_model_len (accepted tokens plus the bonus token always fit). ``lookups``: the step's ``lookup_all``
        (a request missing from it has no proposal); without it the request's lookup runs alone. (A lookup for
        k' >= k tokens starts with the lookup for k: the budget only truncates.)"""
        k = min(self._max_k(req), budget)
        if k <= 0:
            return []
        if self.proposer is None:
            return [-1] * k
        if lookups is not None:
            return lookups.get(req.request_id, [])[:k]
        if req.spec_history is None:
            req.spec_history = TokenHistory()
        # (a missed lookup is not counted by the low-acceptance rule: on a copy-heavy CPU profile, 77 % of
        # lookups missing, counting misses put the request in back-off and cut its accepted tokens from 112 to 8;
        # so at small batches a request that may propose keeps its steps synchronous even while lookups miss)
        return self.proposer.propose(req.spec_history.sync(req.all_token_ids), k)

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """The low-acceptance turn-off rule, per request (see SpeculativeConfig): once ``acceptance_window``
        proposals have been verified, a window whose acceptance rate is below ``min_acceptance_rate`` stops the
        request's proposals for its next ``acceptance_backoff`` output tokens (they decode one per step); then a
        new window starts. Every window is judged afresh, so a request whose text turns copy-heavy later gets
        proposals again after one back-off."""
        cfg = self.config
        if cfg.min_acceptance_rate <= 0:
            return
        req.spec_window_drafts += num_drafts
        req.spec_window_accepted += num_accepted
        if req.spec_window_drafts < cfg.acceptance_window:
            return
        if req.spec_window_accepted < cfg.min_acceptance_rate * req.spec_window_drafts:
            # the tokens this step emits (num_accepted + 1) come first, then the back-off
            req.spec_backoff_until = req.num_output_tokens + num_accepted + 1 + cfg.acceptance_backoff
        req.spec_window_drafts = req.spec_window_accepted = 0
