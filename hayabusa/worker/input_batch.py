"""Persistent per-request state of the runner: one row per running request, kept in preallocated arrays.

A row holds the request's token ids (prompt, then every output the host knows), its block table and its sampling
settings. Rows are assigned when a request is first scheduled (or resumed after preemption) and released when it
leaves; a row's block table only grows, by the block ids the scheduler appends. The runner never sees a scheduler
``Request``: what it knows of a request came in a SchedulerOutput or was sampled by the runner itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hayabusa.sample.metadata import (RowEditTensors, SamplingMetadata, bad_word_bans, logit_edit_row_tensors,
                                      logit_edit_tensors)
from hayabusa.sampling_params import SAMPLING_EPS, SamplingParams

# argmax_from of a request whose token always needs the sampler.
NEVER_ARGMAX = np.iinfo(np.int64).max


@dataclass
class CachedRequestState:
    """What the runner keeps of a request from its first step until it finishes (preemption included).

    Attributes:
        req_id: the request id.
        prompt_token_ids: prompt ids.
        sampling_params: its params.
        generator: its seeded generator (None without a seed); kept across preemption so the draws go on.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None


def argmax_from(p: SamplingParams) -> int:
    """Output tokens from which a request's next token is a plain argmax of its logits: min_tokens when it is
    greedy with no logprobs, penalties, logit_bias, allowed_token_ids or bad_words, else never (NEVER_ARGMAX)."""
    if not p.greedy or p.logprobs is not None or p.has_penalties or p.has_logit_edits:
        return NEVER_ARGMAX
    return p.min_tokens


class InputBatch:
    """Rows of token ids, block tables and sampling settings, in preallocated numpy arrays (and, for the sampling
    settings, device tensors refreshed only when a row was added).

    Args:
        max_num_reqs: rows (max_num_seqs).
        max_model_len: token columns per row.
        max_blocks_per_req: block-table columns: cdiv(max_model_len, block_size).
        vocab_size: V (top_k off, and the padding id of token histories).
        eos_token_ids: the model's EOS ids (masked while a row has fewer than min_tokens outputs).
        device: where the sampling tensors live.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int,
                 eos_token_ids: list[int], device: torch.device) -> None:
        R = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.token_ids = np.zeros((R, max_model_len + 1), dtype=np.int32)  # [rows, L + 1] prompt, then outputs
        self.num_tokens = np.zeros(R, dtype=np.int64)                       # [rows] tokens the host knows
        self.num_prompt_tokens = np.zeros(R, dtype=np.int64)                # [rows]
        self.block_table = np.zeros((R, max_blocks_per_req), dtype=np.int32)  # [rows, max_blocks]
        self.num_blocks = np.zeros(R, dtype=np.int32)                          # [rows]
        # Bumped whenever a row is given to a request: a token sampled for the row's previous owner is not
        # written into it (see write_sampled).
        self.row_epoch = np.zeros(R, dtype=np.int64)                           # [rows]
        # Output tokens from which the row's next token is a plain argmax of its logits (greedy, no logprobs, no
        # penalties, min_tokens reached); NEVER_ARGMAX when it always needs the sampler.
        self.argmax_from = np.zeros(R, dtype=np.int64)                         # [rows]
        self.num_logprobs = np.full(R, -1, dtype=np.int64)                     # [rows] -1 = none
        self.min_tokens = np.zeros(R, dtype=np.int64)                          # [rows]
        self.has_penalties = np.zeros(R, dtype=bool)                           # [rows]
        # logit_bias / allowed_token_ids / bad_words (SamplingParams.has_logit_edits), and bad_words alone (their
        # test reads the output so far)
        self.has_logit_edits = np.zeros(R, dtype=bool)                         # [rows]
        self.has_bad_words = np.zeros(R, dtype=bool)                           # [rows]
        self.row_params: list[SamplingParams | None] = [None] * R             # read for the logit edits only
        # per row, its allowed ids / logit_bias on the device (logit_edit_row_tensors), made when the row is given
        self.row_edits: list[RowEditTensors | None] = [None] * R
        # Sampling settings per row: host copies (flags are computed from them) and device tensors.
        self.params_np = {"temperature": np.ones(R, dtype=np.float32), "top_p": np.ones(R, dtype=np.float32),
                          "top_k": np.full(R, vocab_size, dtype=np.int64), "min_p": np.zeros(R, dtype=np.float32),
                          "presence": np.zeros(R, dtype=np.float32), "frequency": np.zeros(R, dtype=np.float32),
                          "repetition": np.ones(R, dtype=np.float32)}
        self.params_dev = {k: torch.from_numpy(v).to(device) for k, v in self.params_np.items()}
        self.params_dirty = False
        self.min_tokens_ids: list[set[int]] = [set() for _ in range(R)]    # ids masked before min_tokens
        self.generators: dict[int, torch.Generator] = {}                   # row -> generator (seeded rows)
        self.req_ids: list[str | None] = [None] * R
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(R - 1, -1, -1))

    # ------------------------------------------------------------------ rows in and out
    def add(self, state: CachedRequestState, token_ids: list[int], block_ids: list[int]) -> int:
        """Give the request a row holding ``token_ids`` (prompt + known outputs) and ``block_ids``; returns it."""
        if state.req_id in self.row_of:  # a row it never gave up (a failed step skipped its preemption)
            self.remove(state.req_id)
        row = self._free_rows.pop()
        self.row_of[state.req_id] = row
        self.req_ids[row] = state.req_id
        self.row_epoch[row] += 1
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        nb = len(block_ids)
        self.block_table[row, :nb] = block_ids
        self.num_blocks[row] = nb
        p = state.sampling_params
        self.argmax_from[row] = argmax_from(p)
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.min_tokens[row] = p.min_tokens
        self.has_penalties[row] = p.has_penalties
        self.has_logit_edits[row] = p.has_logit_edits
        self.has_bad_words[row] = bool(p.bad_words_token_ids)
        self.row_params[row] = p
        self.row_edits[row] = logit_edit_row_tensors(p, self.device) if p.has_logit_edits else None
        self._set_params(row, p)
        if state.generator is not None:
            self.generators[row] = state.generator
        return row

    def _set_params(self, row: int, p: SamplingParams) -> None:
        V = self.vocab_size
        for name, value in (("temperature", p.temperature), ("top_p", p.top_p),
                            ("top_k", p.top_k if 0 < p.top_k < V else V), ("min_p", p.min_p),
                            ("presence", p.presence_penalty), ("frequency", p.frequency_penalty),
                            ("repetition", p.repetition_penalty)):
            self.params_np[name][row] = value
        ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        # Ids past the logits' width cannot be sampled anyway (the input processor checks them against the vocab).
        self.min_tokens_ids[row] = {t for t in ids if t < V}
        self.params_dirty = True

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        row = self.row_of[req_id]
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.num_blocks[row] = 0
        self.req_ids[row] = None
        self.row_params[row] = None
        self.row_edits[row] = None
        self.generators.pop(row, None)
        self._free_rows.append(row)

    # ------------------------------------------------------------------ tokens
    def write_sampled(self, rows: np.ndarray, epochs: np.ndarray, token_ids: np.ndarray) -> None:
        """Append each row's sampled token to its token ids, unless the row changed owner since the sample."""
        keep = self.row_epoch[rows] == epochs
        if not keep.all():
            rows, token_ids = rows[keep], token_ids[keep]
        pos = self.num_tokens[rows]
        self.token_ids[rows, pos] = token_ids
        self.num_tokens[rows] = pos + 1

    def write_sampled_runs(self, rows: np.ndarray, epochs: np.ndarray, runs: list[list[int]]) -> None:
        """Append several tokens per row (a verify step's emitted tokens), unless the row changed owner."""
        keep = self.row_epoch[rows] == epochs
        for row, ok, run in zip(rows.tolist(), keep.tolist(), runs):
            if ok and run:
                n = self.num_tokens[row]
                self.token_ids[row, n:n + len(run)] = run
                self.num_tokens[row] = n + len(run)

    def token_matrix(self, rows: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``start .. start + length`` of each row as [R, W] int64 padded with V (W = max length, >= 1),
        and a [R, W] mask of the cells inside ``length`` that the host does not know yet (placeholders)."""
        width = max(int(length.max()) if len(length) else 0, 1)
        col = np.arange(width)
        pos = start[:, None] + col                                    # [R, W]
        inside = col < length[:, None]
        known = pos < self.num_tokens[rows][:, None]
        vals = self.token_ids[rows[:, None], np.minimum(pos, self.token_ids.shape[1] - 1)]
        return np.where(inside & known, vals, self.vocab_size).astype(np.int64), inside & ~known

    # ------------------------------------------------------------------ sampling
    def is_plain_greedy(self, rows: np.ndarray, num_output: np.ndarray) -> bool:
        """Every row is greedy with nothing that needs the sampler (logprobs, penalties, pending min_tokens).

        Args:
            rows: [R_s] int64, the sampled rows.
            num_output: [R_s] int64, their output tokens before this step's sample (placeholders included).
        """
        argmax_from_ = self.argmax_from[rows]
        latest = int(argmax_from_.max()) if len(rows) else 0
        if latest == 0:
            return True
        if latest == NEVER_ARGMAX:
            return False
        return bool((num_output >= argmax_from_).all())

    def sampling_metadata(self, rows: np.ndarray, num_output: np.ndarray,
                          pending_tokens: torch.Tensor | None) -> SamplingMetadata:
        """The step's SamplingMetadata for the sampled rows, from the rows' arrays (no per-request objects).

        Args:
            rows: [R_s] int64, the sampled rows, in the order of the logits.
            num_output: [R_s] int64, each row's output tokens before this step's sample (placeholders included).
            pending_tokens: [R_s] int64 on the device, each row's last input token of this step (the value of an
                output token the host does not know yet, for the penalties' history and the bad words' test); None
                when no row needs it.
        """
        if self.params_dirty:
            for name, t in self.params_dev.items():
                t.copy_(torch.from_numpy(self.params_np[name]), non_blocking=True)
            self.params_dirty = False
        dev = self.device
        idx = torch.from_numpy(rows).to(dev, non_blocking=True)
        P = self.params_np
        greedy = P["temperature"][rows] < SAMPLING_EPS
        no_penalties = not self.has_penalties[rows].any()
        wanted = self.num_logprobs[rows]
        rows_list = rows.tolist()
        generators = {}
        if self.generators:
            generators = {i: self.generators[r] for i, r in enumerate(rows_list) if r in self.generators}
        min_tokens = {i: self.min_tokens_ids[rows_list[i]]
                      for i in np.flatnonzero(num_output < self.min_tokens[rows]).tolist()
                      if self.min_tokens_ids[rows_list[i]]}
        prompt_ids = output_ids = None
        if not no_penalties:
            prompt, _ = self.token_matrix(rows, np.zeros_like(rows), self.num_prompt_tokens[rows])
            out, pending = self.token_matrix(rows, self.num_prompt_tokens[rows], num_output)
            prompt_ids = torch.from_numpy(prompt).to(dev, non_blocking=True)
            output_ids = torch.from_numpy(out).to(dev, non_blocking=True)
            if pending.any():  # at most one per row: its last input token, sampled by the previous step
                r, c = np.nonzero(pending)
                assert pending_tokens is not None
                output_ids[torch.from_numpy(r).to(dev), torch.from_numpy(c).to(dev)] = \
                    pending_tokens[torch.from_numpy(r).to(dev)]

        allowed = bad = bias = None
        if self.has_logit_edits[rows].any():
            allowed, bad, bias = self._logit_edits(rows, num_output, pending_tokens)

        def col(name: str, used: bool) -> torch.Tensor | None:
            return self.params_dev[name][idx] if used else None

        V = self.vocab_size
        return SamplingMetadata(
            temperature=self.params_dev["temperature"][idx],
            all_greedy=bool(greedy.all()), all_random=not greedy.any(),
            top_p=col("top_p", bool((P["top_p"][rows] < 1.0).any())),
            top_k=col("top_k", bool((P["top_k"][rows] < V).any())),
            min_p=col("min_p", bool((P["min_p"][rows] > 0.0).any())),
            generators=generators,
            max_num_logprobs=int(wanted.max()) if (wanted >= 0).any() else None,
            no_penalties=bool(no_penalties),
            presence_penalties=col("presence", not no_penalties),
            frequency_penalties=col("frequency", not no_penalties),
            repetition_penalties=col("repetition", not no_penalties),
            prompt_token_ids=prompt_ids, output_token_ids=output_ids, min_tokens=min_tokens,
            allowed_token_ids=allowed, bad_words=bad, logit_bias=bias)

    def _logit_edits(self, rows: np.ndarray, num_output: np.ndarray, pending_tokens: torch.Tensor | None
                     ) -> tuple[tuple | None, tuple | None, tuple | None]:
        """SamplingMetadata's allowed_token_ids, bad_words and logit_bias of the sampled rows (their rows with
        none of them cost one flag each)."""
        params = [self.row_params[r] for r in rows.tolist()]
        bans: list[list[tuple[int, int]]] = [[] for _ in params]
        for i in np.flatnonzero(self.has_bad_words[rows]).tolist():
            r, start = int(rows[i]), int(self.num_prompt_tokens[rows[i]])
            words = params[i].bad_words_token_ids
            # only the outputs a word's prefix can reach (the longest word - 1), not the whole output: the step's
            # host work does not grow with the output; bad_word_bans sees the tail as the whole output
            end = min(int(self.num_tokens[r]), start + int(num_output[i]))
            lo = max(start, end - (max(map(len, words)) - 1))
            known = self.token_ids[r, lo:end].tolist()
            bans[i] = bad_word_bans(words, known, int(num_output[i]) - (lo - start))
        return logit_edit_tensors(params, bans, pending_tokens, self.device,
                                  [self.row_edits[r] for r in rows.tolist()])
