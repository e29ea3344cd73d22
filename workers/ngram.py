"""Prompt-lookup (n-gram) drafter: training-free, no probabilities (verified as point masses)."""

from __future__ import annotations


def ngram_match(history: list[int], k: int, max_n: int = 4, min_n: int = 1) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram, and
    that n (0: no match). A longer match predicts better: the policy keeps an acceptance rate per n.

    Tries n = max_n down to min_n; the match must end before the suffix itself.
    """
    L = len(history)
    if k <= 0 or L < 2:
        return [], 0
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = history[L - n :]
        # Scan right to left: the latest occurrence best predicts local repetition.
        for start in range(L - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                follow = history[start + n : start + n + k]
                if follow:
                    return follow, n
    return [], 0


def ngram_propose(history: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The tokens of `ngram_match`."""
    return ngram_match(history, k, max_n, min_n)[0]


def ref_ngram_propose(history: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Obvious reference: enumerate all earlier occurrences, keep the longest n then the latest."""
    best: tuple[int, int] | None = None  # (n, start)
    L = len(history)
    for n in range(min_n, max_n + 1):
        if n >= L:
            break
        for start in range(0, L - n):
            if history[start : start + n] == history[L - n :] and start + n < L:
                if best is None or (n, start) > best:
                    best = (n, start)
    if best is None or k <= 0:
        return []
    n, start = best
    return history[start + n : start + n + k]


class NgramIndex:
    """`ngram_match` kept up to date as a history grows, for lookups every draft step: per n, each n-gram's
    latest occurrence (the position of the token that followed it). A lookup costs O(max_n) instead of a scan
    of the whole history (~1-2 ms of Python on a 1,000-token one).

    `match(history, tail, k)`: the longest suffix n-gram of history + tail that occurred in `history` with a
    follower, and up to k tokens that followed its latest occurrence there (occurrences inside `tail`, tokens
    drafted but not committed, are not indexed). With an empty tail this is `ngram_match(history, k, max_n)`.
    """

    def __init__(self, max_n: int = 4) -> None:
        self.max_n = max_n
        self._follower: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # history[:_indexed] has had its n-grams indexed

    def extend(self, history: list[int]) -> None:
        """Index the n-grams that gained a follower since the last call (history only ever grows)."""
        for end in range(max(self._indexed, 1), len(history)):  # the n-grams ending at end - 1, followed by end
            for n in range(1, min(self.max_n, end) + 1):
                self._follower[n][tuple(history[end - n : end])] = end
        self._indexed = max(self._indexed, len(history))

    def match(self, history: list[int], tail: list[int], k: int) -> tuple[list[int], int]:
        self.extend(history)
        if k <= 0:
            return [], 0
        seq_len = len(history) + len(tail)
        for n in range(min(self.max_n, seq_len - 1), 0, -1):
            gram = tuple((history[len(history) - (n - len(tail)):] + tail) if n > len(tail) else tail[len(tail) - n:])
            at = self._follower[n].get(gram)
            if at is not None:
                return history[at : at + k], n
        return [], 0
