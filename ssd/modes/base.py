"""What every decoding mode implements, and the round statistics they share."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ssd.handles import WorkerDied, WorkerFuture, WorkerHandle
from ssd.sequence import Sequence
from ssd.workers.messages import Draft, Outcome, SamplingSpec


def spec_of(seq: Sequence) -> SamplingSpec:
    """The sampling settings a worker needs for this request."""
    p = seq.params
    return SamplingSpec(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)


@dataclass
class RoundStats:
    rounds: int = 0  # batch rounds (target forwards)
    sequence_rounds: int = 0  # rounds of each sequence, summed: a batch round of B sequences counts B
    draft_s: float = 0.0  # time on the critical path waiting for drafts
    # SSD rounds' part of draft_s, the wait after the verification: "overrun" (the speculation still running),
    # "backup" (a miss's just-in-time neural draft), "other" (lookup, the resolve round trip, a fast backup).
    ssd_wait: Counter = field(default_factory=Counter)
    verify_s: float = 0.0  # time waiting for the target
    policy: Counter = field(default_factory=Counter)
    hits_per_k: Counter = field(default_factory=Counter)
    misses_per_k: Counter = field(default_factory=Counter)
    # SSD outcomes by what the verified speculation came from ("primary": a neural draft not made after a miss,
    # i.e. a cache hit's or a just-in-time one where nothing was prepared; "neural" / "fast": a miss's backup's)
    # and by the budget B the draft spent on the next round's candidates: (kind, hit) -> rounds
    by_source: Counter = field(default_factory=Counter)
    by_budget: Counter = field(default_factory=Counter)
    # The policy's verification prices against the measured times: |predicted - measured| / measured
    # summed over verifications, and their count (own cores / borrowed cores apart).
    price_error: Counter = field(default_factory=Counter)
    priced: Counter = field(default_factory=Counter)

    def observe_price(self, error: float, borrowed: bool) -> None:
        where = "borrowed" if borrowed else "own"
        self.price_error[where] += error
        self.priced[where] += 1


class Mode:
    name = "base"
    target_timeout_s: float | None = None  # a target call unanswered this long counts as a lost target

    def __init__(self, target: WorkerHandle, k: int = 4) -> None:
        self.target = target
        self.k = k
        self.stats = RoundStats()

    def target_result(self, fut: WorkerFuture) -> Any:
        """The result of a target call; WorkerDied if none comes within target_timeout_s (the engine then
        fails the running requests and replaces the target where it can)."""
        try:
            return fut.result(timeout=self.target_timeout_s)
        except TimeoutError as e:
            raise WorkerDied(self.target.name, TimeoutError(
                f"no answer within {self.target_timeout_s} s (target_timeout_s)")) from e

    def add(self, seq: Sequence) -> None:
        """Register a sequence with the draft side (the engine already added it to the target)."""

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence on the draft side."""

    def prefill_cut(self, n_prompt: int) -> int | None:
        """Where the target's prefill of an n_prompt-token prompt splits: the first piece on the target's
        own cores while the draft prefills, the rest on borrowed cores too. None: in one piece."""
        return None

    def observe_prefill(self, n_prompt: int, cut: int, draft_s: float, rest_s: float) -> None:
        """A split prefill: the draft took draft_s for the whole prompt, the target rest_s for the tokens
        after `cut` on borrowed cores."""

    def round(self, seqs: list[Sequence]) -> list[Outcome]:
        raise NotImplementedError

    def tokens_cut(self, seq: Sequence, n: int) -> None:
        """The last n of this round's tokens for `seq` fell after where it stopped (a stop string)."""

    def draft_len(self, seq: Sequence, k: int | None = None) -> int:
        """k (default: the mode's K) draft tokens, never past max_tokens: a round emits at most k + 1."""
        return max(0, min(self.k if k is None else k, seq.remaining - 1))

    def _verify(self, drafts: list[Draft], q_draft=None, borrow: bool = False) -> list[Outcome]:
        t0 = time.perf_counter()
        # borrow: the target computes on the draft's cores too (TargetWorker.verify); only asked when set.
        args = (drafts, q_draft, True) if borrow else (drafts, q_draft)
        outcomes = self.target_result(self.target.call("verify", *args))
        self.stats.verify_s += time.perf_counter() - t0
        return outcomes

    def _record(self, seqs: list[Sequence], drafts: list[Draft], outcomes: list[Outcome], policy: str) -> None:
        self.stats.rounds += 1
        self.stats.sequence_rounds += len(seqs)
        self.stats.policy[policy] += 1
        for seq, d, o in zip(seqs, drafts, outcomes):
            m = seq.metrics
            m.rounds += 1
            m.drafted_tokens += len(d.tokens)
            m.accepted_tokens += o.num_accepted
            m.policy[policy] = m.policy.get(policy, 0) + 1


class ARMode(Mode):
    """Plain decoding: up to `steps` tokens per sequence per round, in one call to the target worker
    (TargetWorker.decode), each sequence stopping at its stop ids or max_tokens."""

    name = "ar"

    def __init__(self, target: WorkerHandle, k: int = 4, steps: int = 1) -> None:
        super().__init__(target, k)
        self.steps = steps

    def round(self, seqs: list[Sequence]) -> list[Outcome]:
        drafts = [Draft(seq_id=s.seq_id) for s in seqs]
        if self.steps == 1:
            outcomes = self._verify(drafts)
        else:
            t0 = time.perf_counter()
            steps = [max(1, min(self.steps, s.remaining)) for s in seqs]
            stops = [sorted(s.stop_ids) for s in seqs]
            outcomes = self.target_result(self.target.call("decode", [s.seq_id for s in seqs], steps, stops))
            self.stats.verify_s += time.perf_counter() - t0
        self._record(seqs, drafts, outcomes, "ar")
        # Statistics count target forwards as rounds, as with one token per call (tau stays 1).
        extra = [len(o.tokens) - 1 for o in outcomes]
        self.stats.rounds += max(extra, default=0)
        self.stats.sequence_rounds += sum(extra)
        self.stats.policy["ar"] += max(extra, default=0)
        for seq, e in zip(seqs, extra):
            seq.metrics.rounds += e
            seq.metrics.policy["ar"] += e
        return outcomes

    def tokens_cut(self, seq: Sequence, n: int) -> None:
        # A decode call runs on past a stop string (the target has no tokenizer): those forwards were done, but
        # the request's rounds count as one token per call would have (tau 1), not the extra forwards.
        if self.steps > 1:
            seq.metrics.rounds -= n
            seq.metrics.policy["ar"] -= n
            self.stats.sequence_rounds -= n
