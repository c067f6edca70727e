"""Sampler: logits [R, V] -> one token id per row, batched and in fp32 (vLLM's order of operations).

  raw logprobs (log_softmax of the input, if any row wants logprobs: vLLM's default logprobs_mode)
  -> allowed_token_ids -> bad_words -> min_tokens mask -> logit_bias -> penalties (repetition, frequency,
     presence)
  -> greedy rows: argmax
  -> random rows: / temperature -> top-k -> top-p -> min-p -> softmax -> exponential-race sample

The only per-row Python loops are over the host dict of min_tokens rows and over the seeded rows' generators;
nothing here reads a device tensor from the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hayabusa.sample.metadata import SamplingMetadata, to_device
from hayabusa.sampling_params import SAMPLING_EPS


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [R] int64, on logits.device
    logprob_token_ids: torch.Tensor | None  # [R, K+1] int64: column 0 = sampled token, then the top-K ids
    logprobs: torch.Tensor | None  # [R, K+1] fp32 logprobs of those ids under the raw logits
    sampled_token_ranks: torch.Tensor | None  # [R] int64, 1-based rank of the sampled token under the raw logits


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set logits [R, V] fp32 to -inf, in place, at (row, id) for every id in ``metadata.min_tokens[row]``."""
    if not metadata.min_tokens:
        return logits
    rows = [r for r, ids in metadata.min_tokens.items() for _ in ids]
    cols = [t for ids in metadata.min_tokens.values() for t in ids]
    index = to_device([rows, cols], torch.int64, logits.device)  # [2, n]
    return logits.index_put_((index[0], index[1]), logits.new_full((), float("-inf")))


def apply_allowed_token_ids(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set logits [R, V] fp32 to -inf, in place, at every id outside each allowed_token_ids row's list."""
    if metadata.allowed_token_ids is None:
        return logits
    rows, cells, ids = metadata.allowed_token_ids
    masked = torch.ones(rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
    masked[cells, ids] = False
    logits[rows] = logits[rows].masked_fill(masked, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set logits [R, V] fp32 to -inf, in place, at the (row, id) pairs of ``metadata.bad_words`` that are banned
    (adding -inf or 0: a pair listed twice, banned by one word and not by another, stays banned)."""
    if metadata.bad_words is None:
        return logits
    rows, ids, banned = metadata.bad_words
    add = torch.where(banned, float("-inf"), 0.0).to(logits.dtype)
    return logits.index_put_((rows, ids), add, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add each logit_bias entry to logits [R, V] fp32, in place (-inf stays -inf)."""
    if metadata.logit_bias is None:
        return logits
    rows, ids, biases = metadata.logit_bias
    return logits.index_put_((rows, ids), biases, accumulate=True)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties on logits [R, V] fp32 (returns a new tensor).

    Repetition (CTRL, Keskar et al. 2019, as HF/vLLM apply it): for every token in the prompt or the output so far,
    a positive logit is divided by the penalty and a negative one multiplied by it.
    Frequency / presence (OpenAI): over output tokens only, ``l -= frequency * count + presence * (count > 0)``.
    """
    if metadata.no_penalties:
        return logits
    R, V = logits.shape
    assert metadata.prompt_token_ids is not None and metadata.repetition_penalties is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    output = metadata.output_token_ids  # [R, max_out] int64, padded with V
    assert output is not None
    # One extra column catches the padding id V, then is dropped.
    output_counts = torch.zeros(R, V + 1, dtype=torch.float32, device=logits.device)
    output_counts.scatter_add_(1, output, torch.ones_like(output, dtype=torch.float32))
    output_counts = output_counts[:, :V]  # [R, V] times each token was generated
    seen = torch.zeros(R, V + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, metadata.prompt_token_ids, True)
    seen = seen[:, :V] | (output_counts > 0)  # [R, V] in the prompt or the output
    rep = torch.where(seen, metadata.repetition_penalties[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - metadata.frequency_penalties[:, None] * output_counts
    return logits - metadata.presence_penalties[:, None] * (output_counts > 0)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [R, V] / temperature [R]; greedy rows (T < 1e-5) are divided by 1 (their result is the argmax)."""
    temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits / temperature[:, None]


def _softmax(logits: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    if batch_invariant:
        from hayabusa.kernels.batch_invariant import log_softmax_bi

        return log_softmax_bi(logits).exp()
    return logits.softmax(dim=-1)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Mask logits [R, V] fp32 to -inf outside each row's top-k, then top-p, then min-p set (one sort for all).

    top_k [R] int64 (V = off): keep the k largest logits.
    top_p [R] fp32 (1.0 = off): nucleus sampling (Holtzman et al. 2019, "The Curious Case of Neural Text
        Degeneration"): keep the smallest prefix of the sorted distribution (renormalised after top-k) whose
        mass reaches p, i.e. every token whose preceding mass is < p.
    min_p [R] fp32 (0.0 = off): min-p sampling (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"): keep
        tokens whose probability is >= min_p x the top probability.
    The sort is stable and descending, so among tied logits the lowest id ranks first, as in ``argmax``: top_k=1,
    or a top_p small enough to keep one token, gives exactly the greedy token. The top token is never masked.
    batch_invariant: the softmaxes are exp(log_softmax_bi) (one program per row; kernels/batch_invariant.py).
    """
    if top_k is None and top_p is None and min_p is None:
        return logits
    V = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    if top_k is not None:
        position = torch.arange(V, device=logits.device)
        sorted_logits.masked_fill_(position[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = _softmax(sorted_logits, batch_invariant)
        mass_before = probs.cumsum(dim=-1) - probs  # [R, V] mass of the strictly better tokens
        # p == 1 must keep everything, even where fp32 rounding pushes the cumulative sum over 1.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits.masked_fill_(drop, float("-inf"))
    if min_p is not None:
        probs = _softmax(sorted_logits, batch_invariant)
        sorted_logits.masked_fill_(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    # Back to vocab order, so that a row's noise (and so its token) does not depend on whether another row sorted.
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one id per row of probs [R, V] fp32 by the exponential race: argmax(probs / q), q ~ Exp(1) i.i.d.

    The winner is distributed as probs (the Gumbel-max trick in another form) and needs no cumsum nor host sync.
    Rows in ``generators`` draw their noise from their own generator, so their token depends only on their own
    probabilities and generator state; other rows use the device's default generator. Returns [R] int64.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # Exp(1) can round to 0 on some backends; 0/0 would be NaN, and argmax takes NaN as the maximum.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def gather_logprobs(
    raw_logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From raw_logprobs [R, V] fp32 and sampled [R] int64: ids [R, K+1] (sampled, then the top-K), their
    logprobs [R, K+1] fp32, and the sampled token's 1-based rank [R] int64 (ties counted against it, as vLLM)."""
    sampled_logprob = raw_logprobs.gather(-1, sampled[:, None])  # [R, 1]
    ranks = (raw_logprobs >= sampled_logprob).sum(dim=-1)
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)  # [R, K]
    ids = torch.cat([sampled[:, None], top_ids], dim=-1)
    return ids, torch.cat([sampled_logprob, top_logprobs], dim=-1), ranks


class Sampler(torch.nn.Module):
    """Turns the step's logits into one token id per request.

    Args (of forward):
        logits: [R, V], any float dtype (converted to fp32; the input is not modified).
        metadata: the step's SamplingMetadata, R rows, tensors on ``logits.device``.

    Returns:
        SamplerOutput; its logprob fields are None unless ``metadata.max_num_logprobs`` is set. Logprobs are the
        raw ones (log_softmax of the input logits, before any penalty, logit_bias, allowed_token_ids / bad_words
        mask or temperature: vLLM's default logprobs_mode "raw_logprobs").
    """

    def __init__(self, batch_invariant: bool = False) -> None:
        super().__init__()
        # batch-invariant mode: the raw logprobs and the random rows' softmax come from a per-row kernel whose
        # bits depend only on the row (kernels/batch_invariant.py); everything else here is per row already
        self.batch_invariant = batch_invariant

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] any float dtype -> log_softmax [R, V] fp32 (batch-invariant mode: the per-row kernel)."""
        if self.batch_invariant:
            from hayabusa.kernels.batch_invariant import log_softmax_bi

            return log_softmax_bi(logits)
        return torch.log_softmax(logits.to(torch.float32), dim=-1)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = self.log_softmax(logits)
        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, logprobs, ranks = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled, ids, logprobs, ranks)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """A fp32 copy of logits [R, V] with allowed_token_ids, bad_words, the min_tokens mask, logit_bias and the
        penalties applied, in vLLM's order (what greedy argmaxes)."""
        logits = logits.to(torch.float32, copy=True)
        logits = apply_allowed_token_ids(logits, metadata)
        logits = apply_bad_words(logits, metadata)
        logits = apply_min_tokens(logits, metadata)
        logits = apply_logit_bias(logits, metadata)
        return apply_penalties(logits, metadata)

    @staticmethod
    def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata, batch_invariant: bool = False
                      ) -> torch.Tensor:
        """The distribution random rows sample from, probs [R, V] fp32, given processed logits [R, V] fp32:
        softmax of (logits / temperature) after top-k, top-p and min-p. Greedy rows get temperature 1.
        batch_invariant: the softmaxes are exp(log_softmax_bi) (per-row kernel)."""
        logits = apply_temperature(logits, metadata.temperature)
        logits = apply_top_k_top_p_min_p(logits, metadata.top_k, metadata.top_p, metadata.min_p, batch_invariant)
        return _softmax(logits, batch_invariant)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Processed logits [R, V] fp32 -> token ids [R] int64: argmax for greedy rows, a draw for the others."""
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        sampled = sample_from_probs(self.compute_probs(logits, metadata, self.batch_invariant),
                                    metadata.generators)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature < SAMPLING_EPS, greedy, sampled)
