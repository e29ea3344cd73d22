"""Pick the draft length K (and SSD's fan-out budget B) from latencies measured on the real devices.

SSD hides the draft only if its per-round work fits inside one verification:
    t_spec(K, B) ~ t_draft(K + 1 chain tokens) + K * t_draft(B sibling tokens)  <=  t_verify(K + 1)
Among the (K, B) that fit, take the one with the most expected tokens per second (model hit rate
from the geometric fan-out at a prior acceptance rate); plain SD maximises
E_tokens(K) / (K * t_draft(1) + t_verify(K + 1)). `KTuner` (SD) and `SSDTuner` (SSD: K and B)
re-choose every round from the acceptance observed so far, per request (the prior is only a starting
point: code drafts are accepted ~99 % of the time, prose far less).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ssd.fanout import expected_hit_rate, geometric_fanout, outcome_probs
from ssd.handles import WorkerHandle
from ssd.policy import ACCEPTANCE_PRIOR, expected_tokens, gate_price, interpolate

log = logging.getLogger("ssd")

K_CHOICES = (2, 3, 4, 5, 6, 8)
PRIOR_ACCEPTANCE = ACCEPTANCE_PRIOR
PRIOR_R = 1.0
# Ranked candidates (Config.candidates): miss rate ~ m * B^-RANKED_SLOPE. Replaying the AR outputs of
# 10 HumanEval + 10 MT-Bench prompts through the real draft gave slopes of ~0.6 on MT-Bench (misses
# 0.54 at B = 1, 0.13 at B = 12) and steeper on HumanEval (0.05 at B = 1).
RANKED_SLOPE = 0.6
# Fan-out sizes whose sibling forwards start-up times (and the largest budget); the others are interpolated
# between them. Every size up to 4 (the CPU kernels change path at 3 rows), then a sparser ladder: timing
# all 21 budgets took ~8 s of `auto`'s start-up on the real pair.
BRANCH_TIMED = (1, 2, 3, 4, 6, 8, 12, 16, 24)


@dataclass
class AutoConfig:
    k: int
    budget: int
    t_verify: dict[int, float]
    t_draft: dict[int, float]
    t_draft1: float = 0.0  # one plain draft step (measured for plain SD only)
    t_chain: dict[int, float] = field(default_factory=dict)  # the draft scoring n chain tokens (SSD)
    t_borrowed: dict[int, float] | None = None  # seconds per verification of n tokens on borrowed cores
    # seconds per verification of n tokens on the target's own cores while the draft computes beside it
    t_verify_busy: dict[int, float] | None = None
    draft_borrow_share: float | None = None  # a draft forward on the target's cores too / on its own (measured)
    t_step: float = 0.0  # one draft step on its own cores (what a start checks a stored configuration by)


@dataclass
class _AcceptanceCounts:
    """Per-token acceptance from rounds as successes / (successes + failures) — a round that accepts n
    of k drafts is n successes and, if n < k, one failure — with old rounds decayed and a prior
    (PRIOR_ACCEPTANCE unless given) worth `prior_weight` tokens, so a few rounds cannot swing K."""

    prior_weight: float = 4.0
    decay: float = 0.9
    successes: float = 0.0
    failures: float = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1.0 if accepted < drafted else 0.0)

    def estimate(self, prior: float) -> float:
        w = self.prior_weight
        return (self.successes + w * prior) / (self.successes + self.failures + w)

    @property
    def acceptance(self) -> float:
        return self.estimate(PRIOR_ACCEPTANCE)


@dataclass
class _RequestAcceptance(_AcceptanceCounts):
    """Engine-wide acceptance counts plus one set per request. A request's own counts start empty with
    the engine-wide estimate as their prior: a new request starts from what the engine saw last (the
    workload) and its own rounds take over within a few rounds. Engine-wide counts alone carried a
    code prompt's acceptance ~0.97 ten rounds or more into a prose one (K = 4, B = 1 miss streaks)."""

    requests: dict[int, _AcceptanceCounts] = field(default_factory=dict)

    def observe(self, drafted: int, accepted: int, seq_id: int | None = None) -> None:
        super().observe(drafted, accepted)
        if seq_id is not None and drafted > 0:
            own = self.requests.setdefault(seq_id, _AcceptanceCounts(self.prior_weight, self.decay))
            own.observe(drafted, accepted)

    def acceptance_of(self, seq_ids: Sequence[int] = ()) -> float:
        """The batch's acceptance: the mean of its requests' own estimates (the engine-wide one without ids)."""
        engine = self.acceptance
        if not seq_ids:
            return engine
        own = [self.requests[s].estimate(engine) if s in self.requests else engine for s in seq_ids]
        return sum(own) / len(own)

    def forget(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)


@dataclass
class KTuner(_RequestAcceptance):
    """Plain SD's draft length, re-chosen every round from the batch's observed acceptance and start-up
    latencies."""

    t_verify: dict[int, float] = field(default_factory=dict)
    t_draft1: float = 0.0
    # measured / start-up seconds per drafted token (decayed average): lookahead guesses the draft agrees
    # with make tokens cheaper than a forward each, by how much depends on the text
    draft_scale: float = 1.0
    ema: float = 0.3
    # gated: drafts stop by confidence (DraftWorker._worth) within the longest K; `rate` is the measured
    # tokens per second of recent rounds (decayed; 0 before the first) that prices a draft forward
    gated: bool = False
    rate: float = 0.0

    def observe_draft(self, k: int, seconds: float) -> None:
        """A k-token draft took `seconds` (the propose call, as the coordinator waited for it)."""
        if k > 0 and self.t_draft1 > 0 and seconds > 0:
            self.draft_scale = (1 - self.ema) * self.draft_scale + self.ema * seconds / (k * self.t_draft1)

    def observe_rate(self, tokens: int, seconds: float) -> None:
        """A round emitted `tokens` (all sequences) in `seconds`, drafting and verification."""
        if tokens > 0 and seconds > 0:
            r = tokens / seconds
            self.rate = r if self.rate <= 0 else (1 - self.ema) * self.rate + self.ema * r

    def choose(self, seq_ids: Sequence[int] = ()) -> int:
        """K for the batch; gated drafts take the longest choice and stop by themselves."""
        if self.gated:
            return max(K_CHOICES)
        return self._best_plain(seq_ids)

    def _best_plain(self, seq_ids: Sequence[int]) -> int:
        return _choose_sd(self.t_verify, self.t_draft1 * self.draft_scale, self.acceptance_of(seq_ids),
                          batch=max(1, len(seq_ids)))

    def stop_below(self, k: int, seq_ids: Sequence[int]) -> float:
        """The price of one more forward of a gated draft (up to k tokens) in expected accepted tokens of one
        sequence: its share of the forward (the batch's rows draft together) and its token's verification
        row, at the recent rate per sequence; before any round the best ungated K's modelled rate. 0 = no gate."""
        if not self.gated or self.t_draft1 <= 0 or not seq_ids:
            return 0.0
        n = len(seq_ids)
        rate = self.rate
        if rate <= 0:
            k0 = self._best_plain(seq_ids)
            rate = n * expected_tokens(self.acceptance_of(seq_ids), k0) / (
                k0 * self.t_draft1 + rows_time(self.t_verify, n * (k0 + 1)))
        # a verification row: the mean slope up to k + 1 rows (start-up times k + 1 = 1 and the Ks')
        row = max(0.0, interpolate(self.t_verify, k + 1) - interpolate(self.t_verify, 1)) / k
        return gate_price(rate, self.t_draft1, row, n)


@dataclass
class _MissCounts:
    """Ranked candidates' miss scale m of miss(B) = m * B^-RANKED_SLOPE from rounds at whatever budgets they
    used (decayed), with a prior m worth `prior_weight` rounds."""

    prior_weight: float = 4.0
    decay: float = 0.97
    misses: float = 0.0
    exposure: float = 0.0  # decayed sum of B^-RANKED_SLOPE over the rounds seen

    def count(self, budget: int, hit: bool) -> None:
        self.misses = self.decay * self.misses + (0.0 if hit else 1.0)
        self.exposure = self.decay * self.exposure + budget ** -RANKED_SLOPE

    def miss_scale(self, prior: float) -> float:
        return (self.misses + self.prior_weight * prior) / (self.exposure + self.prior_weight)


@dataclass
class RankedHits(_MissCounts):
    """Ranked candidates' hit rate against the budget B: 1 - m * B^-RANKED_SLOPE. Engine-wide counts (prior
    m = prior_miss) and one set per request whose prior is the engine-wide m, as `_RequestAcceptance`:
    HumanEval's misses are ~0.05 at B = 1, MT-Bench's ~0.5, so a request's own rounds should set its B."""

    prior_miss: float = 0.5
    requests: dict[int, _MissCounts] = field(default_factory=dict)

    def observe(self, budget: int, hit: bool, seq_id: int | None = None) -> None:
        if budget <= 0:
            return
        self.count(budget, hit)
        if seq_id is not None:
            self.requests.setdefault(seq_id, _MissCounts(self.prior_weight, self.decay)).count(budget, hit)

    def hit_rate(self, budget: int, seq_ids: Sequence[int] = ()) -> float:
        """The batch's hit rate at budget B per request (the mean of its requests' own; engine-wide without ids)."""
        m = self.miss_scale(self.prior_miss)
        if seq_ids:
            own = [self.requests[s].miss_scale(m) if s in self.requests else m for s in seq_ids]
            m = sum(own) / len(own)
        return max(0.0, 1.0 - m * max(budget, 1) ** -RANKED_SLOPE)

    def forget(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)


@dataclass
class SSDTuner(_RequestAcceptance):
    """SSD's draft length and fan-out budget, re-chosen every round like `KTuner`, with SSD's cost model
    (the next speculation must fit inside a verification to stay off the critical path). The outcome
    cache holds one round, and each request carries its own K and fan-out, so K may change between
    rounds without losing a prepared speculation."""

    t_verify: dict[int, float] = field(default_factory=dict)
    t_chain: dict[int, float] = field(default_factory=dict)
    t_branch: dict[int, float] = field(default_factory=dict)

    verify_scale: float = 1.0  # measured / start-up verification time (decayed average)
    spec_scale: float = 1.0  # measured / start-up speculation time
    t_fixed: float = 0.0  # per-round wait after verification that the speculation does not explain (no draft)
    miss_scale: float = 1.0  # measured / start-up time of a miss's just-in-time draft of k tokens
    ema: float = 0.3
    ranked: RankedHits | None = None  # greedy rows rank their candidates: hit rates from these, not the quotas'
    k_choices: tuple[int, ...] = K_CHOICES  # a user's K: (K,), and only B is chosen

    def observe_round_times(self, k: int, b: int, t_verify: float, t_spec: float, t_wait: float,
                            jit_draft: bool = False) -> None:
        """One SSD round of a single sequence: drafts of length k verified in t_verify while the draft
        speculated (k, b) in t_spec; then t_wait more until the next speculation was resolved. `jit_draft`:
        the round missed and the wait includes the neural backup's just-in-time draft of k tokens, which
        calibrates the price of a miss instead of the fixed per-round wait (counted in both, every miss
        would be paid twice, and the doubled constant made long drafts look cheap)."""
        if k + 1 not in self.t_verify or b not in self.t_branch or min(t_verify, t_spec) <= 0:
            return
        e = self.ema
        self.verify_scale = (1 - e) * self.verify_scale + e * t_verify / self.t_verify[k + 1]
        self.spec_scale = (1 - e) * self.spec_scale + e * t_spec / spec_time(self.t_chain, self.t_branch, k, b)
        fixed = max(0.0, t_wait - max(0.0, t_spec - t_verify))  # the wait beyond the speculation's overrun
        if jit_draft:
            miss = max(0.0, fixed - self.t_fixed) / (k * self.t_branch[1])
            self.miss_scale = (1 - e) * self.miss_scale + e * miss
        else:
            self.t_fixed = (1 - e) * self.t_fixed + e * fixed

    @property
    def chooses_k(self) -> bool:
        """False where the user fixed K: only the budget is re-chosen."""
        return len(self.k_choices) > 1

    def choose(self, seq_ids: Sequence[int] = ()) -> tuple[int, int]:
        """(K, B) for the batch of `seq_ids` (engine-wide estimates without ids)."""
        ranked = self.ranked
        hit_rate = None if ranked is None else lambda b: ranked.hit_rate(b, seq_ids)
        return _choose_ssd(self.t_verify, self.t_chain, self.t_branch, self.acceptance_of(seq_ids),
                           self.verify_scale, self.spec_scale, self.t_fixed, hit_rate=hit_rate,
                           miss_scale=self.miss_scale, batch=max(1, len(seq_ids)), k_choices=self.k_choices)

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        if self.ranked is not None:
            self.ranked.forget(seq_id)


def rows_time(t: dict[int, float], n: int) -> float:
    """A forward of n rows from timings at some row counts: piecewise-linear between them, and past the
    largest along the last segment's slope (a batch's verification and branches outgrow the one-sequence
    sizes timed at start-up, and the rows' compute grows with them)."""
    if n in t:
        return t[n]
    ns = sorted(t)
    if len(ns) < 2 or n <= ns[-1]:
        return interpolate(t, n)
    lo, hi = ns[-2], ns[-1]
    return t[hi] + max(0.0, (t[hi] - t[lo]) / (hi - lo)) * (n - hi)


def _choose_sd(t_verify: dict[int, float], t_draft1: float, a: float, batch: int = 1,
               k_choices: Sequence[int] = K_CHOICES) -> int:
    """K for plain SD: a batch verifies batch x (K + 1) tokens in one forward (its draft steps are priced at one
    row's: memory-bound at the batch sizes SD suits)."""
    return max(k_choices, key=lambda k: expected_tokens(a, k) / (k * t_draft1 + rows_time(t_verify, batch * (k + 1))))


def model_hit_rate(fanout: list[int], a: float, r: float) -> float:
    """Hit probability for choosing (K, B): the power law of `fanout.expected_hit_rate` for k < K, but
    at k = K the bonus token is the draft's own top choice with probability ~a (the per-token
    agreement), so p_hit = 1 - (1 - a) F^-r there. (The paper's law gives F = 1 no hits at all,
    which would rule out the small budgets that suit drafts accepted ~99 % of the time.)"""
    k_max, f_k = len(fanout) - 1, fanout[-1]
    bonus = outcome_probs(a, k_max)[-1] * a * f_k ** (-r) if f_k > 0 else 0.0  # the paper's misses at K, less
    return expected_hit_rate(fanout, a, r) + bonus


def budgets(k: int) -> list[int]:
    """Fan-out budgets tried for draft length k: 1-2 branches (enough when nearly every draft is
    accepted: the bonus token is then usually the draft's top choice) up to 4 per position."""
    return sorted({1, 2} | {p * (k + 1) for p in (1, 2, 3, 4)})


def feed_time(t_chain: dict[int, float]) -> float | None:
    """Seconds per extra token in one draft forward: the slope of the chain timings (None with one point)."""
    ns = sorted(t_chain)
    if len(ns) < 2:
        return None
    return max(0.0, (t_chain[ns[-1]] - t_chain[ns[0]]) / (ns[-1] - ns[0]))


def spec_time(t_chain: dict[int, float], t_branch: dict[int, float], k: int, b: int, batch: int = 1) -> float:
    """Start-up estimate of one round's speculation: score the K + 1 chain tokens, then K steps of b branches,
    for each of `batch` sequences in the same forwards."""
    return rows_time(t_chain, batch * (k + 1)) + k * rows_time(t_branch, batch * b)


def _choose_ssd(t_verify: dict[int, float], t_chain: dict[int, float], t_branch: dict[int, float],
                a: float, verify_scale: float = 1.0, spec_scale: float = 1.0, t_fixed: float = 0.0,
                hit_rate: Callable[[int], float] | None = None, miss_scale: float = 1.0,
                batch: int = 1, k_choices: Sequence[int] = K_CHOICES) -> tuple[int, int]:
    """The (K, B) with the most expected tokens per second for a batch of `batch` sequences, which verify
    batch x (K + 1) tokens and speculate batch x B branches a round; the scales and the fixed per-round cost
    correct the start-up latencies with what rounds actually took (SSDTuner.observe_round_times).
    `hit_rate(B)`: ranked candidates' hit rate (RankedHits), else the geometric quotas' model. `k_choices`: the
    draft lengths considered (a user's K alone: the budget is still chosen)."""
    best, best_score = (k_choices[0], k_choices[0] + 1), -1.0
    for k in k_choices:
        for b in budgets(k):
            t_spec = spec_scale * spec_time(t_chain, t_branch, k, b, batch)
            if hit_rate is not None:
                e_hit = hit_rate(b)
            else:
                e_hit = model_hit_rate(geometric_fanout(a, PRIOR_R, k, b), a, PRIOR_R)
            # a miss of any sequence costs a just-in-time draft of k steps on top of the round
            t_miss = miss_scale * k * rows_time(t_branch, batch)
            t_verify_k = verify_scale * rows_time(t_verify, batch * (k + 1))
            t_round = max(t_verify_k, t_spec) + t_fixed + (1 - e_hit ** batch) * t_miss
            score = expected_tokens(a, k) / t_round
            if score > best_score:
                best, best_score = (k, b), score
    return best


def autoconfigure(
    target: WorkerHandle, draft: WorkerHandle, ssd: bool, borrow: bool = False, draft_borrow: bool = False,
    busy: bool = False, k_choices: Sequence[int] = K_CHOICES,
) -> AutoConfig:
    """Measure this machine's latencies and pick K (and SSD's fan-out budget) from them. `borrow` /
    `draft_borrow`: also time the target / draft on the other worker's cores; `busy`: also time the target's
    verifications while the draft runs forwards beside it (SSD rounds; on CPU both stream their weights
    through one memory path: `benchmarks/contention.py` on the Zen 5 machine, 1.28x for 1 token, 1.56x for 3).
    `k_choices`: the draft lengths to time and choose from (a user's K alone: only SSD's budget is chosen)."""
    ns = sorted({k + 1 for k in k_choices})
    t0 = time.perf_counter()
    t_verify = target.call("time_forwards", [1, *ns]).result()  # n = 1: the policy's AR price
    t_verify_busy = None
    if busy:  # the draft's forwards outlast the target's: same call, so the same prefill and repetitions
        load = draft.call("keep_busy", 1.2 * (time.perf_counter() - t0) + 0.1)
        t_verify_busy = target.call("time_forwards", [1, *ns]).result()
        load.result()
    t_borrowed = None
    if borrow:  # the target on the draft's cores too, at the same n: the curve's shape differs from the own one's
        t_borrowed = target.call("time_forwards", [1, *ns], borrow=True).result()
    t_chain = draft.call("time_forwards", [1, *ns]).result()
    t_step = t_chain.pop(1)  # one draft step; the chain's own prices start at the shortest verification
    draft_share = None
    if draft_borrow:  # the draft on the target's cores too: one draft step and the longest chain
        lent = draft.call("time_forwards", [1, ns[-1]], borrow=True).result()
        draft_share = (lent[1] / t_step + lent[ns[-1]] / t_chain[ns[-1]]) / 2
    t_draft1 = 0.0
    if ssd:
        sizes = sorted({b for k in k_choices for b in budgets(k)})
        timed = sorted({b for b in sizes if b in BRANCH_TIMED} | {sizes[-1]})
        measured = draft.call("time_forwards", timed, 128, True).result()
        t_branch = {b: interpolate(measured, b) for b in sizes}
        k, b = _choose_ssd(t_verify, t_chain, t_branch, PRIOR_ACCEPTANCE, k_choices=k_choices)
    else:  # one draft step feeds plain SD's choice (and its per-round KTuner); SSD does not use it
        t_branch = {1: t_chain[ns[0]]}
        t_draft1 = t_step
        k, b = _choose_sd(t_verify, t_draft1, PRIOR_ACCEPTANCE, k_choices=k_choices), 0
    for f in [target.call("release_probe"), draft.call("release_probe")]:  # the timing slots go back
        f.result()
    log.info("auto-config: k=%d budget=%d (verify %s ms)", k, b,
             {n: round(t * 1e3, 1) for n, t in t_verify.items()})
    if t_borrowed is not None:
        log.info("auto-config: verification on borrowed cores takes %s x the target's own",
                 {n: round(t / t_verify[n], 2) for n, t in t_borrowed.items()})
    if draft_share is not None:
        log.info("auto-config: a draft forward on borrowed cores takes %.2fx the draft's own", draft_share)
    if t_verify_busy is not None:
        log.info("auto-config: verification beside a busy draft takes %s x the target's own",
                 {n: round(t / t_verify[n], 2) for n, t in t_verify_busy.items()})
    return AutoConfig(k=k, budget=b, t_verify=t_verify, t_draft=t_branch, t_draft1=t_draft1, t_chain=t_chain,
                      t_borrowed=t_borrowed, draft_borrow_share=draft_share, t_verify_busy=t_verify_busy,
                      t_step=t_step)
