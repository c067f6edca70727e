"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the sequence's
suffix (Saxena 2023, "prompt lookup decoding"; vLLM's "ngram" method). Host numpy; no model.

Per lookup: one vectorised compare of the history with its last token (the candidates: earlier positions holding
it), then, over the candidates only, up to max_n - 1 gathers extending each match backwards; the history is kept
as a growing numpy array per request (``TokenHistory``), so a step converts only its new tokens. The earlier
version (a sliding-window compare over the whole history for every n, after converting the whole list) cost
~0.6 ms per lookup at 900 tokens on the CPU test machine; this one ~0.02 ms (``ngram_propose_ref`` keeps it as
the reference the tests compare against).

A step's lookups run batched (``propose_batch``): the requests' histories concatenated, one compare of the whole
with each request's last token, then the backward extension over all candidates at once, and a per-request max /
latest by ``np.maximum.at``. At batch 16 on the CPU test machine (W11-like copy-heavy prompts) the per-request
calls cost ~270 us a step, the batched one ~40 us (benchmarks/spec_host.py); same proposals (tests compare).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class TokenHistory:
    """A request's token ids (prompt + outputs) as a growing int64 numpy array: ``sync`` appends what the list
    gained since the last call (the scheduler's ``all_token_ids`` only ever grows)."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array of ``token_ids`` ([len] int64, a view valid until the next sync)."""
        L = len(token_ids)
        if L > len(self.buf):
            grown = np.empty(max(L, 2 * len(self.buf)), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if L > self.n:
            self.buf[self.n:L] = token_ids[self.n:L]
        self.n = L
        return self.buf[:L]


class NgramProposer:
    """Propose up to k tokens by matching the sequence's last n tokens earlier in the sequence.

    The longest n in [min_n, max_n] that occurs earlier wins; among its occurrences the latest (the most recent
    context, which is what extraction copies); the proposal is the up to k tokens that followed it.

    Args:
        min_n: prompt_lookup_min.
        max_n: prompt_lookup_max.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for the sequence ``token_ids`` (prompt + outputs; a list or an int64
        array); [] when no suffix n-gram of length >= min_n occurs earlier."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = len(tokens)
        if k <= 0 or L <= self.min_n:
            return []
        #  ... | c-2 | c-1 | c |  c+1 .. c+k  | ... | L-3 | L-2 | L-1 |
        #        a candidate c holds the last token; m[c] = how many tokens match backwards from c and L-1
        cands = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])          # [C] int64, ends of 1-gram matches
        if len(cands) == 0:
            return []
        m = np.ones(len(cands), dtype=np.int64)
        for j in range(1, min(self.max_n, L - 1)):
            alive = (m == j) & (cands >= j)
            if not alive.any():
                break
            idx = cands[alive] - j
            m[np.flatnonzero(alive)[tokens[idx] == tokens[L - 1 - j]]] += 1
        n = int(m.max())
        if n < self.min_n:
            return []
        start = int(cands[np.flatnonzero(m >= n)[-1]]) + 1
        return tokens[start:start + k].tolist()


    def propose_batch(self, histories: list[np.ndarray], ks: list[int]) -> list[list[int]]:
        """``propose`` for several sequences at once (the same answers, one batch of numpy ops).

        Args:
            histories: B sequences (prompt + outputs), each a 1-D int64 array (or a list of ints).
            ks: B proposal counts (each >= 0).

        Returns:
            B lists: up to ``ks[i]`` proposed next tokens of sequence i ([] when none).

        Raises:
            ValueError: ``histories`` and ``ks`` differ in length (``ks`` named).
        """
        B = len(histories)
        if len(ks) != B:
            raise ValueError(f"ks: {len(ks)} counts for {B} histories")
        if B == 1:   # one sequence: the single lookup (fewer ops)
            return [self.propose(histories[0], ks[0])]
        out: list[list[int]] = [[] for _ in range(B)]
        if B == 0:
            return out
        lens = np.fromiter(map(len, histories), dtype=np.int64, count=B)
        k_arr = np.asarray(ks, dtype=np.int64)
        use = np.flatnonzero((lens > self.min_n) & (k_arr > 0))
        if len(use) == 0:
            return out
        if len(use) == 1:   # one sequence: the single lookup (fewer ops)
            i = int(use[0])
            out[i] = self.propose(histories[i], int(k_arr[i]))
            return out
        lens, k_arr = lens[use], k_arr[use]
        flat = np.concatenate([np.asarray(histories[i], dtype=np.int64) for i in use.tolist()])   # [N] int64
        ends = np.cumsum(lens)                    # [U] one past each sequence's last token
        starts = ends - lens
        last_pos = ends - 1
        # candidates: positions c (not a sequence's last) holding their sequence's last token
        is_cand = flat == np.repeat(flat[last_pos], lens)
        is_cand[last_pos] = False
        cands = np.flatnonzero(is_cand)                                                     # [C] ascending
        if len(cands) == 0:
            return out
        seg = np.searchsorted(ends, cands, side="right")                                   # [C] its sequence
        m = np.ones(len(cands), dtype=np.int64)
        for j in range(1, self.max_n):
            alive = (m == j) & (cands - j >= starts[seg])
            if not alive.any():
                break
            a = np.flatnonzero(alive)
            m[a[flat[cands[a] - j] == flat[last_pos[seg[a]] - j]]] += 1
        best_n = np.zeros(len(use), dtype=np.int64)
        np.maximum.at(best_n, seg, m)             # per sequence: the longest match
        win = m >= np.maximum(best_n[seg], self.min_n)
        latest = np.full(len(use), -1, dtype=np.int64)
        np.maximum.at(latest, seg[win], cands[win])   # its latest occurrence
        for u in np.flatnonzero(latest >= 0).tolist():
            start = int(latest[u]) + 1
            stop = min(start + int(k_arr[u]), int(ends[u]))
            out[int(use[u])] = flat[start:stop].tolist()
        return out


def ngram_propose_ref(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The plain reference: for n from max_n down, a sliding-window compare over the whole history."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    L = len(tokens)
    if k <= 0 or L <= min_n:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:L - 1], n)          # [L - n, n], windows that start at 0 .. L-n-1
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
