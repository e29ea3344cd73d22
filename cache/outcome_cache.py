"""Outcome cache: for the round being verified, the draft's prepared next speculation per outcome.

Key (sequence, round, k, t*): k accepted draft tokens, then token t* from the target. The value is
the next round's K draft tokens, their q distributions (sampled rows) and where the branch's KV
sits in the draft's tree region, so a hit continues without recomputation. Only the current round
is held; hit/miss statistics are kept per k.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ssd.workers.subset_q import QDraft


@dataclass
class CacheEntry:
    tokens: list[int]  # y_1..y_K
    q: QDraft | None  # [K, V] (or its columns) the distributions y_j were sampled from (None: greedy)
    path: list[int]  # tree-region node indices to keep: x_1..x_k, t*, y_1..y_{K-1}
    tops: list | None = None  # ranked candidates: the top of the distribution each y_j was drafted from


class OutcomeCache:
    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, dict[tuple[int, int], CacheEntry]]] = {}
        self.hits: Counter = Counter()
        self.misses: Counter = Counter()

    def fill(self, seq_id: int, round_id: int, entries: dict[tuple[int, int], CacheEntry]) -> None:
        """Replace whatever the sequence held: only the current round is kept."""
        self._entries[seq_id] = (round_id, entries)

    def lookup(self, seq_id: int, round_id: int, k: int, t: int, min_len: int = 0) -> CacheEntry | None:
        """The entry for outcome (k, t), if one holds at least `min_len` draft tokens (a shorter one, drafted
        for a smaller K than the next round's, counts as a miss, as the coordinator counts it)."""
        held = self._entries.pop(seq_id, None)
        entry = None
        if held is not None and held[0] == round_id:
            entry = held[1].get((k, t))
        if entry is not None and len(entry.tokens) < min_len:
            entry = None
        (self.hits if entry is not None else self.misses)[k] += 1
        return entry

    def keys(self, seq_id: int) -> list[tuple[int, int]]:
        held = self._entries.get(seq_id)
        return list(held[1]) if held else []

    def drop(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)
