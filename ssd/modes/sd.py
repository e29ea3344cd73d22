"""Plain speculative decoding: a draft model (or the n-gram drafter) proposes, the target verifies."""

from __future__ import annotations

import time

from ssd.handles import WorkerHandle
from ssd.modes.base import Mode
from ssd.sequence import Sequence
from ssd.workers.messages import Draft, Outcome, SamplingSpec
from ssd.workers.ngram import ngram_propose


def spec_of(seq: Sequence) -> SamplingSpec:
    p = seq.params
    return SamplingSpec(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)


class SDMode(Mode):
    name = "sd"

    def __init__(self, target: WorkerHandle, draft: WorkerHandle, k: int = 4) -> None:
        super().__init__(target, k)
        self.draft = draft

    def add(self, seq: Sequence) -> None:
        self.draft.call("add", seq.seq_id, seq.prompt_ids, spec_of(seq)).result()

    def remove(self, seq: Sequence) -> None:
        self.draft.call("remove", seq.seq_id)

    def round(self, seqs: list[Sequence]) -> list[Outcome]:
        t0 = time.perf_counter()
        drafts, q = self.draft.call("propose", [(s.seq_id, self.draft_len(s)) for s in seqs]).result()
        self.stats.draft_s += time.perf_counter() - t0
        outcomes = self._verify(drafts, q)
        for o in outcomes:
            self.draft.call("commit", o.seq_id, o.tokens)  # ordered on the draft's queue; no wait
        self._record(seqs, drafts, outcomes, "sd")
        return outcomes


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
