"""A draft's q over part of the vocabulary: its probabilities on those columns only.

A draft with a restricted output layer (`draft_vocab`) samples from q = 0 off its ~33k of 152k ids. Its q
then crosses to the target as [K, C] values and their C ids, about a fifth of the bytes of [K, V] (over Ray,
the driver relays every sampled round's q: ~1.7 ms a hop for [8, 151936] float32, session 42), and the
target scatters them into the zeroed [K, V] rows it copied whole rows into before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SubsetQ:
    values: torch.Tensor  # [K, C] float32: q at the ids `cols`
    cols: torch.Tensor  # [C] int64 token ids, ascending
    vocab_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """The dense q's shape, [K, V]."""
        return (self.values.shape[0], self.vocab_size)

    def __getitem__(self, rows: slice) -> SubsetQ:
        """The q of draft positions `rows` (a cache hit's first tokens)."""
        if not isinstance(rows, slice):
            raise TypeError("a SubsetQ takes row slices only")
        return SubsetQ(self.values[rows], self.cols, self.vocab_size)

    def dense(self) -> torch.Tensor:
        """q as [K, V], zero off `cols`."""
        return self.values.new_zeros(self.shape).index_copy_(-1, self.cols, self.values)


QDraft = torch.Tensor | SubsetQ  # a draft's q: [K, V], or its columns
QRow = tuple[torch.Tensor, torch.Tensor | None]  # one position's q, [V] (ids None) or [C] at token ids [C]


def stack_q(rows: list[QRow], vocab_size: int) -> QDraft | None:
    """One draft's q from its positions' (row, cols): [V] rows (cols None) stack to [K, V]; [C] rows at token
    ids cols to a SubsetQ. A batch's columns include every row's own context ids, so a row's columns may change
    between its positions as other rows finish; such rows go onto the union of their columns."""
    if not rows:
        return None
    first = rows[0][1]
    if first is None:
        return torch.stack([r for r, _ in rows])  # [K, V]
    if all(c is first or torch.equal(c, first) for _, c in rows[1:]):
        return SubsetQ(torch.stack([r for r, _ in rows]), first, vocab_size)
    union = torch.unique(torch.cat([c for _, c in rows]))  # [C'] sorted
    values = rows[0][0].new_zeros(len(rows), union.numel())  # [K, C']
    for i, (r, c) in enumerate(rows):
        values[i].index_copy_(0, torch.searchsorted(union, c), r)
    return SubsetQ(values, union, vocab_size)


def write_q(out: torch.Tensor, q: QDraft) -> None:
    """Copy q ([K, V] or a SubsetQ) into out [K, V], which is zero where a SubsetQ has no column."""
    if isinstance(q, SubsetQ):
        out.index_copy_(-1, q.cols.to(out.device), q.values.to(out.device, out.dtype))
    else:
        out.copy_(q.to(out.device, out.dtype))


def dense_q(q: QDraft) -> torch.Tensor:
    return q.dense() if isinstance(q, SubsetQ) else q
