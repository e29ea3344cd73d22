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
