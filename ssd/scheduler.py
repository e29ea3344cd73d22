"""FIFO admission with a batch cap: a finished sequence frees its slot and the next waiting one joins."""

from __future__ import annotations

from collections import deque

from ssd.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into the running batch while there is room; return the newcomers."""
        joined = []
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            joined.append(seq)
        return joined

    def requeue(self, seqs: list[Sequence]) -> None:
        """Newcomers that could not be admitted go back to the front of the queue, in order."""
        for seq in reversed(seqs):
            self.running.remove(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    def retire(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        return done

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
