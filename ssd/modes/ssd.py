"""Speculative speculative decoding (Saguaro), with the batch-size-aware policy.

Each round: the target verifies the current speculation while the draft, on its own device,
prepares the next round's speculation for every likely outcome (k, t*) in its outcome cache.
On a hit the next speculation is ready at once; on a miss a backup drafts (the neural draft
just in time, or a near-zero-latency n-gram / random drafter). Every speculation, cached or
not, goes through the same lossless verification.
"""

from __future__ import annotations

import random
import time

import torch

from ssd.autoconfig import SSDTuner
from ssd.fanout import FanoutPlanner
from ssd.handles import WorkerDied, WorkerFuture, WorkerHandle
from ssd.modes.recovery import DraftBackedMode
from ssd.policy import (
    CostModel,
    Ema,
    GatedSD,
    NgramPlan,
    acceptance_counts,
    best_sd_len,
    choose,
    gate_price,
    plan_ngram,
    round_seconds,
)
from ssd.sequence import Sequence
from ssd.workers.draft_worker import Resolution, SpecRequest
from ssd.workers.messages import Draft, Outcome
from ssd.workers.ngram import ngram_match


class DraftLost(Exception):
    """The draft died mid-round; carries the target's outcomes when verification completed."""

    def __init__(self, drafts: list[Draft] | None = None, outcomes: list[Outcome] | None = None) -> None:
        super().__init__("draft lost")
        self.drafts, self.outcomes = drafts, outcomes


EXPLORE_EVERY = 16  # rounds between re-measurements of a runner-up option
EXPLORE_WITHIN = 1.5  # only options scored within this factor of the best are re-measured
EXPLORE_SD_LAG = 4  # while borrowing, SD is re-measured only with at most this many tokens to feed the draft
NGRAM_K_MAX = 8  # longest n-gram draft: a long match is accepted nearly always, and a lookup costs nothing
SD_K_MAX = 8  # longest plain SD draft when K is auto-configured
PREFILL_SPLIT_MIN = 32  # shorter prompts prefill in one piece: a second call would cost more than it saves


class SSDMode(DraftBackedMode):
    name = "ssd"

    def __init__(
        self,
        target: WorkerHandle,
        draft: WorkerHandle,
        k: int,
        planner: FanoutPlanner,
        *,
        backup: str = "auto",
        allowed: tuple[str, ...] = ("ssd_neural", "ssd_fast"),
        vocab_size: int,
        ngram_max: int = 4,
        tuner: SSDTuner | None = None,
        borrow: bool = False,
        draft_borrow: bool = False,
        gate: bool = False,
    ) -> None:
        super().__init__(target, draft, k)
        # SD rounds' greedy drafts run up to SD_K_MAX and stop by the draft's confidence (DraftWorker._worth)
        self.gate = gate
        # The target may borrow the draft's cores (CPU, mode="auto"): in AR, SD and n-gram rounds the
        # draft has nothing to do, so those verifications run on both, and the draft's commits stay lazy.
        self.borrow = borrow
        # The other way round: just-in-time drafts (SD rounds, catch-ups, the neural backup after a
        # miss) run while the target waits for them, so the draft computes on the target's cores too.
        self.draft_borrow = draft_borrow
        self.planner = planner
        self.tuner = tuner  # when B (and K, unless the user's) was auto-configured: re-chosen every round
        self.backup = backup
        self.allowed = allowed
        self.vocab_size = vocab_size
        self.ngram_max = ngram_max
        self.cost = CostModel(gated_sd=GatedSD() if gate else None)
        if borrow:
            self.cost.enable_borrow()
        # seq_id -> (draft, q, source) of the speculation the target verifies next
        self.current: dict[int, tuple[Draft, torch.Tensor | None, str]] = {}
        self.fanout_used: dict[int, list[int]] = {}
        self._rng: dict[int, random.Random] = {}
        self.round_id = 0
        self.last_choice = ""
        self.last_scores: dict[str, float] = {}
        self._rounds_since_explore = 0
        self._last_tried: dict[str, int] = {}
        self._ngram_k = k  # this round's n-gram draft length (policy)
        self._sd_k = k  # this round's plain SD draft length (policy; K itself where the user fixed it)
        self._sd_drafted = 0  # the longest draft of this round's SD drafts (gated drafts stop short of _sd_k)
        self._lookups: dict[int, tuple[list[int], int]] = {}  # this round's lookups: seq_id -> (tokens, match)
        self._match: dict[int, int] = {}  # seq_id -> suffix length the current n-gram draft matched
        self._prepared = 1.0  # share of this round's sequences whose speculation was ready
        self._round_k = k  # K when this round's option was chosen (the tuner may change it during the round)
        self._round_lag = 0  # tokens the draft had not been fed when this round's option was chosen (the most)
        self._round_backlog = 0  # ... summed over the round's sequences
        self._verified = 0  # tokens this round's drafts put to verification (each draft + 1)
        self._missed = 0.0  # 1.0 when a sequence of this round's SSD batch missed
        self._lag: dict[int, int] = {}  # seq_id -> emitted tokens committed to the draft lazily, not yet fed
        self.prefill_ratio = Ema(0.0)  # draft / target (own cores) prefill time per prompt token
        # An all-hit round's resolve, sent without waiting, and the drafts the coordinator took for it
        self._pending: tuple[WorkerFuture, list[list[int]]] | None = None

    # -- sequences ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self._rng[seq.seq_id] = random.Random(seq.params.seed if seq.params.seed is not None else seq.seq_id)

    def remove(self, seq: Sequence) -> None:
        self.current.pop(seq.seq_id, None)
        self.fanout_used.pop(seq.seq_id, None)
        self._match.pop(seq.seq_id, None)
        self._lag.pop(seq.seq_id, None)
        self._rng.pop(seq.seq_id, None)
        self.planner.forget(seq.seq_id)
        if self.tuner is not None:
            self.tuner.forget(seq.seq_id)
        super().remove(seq)

    def prefill_cut(self, n_prompt: int) -> int | None:
        """While borrowing: the target prefills on its own core as many tokens as it can while the draft
        prefills the whole prompt on its own, then the rest on both. The draft / target cost per prompt
        token comes from split prefills seen so far, before the first from the per-token costs of
        decoding (feed / v1, once start-up measured them; they put the draft at ~0.2 of the target where
        prefills measure ~0.35)."""
        if not self.borrow or self.draft_down is not None or n_prompt < PREFILL_SPLIT_MIN:
            return None
        if self.prefill_ratio.n:
            ratio = self.prefill_ratio.value
        elif self.cost.feed.n and self.cost.verify.v1.n and self.cost.verify.v1.value > 0:
            ratio = self.cost.feed.value / self.cost.verify.v1.value
        else:
            return None
        return min(max(round(n_prompt * ratio), 1), n_prompt - 1)

    def observe_prefill(self, n_prompt: int, cut: int, draft_s: float, rest_s: float) -> None:
        if self.draft_down is not None or rest_s <= 0 or draft_s <= 0 or n_prompt <= cut:
            return
        rest = n_prompt - cut
        own_per_token = rest_s / rest / self.cost.borrow_factor(rest)  # borrowed -> own-core time
        self.prefill_ratio.update(draft_s / n_prompt / own_per_token)

    # -- policy ------------------------------------------------------------------------------
    def _choose(self, seqs: list[Sequence]) -> str:
        if len(self.allowed) == 1:
            choice, self.last_scores = self.allowed[0], {}
        else:
            ngram = self._ngram_plan(seqs) if "ngram" in self.allowed else None
            prepared = sum(s.seq_id in self.current for s in seqs) / len(seqs)
            self._prepared = prepared
            lagging = max(seqs, key=lambda s: self._lag.get(s.seq_id, 0))
            lag = self._lag.get(lagging.seq_id, 0)
            # the draft's first forward feeds every sequence's backlog: priced by their total
            self._round_backlog = sum(self._lag.get(s.seq_id, 0) for s in seqs)
            self._round_k, self._round_lag = self.k, lag
            self._sd_k = self.k
            if self.tuner is not None and self.tuner.chooses_k and "sd" in self.allowed:
                self._sd_k = best_sd_len(self.cost, self.cost.acceptance.value, len(seqs), SD_K_MAX)
            choice, self.last_scores = choose(self.cost, len(seqs), self.k, self.allowed, ngram, prepared=prepared,
                                              current=self.last_choice or None, lag=self._round_backlog,
                                              k_sd=self._sd_k, horizon=lagging.remaining if lag else None,
                                              unfed=bool(self.borrow))
            # Estimates of options never chosen go stale: now and then re-measure a close runner-up (from a
            # ready SSD pipeline only the other SSD option, which keeps the prepared speculation).
            # A new request's try of a stale SD comes first; then the periodic re-measurement when due, ahead of
            # SD's own (due as often): SD's had taken every due round, and the other options were never re-measured.
            self._rounds_since_explore += 1
            if any(not s.output_ids for s in seqs) and self._sd_stale(choice, prepared, fresh=True):
                choice = "sd"
            elif self._rounds_since_explore >= EXPLORE_EVERY:
                close = [o for o in self.allowed
                         if o != choice and self.last_scores[o] <= EXPLORE_WITHIN * self.last_scores[choice]
                         and self._explorable(o, choice, prepared)]
                if close:
                    choice = min(close, key=lambda o: self._last_tried.get(o, -1))
                self._rounds_since_explore = 0
            elif self._sd_stale(choice, prepared):
                choice = "sd"
            self._last_tried[choice] = self.stats.rounds
        self.last_choice = choice
        return choice

    def _sd_stale(self, choice: str, prepared: float, fresh: bool = False) -> bool:
        """Whether to re-measure SD now: it has not run for EXPLORE_EVERY rounds, scores within EXPLORE_WITHIN
        of `choice` or `fresh` (a request's first round), and can be tried now. While borrowing, the periodic
        re-measurement rarely found SD triable: AR and n-gram rounds grow the draft's backlog past
        EXPLORE_SD_LAG within a few rounds of each request's start, so after one poor prose stretch SD's
        acceptance and gated length stayed stale for the rest of the run (MT-Bench, session 41: SD priced
        43 ms a token on later prompts, measured 23 once tried; `auto` 0.83-0.92x SD mode). A request's first
        rounds are such a window. A new request tries a stale SD whatever its price, since its text may suit
        the draft where the last one did not (session 42: at requests' first rounds SD often scored 1.35-1.45x
        the choice, and in one MT-Bench run, once past 1.5x, SD never ran again after the second prompt:
        `auto` 0.76x SD mode); one round per request is the most that costs."""
        if "sd" not in self.allowed or choice == "sd" or not self._explorable("sd", choice, prepared):
            return False
        if self.stats.rounds - self._last_tried.get("sd", -1) < EXPLORE_EVERY:
            return False
        return fresh or self.last_scores["sd"] <= EXPLORE_WITHIN * self.last_scores[choice]

    def _explorable(self, option: str, choice: str, prepared: float) -> bool:
        """Whether a re-measurement may try `option` this round instead of `choice`."""
        if choice.startswith("ssd") and prepared >= 1.0:
            return option.startswith("ssd")
        # While the target borrows the draft's cores the draft is fed nothing, so its first SD or SSD round
        # catches up on every token since: a try cost 200-290 ms on the real pair against ~55 ms of AR.
        # Such switches happen only when the policy itself prices them as cheaper, except SD with (almost)
        # nothing to catch up on: its price rests on the gated rounds' tokens, and after a poor start
        # (the first rounds of a prose answer) no SD round ran again to correct it (MT-Bench, session 40:
        # SD priced ~38 ms a token, `auto` 0.8x SD mode).
        if self.borrow and option == "sd":
            return self._round_lag <= EXPLORE_SD_LAG
        return not (self.borrow and option not in ("ar", "ngram"))

    def _calibrate(self, seqs: list[Sequence], seconds: float) -> None:
        """Feed the round's measured time to the policy's calibration. Left out: a switch into SSD and an
        SSD round that fed the draft a backlog (both priced apart). An SD round that fed one counts with
        the backlog's modelled feed taken off: after AR / n-gram rounds on borrowed cores nearly every SD
        round feeds one, and skipping them left SD's calibration at its prior while its model ran ~12 %
        above its measured rounds (session 18)."""
        choice = self.last_choice
        if choice not in self.last_scores or (choice.startswith("ssd") and self._prepared < 1.0):
            return
        if choice == "sd" and self._prepared >= 1.0:  # it verified prepared drafts: no draft call to price
            return
        if self._round_lag and choice == "sd":
            seconds -= self.cost.backlog_time(self._round_backlog, lent=True)
            if seconds <= 0:
                return
        elif self._round_lag and choice not in ("ar", "ngram"):
            return
        k = (self._sd_drafted if self.gate else self._sd_k) if choice == "sd" else self._round_k
        predicted = round_seconds(self.cost, choice, len(seqs), k, self._ngram_k, missed=self._missed,
                                  verified=self._verified if choice in ("sd", "ngram") else None)
        self.cost.observe_round(choice, predicted, seconds)

    def _ngram_plan(self, seqs: list[Sequence]) -> NgramPlan:
        """This round's n-gram drafts, priced per sequence from each lookup's length and match length."""
        self._lookups = {s.seq_id: ngram_match(s.prompt_ids + s.output_ids, NGRAM_K_MAX, self.ngram_max) for s in seqs}
        looks = []  # (tokens it drafts, acceptance) per sequence
        for s in seqs:
            tokens, match = self._lookups[s.seq_id]
            looks.append((min(len(tokens), max(0, s.remaining - 1)), self.cost.ngram_acceptance(match)))
        plan = plan_ngram(self.cost, looks, NGRAM_K_MAX)
        self._ngram_k = plan.k
        return plan

    def _fast_backup(self, seq: Sequence, emitted: list[int], k: int) -> Draft:
        if self.backup == "random":
            rng = self._rng[seq.seq_id]
            tokens = [rng.randrange(self.vocab_size) for _ in range(k)]
            self._match.pop(seq.seq_id, None)
        else:
            tokens, self._match[seq.seq_id] = ngram_match(seq.prompt_ids + seq.output_ids + emitted, k, self.ngram_max)
        return Draft(seq_id=seq.seq_id, tokens=tokens, q_kind="point")

    # -- one round ---------------------------------------------------------------------------
    def round(self, seqs: list[Sequence]) -> list[Outcome]:
        if self.draft_down is not None and not self._draft_back():
            self.current.clear()
            return self._ar_round(seqs)  # exact without a draft; the restart runs meanwhile
        try:
            t0 = time.perf_counter()
            outcomes = self._round(seqs)
            self._calibrate(seqs, time.perf_counter() - t0)
            return outcomes
        except DraftLost as lost:
            self.current.clear()
            if lost.outcomes is not None:  # the target verified this round; only the draft side failed
                self._record(seqs, lost.drafts, lost.outcomes, self.last_choice)
                return lost.outcomes
            return self._ar_round(seqs)

    def _round(self, seqs: list[Sequence]) -> list[Outcome]:
        choice = self._choose(seqs)
        if choice == "ar":
            return self._plain_round(seqs)
        if choice == "ngram":  # the policy's lookups (up to NGRAM_K_MAX tokens) replace any prepared speculation
            for s in seqs:
                tokens, self._match[s.seq_id] = self._lookups[s.seq_id]
                draft = Draft(seq_id=s.seq_id, tokens=tokens[: max(0, min(self._ngram_k, s.remaining - 1))],
                              q_kind="point")
                self.current[s.seq_id] = (draft, None, "backup")
        missing = [s for s in seqs if s.seq_id not in self.current]
        gated_round = False
        if missing and choice == "ssd_fast":  # no prepared speculation: the fast backup drafts
            for s in missing:
                self.current[s.seq_id] = (self._fast_backup(s, [], self.draft_len(s)), None, "backup")
        elif missing:  # just-in-time neural drafts (first round, or after an SD / AR round)
            t0 = time.perf_counter()
            # Saguaro sampling only where an outcome cache follows: an SD round's draft is verified and done.
            fo = None if choice == "sd" else [self.planner.plan(s.seq_id, "primary") for s in missing]
            k = self._sd_k if choice == "sd" else None
            stop = 0.0
            if choice == "sd" and self.gate:
                k, stop = SD_K_MAX, self._gate_price(len(seqs))
                gated_round = len(missing) == len(seqs)  # no prepared (ungated) draft among them
            drafts, qs = self._draft_call("propose", [(s.seq_id, self.draft_len(s, k)) for s in missing], fo,
                                          self.draft_borrow, stop)
            self._sd_drafted = max(len(d.tokens) for d in drafts)
            dt = time.perf_counter() - t0
            self.stats.draft_s += dt
            if not self._round_lag:  # a backlog fed first is priced apart (choose's `lag`)
                self.cost.observe_draft(max(len(d.tokens) for d in drafts), dt)
            for s, d, q in zip(missing, drafts, qs):
                self.current[s.seq_id] = (d, q, "primary")
        drafts = [self.current[s.seq_id][0] for s in seqs]
        self._verified = sum(len(d.tokens) + 1 for d in drafts)
        q_draft = [self.current[s.seq_id][1] for s in seqs]
        sources = [self.current[s.seq_id][2] for s in seqs]
        # The suffix length each point draft matched, read now: the round's fast backups overwrite _match
        # with the next drafts' lookups before this round's acceptance is recorded.
        matches = [self._match.get(s.seq_id) if d.q_kind == "point" else None for s, d in zip(seqs, drafts)]
        if choice == "sd" or (choice == "ngram" and not self._speculate_on_ngram(drafts)):
            outcomes = self._timed_verify(drafts, q_draft, borrow=self.borrow)
            for o in outcomes:
                self._commit(o, feed_ahead=choice == "ngram" and not self.borrow, idle=choice == "ngram")
            self.current.clear()
        else:
            outcomes = self._ssd_round(seqs, drafts, q_draft, sources, neural=choice == "ssd_neural")
        if gated_round and self.cost.gated_sd is not None:  # before the round moves the acceptance
            self.cost.gated_sd.observe(self.cost.acceptance.value, [len(d.tokens) for d in drafts],
                                       [len(o.tokens) for o in outcomes])
        for s, d, o, src, match in zip(seqs, drafts, outcomes, sources, matches):
            self.planner.observe_round(s.seq_id, src, len(d.tokens), o.num_accepted)
            if d.tokens:
                if match is not None:
                    self.cost.observe_ngram(match, len(d.tokens), o.num_accepted)
                else:
                    rate = self.cost.acceptance if d.q_kind != "point" else self.cost.fast_acceptance
                    rate.update(*acceptance_counts(len(d.tokens), o.num_accepted))
                if self.tuner is not None and d.q_kind != "point":  # the neural draft's acceptance
                    self.tuner.observe(len(d.tokens), o.num_accepted, s.seq_id)
        if self.tuner is not None:
            # Drafts already prepared keep their length; requests from now on use the new K and B.
            self.k, self.planner.B = self.tuner.choose([s.seq_id for s in seqs])
            self.planner.K = self.k
        self._shadow_ngram(seqs, drafts, outcomes)
        self._record(seqs, drafts, outcomes, choice)
        return outcomes

    def _gate_price(self, batch: int) -> float:
        """A gated SD draft's price of one more forward, in expected accepted tokens of one sequence (see
        KTuner.stop_below): its share of a draft step and its token's verification row, at the rate of the
        option the policy found cheapest this round."""
        per_token = min((v for o, v in self.last_scores.items() if o in self.allowed), default=0.0)
        if per_token <= 0:
            return 0.0
        n = batch * (SD_K_MAX + 1)
        row = max(0.0, self.cost.lent_verify_time(n + batch) - self.cost.lent_verify_time(n)) / batch
        return gate_price(1.0 / per_token, self.cost.draft_step.value, row, batch)

    def _speculate_on_ngram(self, drafts: list[Draft]) -> bool:
        """n-gram rounds let the draft speculate on the n-gram drafts (a hit has the next neural draft
        ready) when that fits inside their verification; otherwise they are plain n-gram SD. Only drafts
        of at most K tokens: the draft's glue grows with the draft, and speculating on an 8-token n-gram
        draft took over a second on the real pair (one core each). Not while the target can borrow the
        draft's cores: plain n-gram rounds run on both."""
        if self.borrow or any(len(d.tokens) > self.k for d in drafts):
            return False
        return self.cost.speculate_time(len(drafts)) <= self.cost.verify_time(sum(len(d.tokens) + 1 for d in drafts))

    def _shadow_ngram(self, seqs: list[Sequence], drafts: list[Draft], outcomes: list[Outcome]) -> None:
        """Score the n-gram drafter on rounds it did not draft, so the policy knows its acceptance.

        Under lossless verification the emitted token is distributed as the target's p, so it equals
        the n-gram guess with probability p(guess): exactly the point-mass acceptance probability.
        `seqs` still hold the context from before this round (the engine appends outcomes later).
        """
        if self.backup == "random":
            return
        for s, d, o in zip(seqs, drafts, outcomes):
            if d.q_kind == "point" and d.tokens:  # the n-gram drafter drafted this round: already counted
                continue
            guess, match = ngram_match(s.prompt_ids + s.output_ids, len(o.tokens), self.ngram_max)
            n = min(len(guess), len(o.tokens))
            m = next((i for i in range(n) if guess[i] != o.tokens[i]), n)
            self.cost.observe_ngram(match, n, m)

    def _timed_verify(self, drafts: list[Draft], q_draft: list, borrow: bool = False) -> list[Outcome]:
        t0 = time.perf_counter()
        outcomes = self._verify(drafts, q_draft, borrow)
        self._observe_verify(drafts, time.perf_counter() - t0, borrow)
        return outcomes

    def _observe_verify(self, drafts: list[Draft], seconds: float, borrow: bool = False) -> None:
        """A verification of `drafts` took `seconds`: refine its price and record how far off it was."""
        error = self.cost.observe_verify(sum(len(d.tokens) + 1 for d in drafts), seconds, borrow)
        self.stats.observe_price(error, borrow)

    def _commit(self, o: Outcome, feed_ahead: bool, idle: bool) -> None:
        """Tell the draft the emitted tokens. `idle`: no draft forward follows in this round's mode (AR,
        n-gram), so tokens committed lazily pile up until SD or SSD feeds them (the policy prices that)."""
        self.draft.call("commit", o.seq_id, o.tokens, feed_ahead)
        if idle and not feed_ahead:
            self._lag[o.seq_id] = self._lag.get(o.seq_id, 0) + len(o.tokens)
        else:
            self._lag.pop(o.seq_id, None)

    def _draft_call(self, method: str, *args):
        try:
            result = self.draft_result(self.draft.call(method, *args))
            self._settle_resolve()  # ran before this call on the draft's queue
            return result
        except WorkerDied as e:
            self._draft_lost(e)
            raise DraftLost() from e

    def _draft_lost(self, err: WorkerDied) -> None:
        self._pending = None
        super()._draft_lost(err)

    @staticmethod
    def _shipped_hits(resolve_in: list[tuple[int, int, list[int], int, int]], shipped: list | None
                      ) -> list[list[int]] | None:
        """The next drafts of a round in which every sequence hit, found in the drafts speculate shipped
        (the hit rule of DraftWorker.resolve); None if any sequence missed or shipped none (sampled)."""
        if shipped is None:
            return None
        table = {(sid, k, t): y for sid, k, t, y in shipped}
        nexts = []
        for sid, k, emitted, k_next, k_max in resolve_in:
            y = table.get((sid, k, emitted[-1]))
            if y is None or len(y) < k_next:
                return None
            nexts.append(y[:k_max])
        return nexts

    def _settle_resolve(self) -> None:
        """Check an all-hit round's resolve, sent without waiting: the draft must have taken the drafts the
        coordinator took (a draft that disagrees is lost, as one that died). WorkerDied propagates."""
        if self._pending is None:
            return
        fut, want = self._pending
        self._pending = None
        got = [(r.hit, r.draft.tokens if r.draft is not None else None) for r in self.draft_result(fut)]
        if got != [(True, y) for y in want]:
            raise WorkerDied(self.draft.name, RuntimeError(
                f"the draft's outcome cache disagrees with the drafts it shipped: {got} != {want}"))

    def _plain_round(self, seqs: list[Sequence]) -> list[Outcome]:
        """The policy chose AR: no drafts; the draft just learns the emitted tokens."""
        drafts = [Draft(seq_id=s.seq_id) for s in seqs]
        outcomes = self._timed_verify(drafts, [None] * len(seqs), borrow=self.borrow)
        for o in outcomes:  # feed-ahead meanwhile on the draft's own device, unless the target borrows it
            self._commit(o, feed_ahead=not self.borrow, idle=True)
        self.current.clear()
        self._shadow_ngram(seqs, drafts, outcomes)
        self._record(seqs, drafts, outcomes, "ar")
        return outcomes

    def _ssd_round(
        self, seqs: list[Sequence], drafts: list[Draft], q_draft: list, sources: list[str], neural: bool
    ) -> list[Outcome]:
        self.round_id += 1
        requests = []
        for s, d, src in zip(seqs, drafts, sources):
            # With the tuner, K may have changed since d was drafted, and a lookahead-extended draft is longer
            # than K: plan for d's own length.
            own = self.tuner is not None or len(d.tokens) > self.k
            fanout = self.planner.plan(s.seq_id, src, k=len(d.tokens) if own else None)
            self.fanout_used[s.seq_id] = fanout
            requests.append(
                SpecRequest(
                    seq_id=s.seq_id, round_id=self.round_id, tokens=d.tokens, fanout=fanout[: len(d.tokens) + 1],
                    next_fanout=self.planner.plan(s.seq_id, "primary"), k_next=self.k,
                )
            )
        t0 = time.perf_counter()
        fut_v = self.target.call("verify", drafts, q_draft)
        fut_s = self.draft.call("speculate", requests)  # runs on the draft's device meanwhile (feeds any lag)
        for s in seqs:
            self._lag.pop(s.seq_id, None)
        outcomes = self.target_result(fut_v)  # a target failure propagates: it fails the batch with its error
        t_verify = time.perf_counter() - t0
        self.stats.verify_s += t_verify
        self._observe_verify(drafts, t_verify)
        t1 = time.perf_counter()
        try:
            info = self.draft_result(fut_s)
            self._settle_resolve()  # last round's, ahead of this speculation on the draft's queue
        except WorkerDied as e:
            self._draft_lost(e)
            raise DraftLost(drafts, outcomes) from e
        self.cost.observe_speculate(len(seqs), info["seconds"])
        resolve_in = []
        for s, o in zip(seqs, outcomes):
            k_max = max(0, s.remaining - len(o.tokens) - 1)  # a lookahead-extended draft may use up to this
            if any(t in s.stop_ids for t in o.tokens):  # the request ends with this round: no next draft
                k_max = 0
            if self.planner.explicit is not None:  # F_0..F_K as given: no candidates for longer drafts
                k_max = min(k_max, len(self.planner.explicit) - 1)
            resolve_in.append((s.seq_id, o.num_accepted, o.tokens, min(self.k, k_max), k_max))
        fo = [self.planner.plan(s.seq_id, "primary") for s in seqs]
        # The target has verified: a neural backup's just-in-time draft may use its cores too.
        resolve_args = (resolve_in, neural, fo, neural and self.draft_borrow)
        shipped = self._shipped_hits(resolve_in, info.get("drafts"))
        if shipped is not None:
            # Every sequence hit a draft speculate shipped: the next round starts now, and the draft commits
            # the hits (resolve) ahead of its next call, without a round trip on the critical path.
            self._pending = (self.draft.call("resolve", *resolve_args), shipped)
            resolutions = [Resolution(s.seq_id, True, Draft(seq_id=s.seq_id, tokens=y, q_kind="none"), None)
                           for s, y in zip(seqs, shipped)]
        else:
            try:
                resolutions = self.draft_result(self.draft.call("resolve", *resolve_args))
            except WorkerDied as e:
                self._draft_lost(e)
                raise DraftLost(drafts, outcomes) from e
        t_wait = time.perf_counter() - t1
        self.stats.draft_s += t_wait  # speculation overrun + lookup + backup
        overrun = min(t_wait, max(0.0, info["seconds"] - t_verify))
        backup = any(not r.hit and r.draft is not None for r in resolutions)  # the neural backup drafted
        self.stats.ssd_wait["overrun"] += overrun
        self.stats.ssd_wait["backup" if backup else "other"] += t_wait - overrun
        if self.tuner is not None and len(seqs) == 1 and len(drafts[0].tokens) == requests[0].k_next:
            self.tuner.observe_round_times(requests[0].k_next, sum(requests[0].fanout), t_verify, info["seconds"],
                                           t_wait, jit_draft=backup)
        hits = 0
        ranked = {sid: f for sid, f in info.get("fanout") or []}  # rows that ranked candidates: counts per k
        for s, d, src, o, r, req, (_, _, _, k_next, _) in zip(seqs, drafts, sources, outcomes, resolutions, requests,
                                                             resolve_in):
            if s.seq_id in ranked:  # the quotas' power law does not describe ranked candidates
                self.fanout_used[s.seq_id] = ranked[s.seq_id]
                if self.tuner is not None and self.tuner.ranked is not None:
                    self.tuner.ranked.observe(sum(req.fanout), r.hit, s.seq_id)
            else:
                fanout = self.fanout_used[s.seq_id]
                self.planner.observe_hit(fanout[o.num_accepted] if o.num_accepted < len(fanout) else 0, r.hit)
            kind = "primary" if src == "primary" else "fast" if d.q_kind == "point" else "neural"
            self.cost.observe_hit(kind, o.num_accepted == len(d.tokens), r.hit)
            (self.stats.hits_per_k if r.hit else self.stats.misses_per_k)[o.num_accepted] += 1
            self.stats.by_source[kind, r.hit] += 1
            self.stats.by_budget[sum(req.fanout), r.hit] += 1
            m = s.metrics
            if r.hit:
                hits += 1
                m.cache_hits += 1
                self.current[s.seq_id] = (r.draft, r.q, "primary")
            else:
                m.cache_misses += 1
                if r.draft is not None:
                    self.current[s.seq_id] = (r.draft, r.q, "backup")
                else:
                    self.current[s.seq_id] = (self._fast_backup(s, o.tokens, k_next), None, "backup")
        self._missed = float(hits < len(seqs))
        return outcomes


def policy_options(mode: str, backup: str) -> tuple[str, ...]:
    """Which options the per-round policy may pick: mode="auto" also considers SD and AR."""
    ssd_opts = {"auto": ("ssd_neural", "ssd_fast"), "neural": ("ssd_neural",)}.get(backup, ("ssd_fast",))
    if mode != "auto":
        return ssd_opts
    return ssd_opts + ("sd", "ar") + (("ngram",) if backup != "random" else ())
