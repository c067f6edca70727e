"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the sequence's
suffix (Saxena 2023, "prompt lookup decoding"; vLLM's "ngram" method). Host numpy; no model."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        """Up to ``k`` proposed next tokens for the sequence ``token_ids`` (prompt + outputs); [] when no
        suffix n-gram of length >= min_n occurs earlier."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = len(tokens)
        if k <= 0 or L <= self.min_n:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows that start at 0 .. L-n-1 (not the suffix itself); a match at s is followed by s + n ..
            windows = sliding_window_view(tokens[:L - 1], n)          # [L - n, n]
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
