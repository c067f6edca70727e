"""SamplingMetadata: the per-step batch the Sampler reads, one row per request.

``build_sampling_metadata`` turns a list of ``SamplingParams`` (plus each request's prompt, outputs so far and
generator) into device tensors (the runner builds the same from its per-row arrays: ``InputBatch.sampling_metadata``), and precomputes host flags (``all_greedy``, ``no_penalties``, ...) so that the
sampler never has to look at a device tensor from the host to decide which path to take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Any

import numpy as np
import torch

from hayabusa.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """What the Sampler needs for one step of R requests. Optional tensors are None when no row uses the knob.

    Args:
        temperature: [R] fp32; rows with temperature < 1e-5 (SAMPLING_EPS) are greedy.
        all_greedy: host flag, every row is greedy (the random path is skipped).
        all_random: host flag, no row is greedy (the argmax path is skipped).
        top_p: [R] fp32 nucleus mass, 1.0 = off for that row.
        top_k: [R] int64, V = off for that row.
        min_p: [R] fp32, 0.0 = off for that row.
        generators: row -> per-request generator (seeded requests only; on the logits' device).
        max_num_logprobs: max over rows of SamplingParams.logprobs; None when no row wants logprobs.
        no_penalties: host flag, no row has a presence / frequency / repetition penalty.
        presence_penalties: [R] fp32, 0.0 = off.
        frequency_penalties: [R] fp32, 0.0 = off.
        repetition_penalties: [R] fp32, 1.0 = off.
        prompt_token_ids: [R, max_prompt_len] int64, padded with V (out of vocab, dropped by the penalties).
        output_token_ids: [R, max_out] int64, tokens generated so far per row (before this step), padded with V;
            None without penalties.
        min_tokens: row -> token ids masked to -inf because the row has fewer than min_tokens outputs.
        allowed_token_ids: None, or (rows [m] int64, cells [n] int64 (index into rows), ids [n] int64): every id of
            those rows but the listed ones is masked to -inf.
        bad_words: None, or (rows [n] int64, ids [n] int64, banned [n] bool): ``ids`` are masked to -inf in
            ``rows`` where ``banned`` (a bad word's last token whose other tokens end the output so far; the test
            of an output token not on the host yet is done on the device).
        logit_bias: None, or (rows [n] int64, ids [n] int64, biases [n] fp32): added to those logits.
    """

    temperature: torch.Tensor  # [R] fp32; rows with temperature < 1e-5 are greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [R] fp32, None when no row uses it
    top_k: torch.Tensor | None  # [R] int64 (V = off), None when unused
    min_p: torch.Tensor | None  # [R] fp32, None when unused
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded requests only)
    max_num_logprobs: int | None  # max over rows of SamplingParams.logprobs, None if no row wants them
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [R] fp32
    frequency_penalties: torch.Tensor | None  # [R] fp32
    repetition_penalties: torch.Tensor | None  # [R] fp32
    prompt_token_ids: torch.Tensor | None  # [R, max_prompt_len] int64, padded with V (out of vocab)
    output_token_ids: torch.Tensor | None  # [R, max_out] int64, outputs so far padded with V; None w/o penalties
    min_tokens: dict[int, set[int]]  # row -> token ids to mask (-inf): EOS + stop_token_ids before min_tokens
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, cells, ids)
    bad_words: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, banned)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, biases)


def to_device(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on ``device``: through pinned memory and a non-blocking copy on CUDA (no sync)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def pad_token_ids(token_ids: list[list[int]], pad: int) -> list[list[int]]:
    """Rows padded with ``pad`` to the longest row (at least one column, so scatter has a shape)."""
    width = max([len(t) for t in token_ids] + [1])
    return [list(t) + [pad] * (width - len(t)) for t in token_ids]


def _as_id_set(ids: int | Sequence[int] | None) -> set[int]:
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


def _min_tokens_mask(
    params: list[SamplingParams], output_token_ids: list[list[int]], eos_token_id: int | Sequence[int] | None, vocab_size: int
) -> dict[int, set[int]]:
    mask: dict[int, set[int]] = {}
    eos_ids = _as_id_set(eos_token_id)
    for row, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) >= p.min_tokens:
            continue
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids.update(eos_ids)
        # Ids past the logits' width cannot be sampled anyway (the input processor checks them against the vocab).
        ids = {t for t in ids if t < vocab_size}
        if ids:
            mask[row] = ids
    return mask


def bad_word_bans(words: list[list[int]], known: Sequence[int], num_output: int) -> list[tuple[int, int]]:
    """The tokens a row's bad words ban now (vLLM's rule: a word's last token when its other tokens are the last
    tokens of the output; a one-token word always).

    Args:
        words: the row's bad word token sequences (``SamplingParams.bad_words_token_ids``).
        known: the output tokens the host knows (the first ``len(known)`` of ``num_output``).
        num_output: output tokens so far; at most one more than ``len(known)`` (the last, sampled by the step in
            flight, read on the device).

    Returns:
        (banned id, need) pairs: need -1 = banned; else banned only if the pending last output token equals need.
    """
    k = len(known)
    assert num_output - k <= 1, "only the last output token may be unknown to the host"
    bans = []
    for w in words:
        m = len(w) - 1
        if m > num_output:
            continue
        start, need = num_output - m, -1
        for j in range(m):
            if start + j < k:
                if known[start + j] != w[j]:
                    break
            else:
                need = w[j]
        else:
            bans.append((w[-1], need))
    return bans


RowEditTensors = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def logit_edit_row_tensors(p: SamplingParams, device: torch.device | str) -> RowEditTensors:
    """One request's constant logit edits as tensors on ``device``, made once when the request gets its row (so a
    step does not rebuild lists that may hold up to a vocabulary of ids): (allowed ids [a] int64, logit_bias ids
    [b] int64, biases [b] fp32), None where the request has none."""
    allowed = None if p.allowed_token_ids is None else to_device(p.allowed_token_ids, torch.int64, device)
    ids = vals = None
    if p.logit_bias:
        ids = to_device(list(p.logit_bias), torch.int64, device)
        vals = to_device(list(p.logit_bias.values()), torch.float32, device)
    return allowed, ids, vals


def _cat_rows(parts: list[tuple[int, torch.Tensor]], device: torch.device | str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, tensor [n_i]) pairs -> (rows [m] int64, cells [sum n_i] int64 (index into rows), the tensors joined);
    lengths are host ints, so no device sync."""
    lens = [t.shape[0] for _, t in parts]
    rows = to_device([r for r, _ in parts], torch.int64, device)
    # made on the host (numpy's repeat: ~0.05 ms for 256k cells; torch's CPU repeat_interleave took ~8 ms)
    cells = torch.from_numpy(np.repeat(np.arange(len(parts), dtype=np.int64), lens))
    if torch.device(device).type != "cpu":
        cells = cells.pin_memory().to(device, non_blocking=True)
    return rows, cells, torch.cat([t for _, t in parts])


def logit_edit_tensors(params: list[SamplingParams], bans: list[list[tuple[int, int]]],
                       pending: torch.Tensor | None, device: torch.device | str,
                       row_tensors: list[RowEditTensors | None] | None = None
                       ) -> tuple[tuple | None, tuple | None, tuple | None]:
    """The SamplingMetadata fields ``allowed_token_ids``, ``bad_words`` and ``logit_bias`` of rows with these
    params (None where no row uses one).

    Args:
        params: one SamplingParams per row.
        bans: per row, ``bad_word_bans``'s answer ([] for rows without bad words).
        pending: [R] int64 on ``device``, each row's last output token when the host does not know it (read by
            bans with a need); None when no ban has one.
        device: the logits' device.
        row_tensors: per row, its ``logit_edit_row_tensors`` (None for a row without edits), made earlier: the
            allowed ids and biases are then joined on the device instead of built from the params' lists.
    """
    if row_tensors is None:
        row_tensors = [logit_edit_row_tensors(p, device) if p.has_logit_edits else None for p in params]
    a_parts = [(row, t[0]) for row, t in enumerate(row_tensors) if t is not None and t[0] is not None]
    l_parts = [(row, t) for row, t in enumerate(row_tensors) if t is not None and t[1] is not None]
    allowed = _cat_rows(a_parts, device) if a_parts else None
    bias = None
    if l_parts:
        rows, cells, ids = _cat_rows([(row, t[1]) for row, t in l_parts], device)
        bias = (rows[cells], ids, torch.cat([t[2] for _, t in l_parts]))
    b_rows, b_ids, b_need = [], [], []
    for row, row_bans in enumerate(bans):
        for tok, need in row_bans:
            b_rows.append(row)
            b_ids.append(tok)
            b_need.append(need)
    bad = None
    if b_rows:
        rows, ids, need = (to_device(x, torch.int64, device) for x in (b_rows, b_ids, b_need))
        if max(b_need) < 0:
            banned = torch.ones(len(b_rows), dtype=torch.bool, device=device)
        else:
            assert pending is not None, "a bad word's test needs the pending output tokens"
            banned = (need < 0) | (pending[rows] == need)
        bad = (rows, ids, banned)
    return allowed, bad, bias


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_id: int | Sequence[int] | None,
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Build the step's SamplingMetadata from per-request host state (plain Python; one H2D copy per tensor).

    Args:
        params: one SamplingParams per row (R rows).
        prompt_token_ids: each row's prompt token ids (used by the repetition penalty only).
        output_token_ids: each row's generated token ids before this step.
        generators: each row's generator (seeded requests) or None (the device's default generator is used).
        eos_token_id: the model's EOS id(s) (Llama 3 and Qwen2.5 have several), masked while a row has fewer than min_tokens outputs (unless ignore_eos).
        vocab_size: V, the width of the logits.
        device: where the tensors go (the logits' device).

    Returns:
        SamplingMetadata with R rows.
    """
    R = len(params)
    assert len(prompt_token_ids) == R and len(output_token_ids) == R and len(generators) == R
    temps = [p.temperature for p in params]
    num_greedy = sum(t < SAMPLING_EPS for t in temps)
    top_p = [p.top_p for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]  # 0 (or >= V) = off
    min_p = [p.min_p for p in params]
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    no_penalties = not any(p.has_penalties for p in params)
    wanted = [p.logprobs for p in params if p.logprobs is not None]

    def fp32(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device)

    allowed = bad = bias = None
    if any(p.has_logit_edits for p in params):
        bans = [bad_word_bans(p.bad_words_token_ids, out, len(out)) for p, out in zip(params, output_token_ids)]
        allowed, bad, bias = logit_edit_tensors(params, bans, None, device)

    return SamplingMetadata(
        temperature=fp32(temps),
        all_greedy=num_greedy == R,
        all_random=num_greedy == 0,
        top_p=fp32(top_p) if any(p < 1.0 for p in top_p) else None,
        top_k=to_device(top_k, torch.int64, device) if any(k < vocab_size for k in top_k) else None,
        min_p=fp32(min_p) if any(m > 0.0 for m in min_p) else None,
        generators={row: g for row, g in enumerate(generators) if g is not None},
        max_num_logprobs=max(wanted) if wanted else None,
        no_penalties=no_penalties,
        presence_penalties=None if no_penalties else fp32(presence),
        frequency_penalties=None if no_penalties else fp32(frequency),
        repetition_penalties=None if no_penalties else fp32(repetition),
        prompt_token_ids=None
        if no_penalties
        else to_device(pad_token_ids(prompt_token_ids, vocab_size), torch.int64, device),
        output_token_ids=None
        if no_penalties
        else to_device(pad_token_ids(output_token_ids, vocab_size), torch.int64, device),
        min_tokens=_min_tokens_mask(params, output_token_ids, eos_token_id, vocab_size),
        allowed_token_ids=allowed, bad_words=bad, logit_bias=bias,
    )
