"""The n-gram proposer (prompt lookup): drafts copied from earlier in the request's own text.

The last n tokens of the request (prompt + outputs) are looked up earlier in the same tokens;
the tokens that followed the match become the drafts. The longest n in
[prompt_lookup_min, prompt_lookup_max] that matches wins, and among its matches the most recent
one (text being edited or quoted tends to continue as it did last). Each request keeps a numpy
copy of its tokens that grows with its outputs, so a proposal costs one vectorised scan.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to k drafts per request; `forget(request_id)` drops a request's copy."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (fewer, or none, without a match)."""
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = self._sync(request_id, token_ids)
        return propose_ngram(tokens, k, self.min_n, self.max_n)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _sync(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        """The request's tokens as an int64 array, appending only what is new."""
        num = len(token_ids)
        buffer, filled = self._tokens.get(request_id, (np.empty(0, dtype=np.int64), 0))
        if filled > num:  # the request restarted (an id reused): start over
            filled = 0
        if buffer.shape[0] < num:
            grown = np.empty(max(num, 2 * buffer.shape[0], 256), dtype=np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        if num > filled:
            buffer[filled:num] = token_ids[filled:num]
        self._tokens[request_id] = (buffer, num)
        return buffer[:num]


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Drafts for `tokens` [L]: the tokens after the most recent earlier occurrence of its
    longest matching suffix of length in [min_n, max_n]; at most k, none without a match."""
    length = int(tokens.shape[0])
    if length <= min_n or k < 1:
        return []
    last = tokens[-1]
    # Candidate match ends j < L - 1: a match must leave at least one token after it.
    ends = np.flatnonzero(tokens[: length - 1] == last)
    if ends.size == 0:
        return []
    match_len = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.ones(ends.shape[0], dtype=bool)
    for offset in range(1, max_n):
        at = ends - offset
        ok = alive & (at >= 0)
        ok[ok] &= tokens[at[ok]] == tokens[length - 1 - offset]
        alive = ok
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return []
    # The most recent among the longest matches.
    end = int(ends[np.flatnonzero(match_len == best)[-1]])
    return tokens[end + 1 : end + 1 + k].tolist()
