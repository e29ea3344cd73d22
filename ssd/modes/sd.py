"""Plain speculative decoding: a draft model (or the n-gram drafter) proposes, the target verifies."""

from __future__ import annotations

import time

from ssd.autoconfig import KTuner
from ssd.handles import WorkerDied, WorkerHandle
from ssd.modes.base import Mode, spec_of
from ssd.modes.recovery import DraftBackedMode
from ssd.sequence import Sequence
from ssd.workers.messages import Draft, Outcome
from ssd.workers.ngram import ngram_propose

__all__ = ["NgramMode", "SDMode", "spec_of"]


class SDMode(DraftBackedMode):
    """Draft proposes, target verifies (draft failures: see DraftBackedMode)."""

    name = "sd"

    def __init__(self, target: WorkerHandle, draft: WorkerHandle, k: int = 4, tuner: KTuner | None = None) -> None:
        super().__init__(target, draft, k)
        self.tuner = tuner  # when K was auto-configured: re-chosen every round from observed acceptance

    def round(self, seqs: list[Sequence]) -> list[Outcome]:
        if self.draft_down is not None and not self._draft_back():
            return self._ar_round(seqs)
        t0 = time.perf_counter()
        ids = [s.seq_id for s in seqs]
        stop = 0.0 if self.tuner is None else self.tuner.stop_below(self.k, ids)
        try:
            # q stays a future: over Ray it goes draft -> target without visiting the coordinator.
            f_drafts, f_q = self.draft.call_split("propose", 2, [(s.seq_id, self.draft_len(s)) for s in seqs],
                                                  None, False, stop)
            drafts = self.draft_result(f_drafts)
        except WorkerDied as e:
            self._draft_lost(e)
            return self._ar_round(seqs)
        t_draft = time.perf_counter() - t0
        self.stats.draft_s += t_draft
        if self.tuner is not None and len(seqs) == 1:
            self.tuner.observe_draft(len(drafts[0].tokens), t_draft)
        outcomes = self._verify(drafts, f_q)
        for o in outcomes:
            self.draft.call("commit", o.seq_id, o.tokens)  # ordered on the draft's queue; no wait
        self._record(seqs, drafts, outcomes, "sd")
        if self.tuner is not None:
            for s, d, o in zip(seqs, drafts, outcomes):
                self.tuner.observe(len(d.tokens), o.num_accepted, s.seq_id)
            self.tuner.observe_rate(sum(len(o.tokens) for o in outcomes), time.perf_counter() - t0)
            self.k = self.tuner.choose(ids)
        return outcomes

    def remove(self, seq: Sequence) -> None:
        if self.tuner is not None:
            self.tuner.forget(seq.seq_id)
        super().remove(seq)


class NgramMode(Mode):
    name = "ngram"

    def __init__(self, target: WorkerHandle, k: int = 4, max_n: int = 4) -> None:
        super().__init__(target, k)
        self.max_n = max_n

    def round(self, seqs: list[Sequence]) -> list[Outcome]:
        t0 = time.perf_counter()
        drafts = [
            Draft(
                seq_id=s.seq_id,
                tokens=ngram_propose(s.prompt_ids + s.output_ids, self.draft_len(s), self.max_n),
                q_kind="point",
            )
            for s in seqs
        ]
        self.stats.draft_s += time.perf_counter() - t0
        outcomes = self._verify(drafts)
        self._record(seqs, drafts, outcomes, "ngram")
        return outcomes
