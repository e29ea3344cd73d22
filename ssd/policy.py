"""Batch-size-aware choice of the decoding strategy for the next round (ssd-algorithm.md 3c, 4).

Options: SSD with the neural (just-in-time draft) backup, SSD with a fast (n-gram / random) backup,
plain SD, n-gram SD (prompt lookup as the primary drafter: no draft-model work at all; wins when
the output copies its context, as code edits do), plain AR. Each is scored by expected seconds
per emitted token from online estimates: verification cost as a function of tokens scored, draft
cost per step, speculation time, cache hit rate and acceptance. The cheapest wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

OPTIONS = ("ssd_neural", "ssd_fast", "sd", "ar", "ngram")  # order breaks ties
NGRAM_PRIOR = 4  # rounds of evidence the overall n-gram rate counts for in a per-match-length estimate
# Per-match-length acceptance moves slowly: shadow scoring observes every round anyway, and with a fast
# average one lucky round lifts a low rate over the n-gram-vs-AR threshold for the next few rounds
# (drafts paying above 17 %, true rate 5 %: n-gram taken in ~13 % of rounds at alpha 0.2, ~2 % at 0.05;
# tests/test_ngram.py).
NGRAM_ALPHA = 0.05
# The neural draft's acceptance and the hit rate, per round: a fast average of a ~50 % hit rate swings
# by +-0.17 (one sd), and once a dip prices SSD above AR the policy stops running it, so the estimate
# stays low (seen on MT-Bench: a hit rate of 0.28 for the rest of a prompt where SSD alone hit 48 %).
RATE_ALPHA = 0.05
# The neural draft's per-token acceptance before a request measured any: what plain SD's K tuner starts
# from too. Optimistic on purpose: AR and n-gram rounds never measure the draft, so a prior that prices SD
# above AR is never corrected (session 20, raw HumanEval on both cores: at 0.7 the first prompt ran AR and
# n-gram for ~100 rounds while the draft, once measured, accepted ~0.9).
ACCEPTANCE_PRIOR = 0.8
SWITCH_HORIZON = 4  # rounds a switch into SSD is expected to last: its one-off catch-up is spread over them
# Leaving a ready SSD pipeline for AR / SD / n-gram needs an option this much cheaper: the prepared
# speculation is thrown away and coming back pays a catch-up. Without it `auto` switched in a third of
# its rounds on MT-Bench, where the options are within ~15 % of each other.
SWITCH_MARGIN = 0.9
# Leaving SD likewise: its rounds are the best-measured option (steady, every round calibrates them), while
# an n-gram or SSD round priced a little lower often costs more (its price is rarely measured, and the
# draft's lookahead guesses are dropped). Priced within this factor, `auto` stays on SD.
SD_STAY_MARGIN = 0.85
CALIBRATION_RANGE = (0.5, 2.0)  # how far measured round times may move an option's modelled price
GATE_GAIN_RANGE = (0.5, 3.0)  # one gated SD round's tokens against a fixed-length draft's expectation
# Verification on the target's and the draft's cores together, as a share of the target's own time:
# the prior before start-up measures it (2 threads over 1 on the real pair: ~0.55).
BORROW_PRIOR = 0.6
OUTLIER_CAP = 1.5  # an observed verification counts for at most this times its line's prediction
PRICE_STEP = 0.2  # the share of a verification's price error its round corrects at its own token count
LEVEL_STEP = 0.05  # ... of which at every token count (the intercept)


def fit_line(t: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of seconds per forward against tokens scored: through the one-token time, with
    the least-squares slope of all points (clamped at 0), so a one-token forward is priced exactly."""
    ns = sorted(t)
    if 1 not in t or len(ns) < 2:
        raise ValueError(f"a verification line needs the one-token time and at least one more point, got n = {ns}")
    mean_n = sum(ns) / len(ns)
    mean_t = sum(t[n] for n in ns) / len(ns)
    slope = max(0.0, sum((n - mean_n) * (t[n] - mean_t) for n in ns) / sum((n - mean_n) ** 2 for n in ns))
    return t[1] - slope, slope


def interpolate(knots: dict[int, float], n: int) -> float:
    """Piecewise-linear through `knots` (n -> value), held at the end knots' values outside them."""
    if not knots:
        return 0.0
    ns = sorted(knots)
    if n <= ns[0]:
        return knots[ns[0]]
    for lo, hi in zip(ns, ns[1:]):
        if n <= hi:
            return knots[lo] + (knots[hi] - knots[lo]) * (n - lo) / (hi - lo)
    return knots[ns[-1]]


@dataclass
class Ema:
    value: float
    alpha: float = 0.2
    n: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.n == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.n += 1


@dataclass
class RateEma:
    """A rate as successes / trials, each a moving average, starting from `prior` as `weight` trials' worth
    (one unlucky first round must not set a hit rate to 0, which the policy would then never re-try).
    Averaging each round's own ratio instead is biased low for acceptance: a round of k drafts scores
    0, 1/2, ..., 1, and at a true 0.7 with k = 2 those average 0.6 (the first rejection ends a round,
    so short rounds are over-weighted)."""

    prior: float
    alpha: float = 0.2
    weight: float = 1.0
    n: int = 0
    successes: float = field(init=False)
    trials: float = field(init=False)

    def __post_init__(self) -> None:
        self.successes, self.trials = self.prior * self.weight, self.weight

    @property
    def value(self) -> float:
        return self.successes / self.trials if self.trials > 0 else self.prior

    def update(self, successes: float, trials: float) -> None:
        if trials <= 0:
            return
        self.successes = (1 - self.alpha) * self.successes + self.alpha * successes
        self.trials = (1 - self.alpha) * self.trials + self.alpha * trials
        self.n += 1


def acceptance_counts(drafted: int, accepted: int) -> tuple[int, int]:
    """(successes, trials) of one draft of `drafted` tokens: every accepted token, and the first rejected
    one when there is one. A round without a draft (no n-gram match) counts as one failed trial."""
    if drafted <= 0:
        return 0, 1
    return accepted, accepted + (1 if accepted < drafted else 0)


@dataclass
class VerifyLine:
    """Seconds of a forward scoring n tokens: v0 + v1 * n, plus `bend`, residuals from that line at the n
    measured at start-up and seen in rounds (interpolated between them). The bend keeps the curve's shape,
    which a line misprices: with the AVX-512 tile kernels' pairs from 3 rows the 1.5B's forwards took 35.7 /
    35.8 / 43.1 / 72.5 ms at 1 / 2 / 4 / 8 tokens (session 27), and the line through the first point with
    the least-squares slope priced 2-4 tokens 15-21 % high.

    A round's error moves the price at its own n (its bend knot, added where missing) and, by a smaller
    step, the intercept (every n: the machine's drift). The slope stays as fitted. Moving intercept and
    slope together diverged on a concave curve (session 38, Zen 4, borrowed cores): 2-token rounds above
    the line raised the slope, 9-token rounds below it lowered the intercept, until one token was priced
    at 1 ms against 40 measured and `auto` ran AR in 40 % of its rounds."""

    v0: Ema
    v1: Ema
    bend: dict[int, float] = field(default_factory=dict)
    # The largest n timed at start-up: errors of rounds past it (a batch's verifications, or one sequence's
    # lookahead-extended draft) come from the curve's shape out there, which their own knots learn, not from
    # drift, so they leave the intercept (and with it the prices of a few tokens) alone. None: every round
    # moves it.
    fitted_max: int | None = None

    @classmethod
    def fit(cls, t: dict[int, float]) -> VerifyLine:
        """Through every measured point exactly (n = 1 and at least one more); one observation's weight."""
        intercept, slope = fit_line(t)
        return cls(Ema(intercept, n=1), Ema(slope, n=1), {n: t[n] - (intercept + slope * n) for n in t}, max(t))

    def time(self, n_tokens: int) -> float:
        return max(self.v0.value + self.v1.value * n_tokens + interpolate(self.bend, n_tokens), 1e-6)

    def observe(self, n_tokens: int, seconds: float) -> float:
        """Move the price at n_tokens by PRICE_STEP of its error, LEVEL_STEP of it through the intercept. An
        observation counts for at most OUTLIER_CAP times the prediction: a request's first verifications ran
        3-4x their line on the real pair and lifted the borrowed decode step's price from 32 to 58 ms for
        good (AR and SD were never tried again to bring it back). Returns the prediction's error relative
        to `seconds` (before the update)."""
        predicted = self.time(n_tokens)
        err = min(seconds, OUTLIER_CAP * predicted) - predicted
        level = LEVEL_STEP if self.fitted_max is None or n_tokens <= self.fitted_max else 0.0
        self.v0.value += level * err
        self.v0.n += 1
        knot = self.bend.get(n_tokens, interpolate(self.bend, n_tokens))
        self.bend[n_tokens] = knot + (PRICE_STEP - level) * err
        return abs(predicted - seconds) / seconds if seconds > 0 else 0.0


@dataclass
class GatedSD:
    """auto's SD rounds under the draft gate: drafts stop by the draft's confidence, longer where it is sure, and
    are accepted more than a per-token rate at one fixed length says. Measured per round: the drafted length
    per sequence, and the emitted tokens as a share of expected_tokens(acceptance, each draft's length)."""

    length: Ema = field(default_factory=lambda: Ema(4.0))
    # the longest draft of a round: the batch's draft forwards run until its last row stops (batch 1: = length)
    longest: Ema = field(default_factory=lambda: Ema(4.0))
    gain: Ema = field(default_factory=lambda: Ema(1.0))

    def observe(self, a: float, drafted: list[int], emitted: list[int]) -> None:
        if not drafted or sum(drafted) == 0:
            return
        self.length.update(sum(drafted) / len(drafted))
        self.longest.update(max(drafted))
        expected = sum(expected_tokens(a, d) for d in drafted)
        self.gain.update(min(max(sum(emitted) / expected, GATE_GAIN_RANGE[0]), GATE_GAIN_RANGE[1]))


@dataclass
class CostModel:
    """Online estimates, all in seconds."""

    verify: VerifyLine = field(default_factory=lambda: VerifyLine(Ema(0.05), Ema(0.002)))  # on the target's cores
    # A just-in-time draft of k steps: t_d(k) = draft_call + k * draft_step. The intercept takes what a call
    # costs besides its forwards (the RPC, the core loan's switch): fitted as dt / k, it made one-token
    # drafts look 1.5x dearer per step and kept auto's SD rounds at k = 1 (session 17).
    draft_step: Ema = field(default_factory=lambda: Ema(0.02))  # one batched draft forward
    draft_call: Ema = field(default_factory=lambda: Ema(0.0))
    speculate: Ema = field(default_factory=lambda: Ema(0.08))  # SSD draft work for one round of one sequence
    # batch -> a round's speculation at that batch over one sequence's (the draft's forwards grow with the rows:
    # set from the start-up timings, ssd/build.py); None: priced as one sequence's at any batch
    spec_batch_factor: Callable[[int], float] | None = None
    feed: Ema = field(default_factory=lambda: Ema(0.003))  # a draft forward's cost per extra token fed
    # per-token, neural draft
    acceptance: RateEma = field(default_factory=lambda: RateEma(ACCEPTANCE_PRIOR, RATE_ALPHA))
    fast_acceptance: RateEma = field(default_factory=lambda: RateEma(0.2))  # per-token, fast backup / n-gram
    # Hit rates of rounds that verify a cached (primary) draft, apart for the two kinds of outcome: every
    # draft token accepted (the draft predicts the bonus token) and a rejection (it predicts the
    # correction). Priced at the current acceptance, a^k x full + (1 - a^k) x partial, SSD's hit rate
    # follows the prompt (code vs prose) through acceptance, which SD rounds keep measuring while the
    # policy is out of SSD: a single observed rate stayed at a prose dip's 0.41 for the rest of a prompt.
    hit_full: RateEma = field(default_factory=lambda: RateEma(0.8, RATE_ALPHA))
    hit_partial: RateEma = field(default_factory=lambda: RateEma(0.3, RATE_ALPHA))
    # Hit rates of rounds that verify a backup's draft, after a miss: misses come in runs (MT-Bench,
    # T = 0.7: 0.36 after a just-in-time neural draft, 0.38 after an n-gram one, 0.5-0.67 after a hit).
    hit_after_neural: RateEma = field(default_factory=lambda: RateEma(0.4, RATE_ALPHA))
    hit_after_fast: RateEma = field(default_factory=lambda: RateEma(0.4, RATE_ALPHA))
    # n-gram acceptance by the length of the suffix the lookup matched: code copied from the prompt
    # matches 4 tokens and is accepted nearly always, prose matching 1-2 tokens rarely.
    ngram_by_match: dict[int, RateEma] = field(default_factory=dict)
    # Per option, measured / predicted seconds of steady rounds: corrects what the time model leaves out
    # (host and RPC time per round, a neural backup's catch-up feed), which decides close calls (on
    # MT-Bench AR, SD and SSD are within ~15 % of each other). Time only: tokens per round are what the
    # acceptance and hit rates measure, and a ratio of seconds per token counted a lagging hit rate
    # twice (SSD priced 35 % high after a prose dip, long after the hit rate itself had caught up).
    calibration: dict[str, RateEma] = field(default_factory=dict)
    # Where the target may borrow the draft's cores (CPU, mode="auto"): verification on both, a line of its
    # own for the options that leave the draft idle (AR, SD, n-gram). None: no borrowing. A share of the
    # own line misprices both ends: on the real pair borrowing made a decode step 0.94x and a 6-token
    # verification 0.64x, so their mean share priced AR 16 % cheap.
    borrow: VerifyLine | None = None
    # Where the draft may borrow the target's cores for just-in-time drafts: a draft forward on both as a
    # share of one on its own (measured at start-up). draft_step is then observed on both cores already;
    # this prices the backlog those drafts feed, which `feed` measures on the draft's own cores.
    draft_lend: float = 1.0
    # Set where auto's SD rounds draft gated (SSDMode gate): prices SD at their measured length and tokens
    gated_sd: GatedSD | None = None

    def seed(
        self, t_verify: dict[int, float], draft_step: float | None = None, speculate: float | None = None,
        feed: float | None = None,
    ) -> None:
        """Start from latencies measured at start-up instead of the generic defaults (each counts as one
        observation, so rounds refine it). t_verify: seconds per forward of n tokens, n = 1 included.

        The verification line goes through every measured point (VerifyLine.fit): a CPU's verification
        cost grows ~30-60 ms per token, against the 2 ms default, which made n-gram rounds of K+1 mostly
        rejected tokens look nearly as cheap as AR."""
        self.verify = VerifyLine.fit(t_verify)
        # A measured step seeds the intercept at 0 as one observation too: unseeded, the first just-in-time
        # draft set it alone, and a request's first draft (here 50 ms for one step) kept SD priced out.
        call = None if draft_step is None else 0.0
        for ema, value in ((self.draft_step, draft_step), (self.draft_call, call), (self.speculate, speculate),
                           (self.feed, feed)):
            if value is not None:
                ema.value, ema.n = value, 1

    def ngram_acceptance(self, match: int) -> float:
        """Per-token acceptance of an n-gram draft whose lookup matched `match` tokens (0: no draft).

        The per-length estimate is blended with the overall rate as if that were NGRAM_PRIOR rounds of
        evidence: observations are mostly 0 or 1 (shadowed AR rounds), and one lucky round must not
        price an 8-token draft as certain.
        """
        if match <= 0:
            return 0.0
        ema = self.ngram_by_match.get(match)
        n = 0 if ema is None else min(ema.n, NGRAM_PRIOR * 4)
        if n == 0:
            return self.fast_acceptance.value
        return (n * ema.value + NGRAM_PRIOR * self.fast_acceptance.value) / (n + NGRAM_PRIOR)

    def observe_ngram(self, match: int, drafted: int, accepted: int) -> None:
        """An n-gram draft of `drafted` tokens (looked up with a `match`-token suffix) had `accepted` accepted."""
        counts = acceptance_counts(drafted, accepted)
        self.fast_acceptance.update(*counts)
        if match > 0:
            # No prior inside: ngram_acceptance blends in the overall rate itself.
            ema = self.ngram_by_match.setdefault(match, RateEma(0.0, alpha=NGRAM_ALPHA, weight=0.0))
            ema.update(*counts)

    def observe_round(self, option: str, predicted: float, seconds: float) -> None:
        """A round of `option` took `seconds` where `round_seconds` predicted `predicted`. Only steady
        rounds: not a switch's first round, which choose() prices apart."""
        if predicted > 0:
            # The prior counts as one round (its trials are seconds): weighted as one second, it outweighed
            # ~100 rounds of ~80 ms, and SSD rounds measured 13-16 % above their price left the factor at
            # 1.006 after a whole prompt on the real pair (session 21).
            ema = self.calibration.setdefault(option, RateEma(1.0, RATE_ALPHA, weight=predicted))
            ema.update(seconds, predicted)

    def observe_hit(self, source: str, full: bool, hit: bool) -> None:
        """One sequence's SSD round. `source` of the draft it verified: "primary" (a cache hit), "neural"
        (the just-in-time backup) or "fast" (n-gram / random); `full`: all its tokens were accepted."""
        if source == "primary":
            rate = self.hit_full if full else self.hit_partial
        else:
            rate = {"neural": self.hit_after_neural, "fast": self.hit_after_fast}[source]
        rate.update(float(hit), 1.0)

    def hit_rate(self, k: int) -> float:
        """Expected hit rate of a round that verifies a cached k-token draft, at the current acceptance."""
        full = min(max(self.acceptance.value, 0.0), 1.0) ** k
        return full * self.hit_full.value + (1 - full) * self.hit_partial.value

    def share_primary(self, k: int, backup: str) -> float:
        """Steady share of SSD rounds that verify a cached draft, the rest verifying `backup`'s: a
        two-state chain that leaves a hit round with the miss rate and a backup round with its hit rate."""
        p, p_back = self.hit_rate(k), (self.hit_after_neural if backup == "neural" else self.hit_after_fast).value
        return p_back / (p_back + 1 - p) if p_back + 1 - p > 0 else 1.0

    def calibration_factor(self, option: str) -> float:
        ema = self.calibration.get(option)
        return 1.0 if ema is None else min(max(ema.value, CALIBRATION_RANGE[0]), CALIBRATION_RANGE[1])

    def enable_borrow(self, share: float = BORROW_PRIOR, t_borrowed: dict[int, float] | None = None) -> None:
        """The target can borrow the draft's cores. `t_borrowed`: seconds per borrowed forward of n tokens
        measured at start-up (n = 1 and at least one more), fitted as seed() fits the own line; without
        it, `share` times the own line. Either counts as one observation."""
        if t_borrowed is not None:
            self.borrow = VerifyLine.fit(t_borrowed)
        else:
            own = self.verify
            self.borrow = VerifyLine(Ema(share * own.v0.value, n=1), Ema(share * own.v1.value, n=1),
                                     {n: share * b for n, b in own.bend.items()}, own.fitted_max)

    def lent_verify_time(self, n_tokens: int) -> float:
        """Seconds of a verification the target may run on borrowed cores (AR, SD, n-gram rounds)."""
        return self.verify_time(n_tokens) if self.borrow is None else self.borrow.time(n_tokens)

    def borrow_factor(self, n_tokens: int = 1) -> float:
        """Borrowed / own verification time at n tokens (1.0 without borrowing)."""
        return self.lent_verify_time(n_tokens) / self.verify_time(n_tokens)

    def draft_time(self, k: int) -> float:
        """Seconds of a just-in-time draft of k steps (0 for no draft)."""
        return self.draft_call.value + k * self.draft_step.value if k > 0 else 0.0

    def observe_draft(self, k: int, seconds: float) -> None:
        """A just-in-time draft of k steps took `seconds` (one that fed no backlog): the residual moves the
        intercept, and the slope only for k > 1, so one-step drafts cannot inflate the per-step cost."""
        if k <= 0:
            return
        err = seconds - self.draft_time(k)
        self.draft_call.update(max(0.0, self.draft_call.value + 0.5 * err))
        if k > 1:
            self.draft_step.update(max(1e-6, self.draft_step.value + 0.5 * err / k))

    def backlog_time(self, lag: int, lent: bool) -> float:
        """Seconds for the draft to feed `lag` tokens it has not seen; `lent`: in a just-in-time draft on the
        target's cores too."""
        return lag * self.feed.value * (self.draft_lend if lent else 1.0)

    def verify_time(self, n_tokens: int) -> float:
        return self.verify.time(n_tokens)

    def _spec_factor(self, batch: int) -> float:
        return 1.0 if self.spec_batch_factor is None or batch <= 1 else max(1.0, self.spec_batch_factor(batch))

    def speculate_time(self, batch: int) -> float:
        """Seconds of one SSD round's speculation for `batch` sequences."""
        return self.speculate.value * self._spec_factor(batch)

    def observe_speculate(self, batch: int, seconds: float) -> None:
        """A round's speculation for `batch` sequences took `seconds`: kept as one sequence's, so a run of
        batch-8 rounds does not price batch-1 SSD at batch 8's speculation (and the reverse)."""
        self.speculate.update(seconds / self._spec_factor(batch))

    def observe_verify(self, n_tokens: int, seconds: float, borrowed: bool = False) -> float:
        """A verification of n_tokens took `seconds`; `borrowed`: on the draft's cores too, which moves
        the borrowed line, not the own one. Returns the price's relative error (VerifyLine.observe)."""
        if borrowed:
            if self.borrow is None:
                raise ValueError("a borrowed verification without enable_borrow()")
            return self.borrow.observe(n_tokens, seconds)
        return self.verify.observe(n_tokens, seconds)


def expected_tokens(a: float, k: float) -> float:
    """Expected emitted tokens of a round with k drafts at per-token acceptance a: (1 - a^(k+1)) / (1 - a)."""
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def gate_price(rate: float, draft_step: float, row: float, batch: int) -> float:
    """One more forward of a gated draft, in expected accepted tokens of one sequence: its share of the
    batch's draft step and its token's verification row (seconds), at `rate` tokens per second of the batch."""
    return rate / batch * (draft_step / batch + row)


class NgramPlan(NamedTuple):
    """A round of n-gram drafts, priced per sequence: each drafts min(k, its lookup's length) tokens at its own
    match's acceptance (a sequence without a match drafts nothing and emits one token)."""

    acceptance: float  # the sequences' mean (what the policy reports)
    k: int
    tokens: float  # expected tokens the batch emits
    verified: int  # tokens the batch verifies


def plan_ngram(cost: CostModel, lookups: list[tuple[int, float]], k_max: int) -> NgramPlan:
    """The n-gram draft length (1..k_max) with the fewest expected seconds per token for these (lookup length,
    acceptance) pairs, one per sequence, verified where such rounds verify (on borrowed cores when the target may
    borrow them): averaged before the expected-tokens formula, a copying sequence and one without a match looked
    like two half-accepted ones and got 1-token drafts."""

    def priced(k: int) -> tuple[float, int]:
        return (sum(expected_tokens(a, min(k, n)) for n, a in lookups), sum(min(k, n) + 1 for n, a in lookups))

    def per_token(k: int) -> float:
        tokens, verified = priced(k)
        return cost.lent_verify_time(verified) / tokens

    k = min(range(1, k_max + 1), key=per_token)
    tokens, verified = priced(k)
    return NgramPlan(sum(a for _, a in lookups) / len(lookups), k, tokens, verified)


def best_sd_len(cost: CostModel, a: float, batch: int, k_max: int) -> int:
    """Plain SD's draft length (1..k_max) with the fewest expected seconds per token: k draft steps on the
    critical path, then one verification of k + 1 tokens per sequence. SSD's K fits its speculation
    inside a verification; with cheap just-in-time drafts (the draft on both cores) SD's best is longer
    (session 17, raw HumanEval: SD mode's tuner took K = 5 where SSD's took 3)."""
    def per_token(k: int) -> float:
        return (cost.draft_time(k) + cost.lent_verify_time(batch * (k + 1))) / expected_tokens(a, k)

    return min(range(1, k_max + 1), key=per_token)


def round_seconds(cost: CostModel, option: str, batch: int, k: int, k_ngram: int | None = None,
                  missed: float = 0.0, verified: int | None = None) -> float:
    """Modelled seconds of one steady round of `option` (what calibration compares measured rounds with).
    `missed`: for neural SSD, the chance (or the fact) that a sequence missed, which costs a draft.
    `verified`: the tokens an SD or n-gram round verifies, where its drafts differ in length (gated drafts: the
    draft runs k steps, its longest, and the batch verifies fewer than batch x (k + 1); n-gram lookups shorter
    than k, or none)."""
    lent = cost.lent_verify_time  # AR, SD and n-gram verify on borrowed cores where the target can
    t_ver = cost.verify_time(batch * (k + 1))
    t_draft = cost.draft_time(k)
    if option == "ar":  # one token per sequence per target step
        return lent(batch)
    if option == "sd":  # the draft runs before the target, on the critical path
        return t_draft + lent(batch * (k + 1) if verified is None else verified)
    if option == "ngram":  # verification only; drafting is a lookup
        return lent(batch * ((k if k_ngram is None else k_ngram) + 1) if verified is None else verified)
    overlap = max(t_ver, cost.speculate_time(batch))  # SSD: speculation overlaps verification
    return overlap + missed * t_draft if option == "ssd_neural" else overlap


def choose(
    cost: CostModel,
    batch: int,
    k: int,
    allowed: tuple[str, ...] = OPTIONS,
    ngram: tuple[float, int] | None = None,
    prepared: float = 1.0,
    current: str | None = None,
    lag: int = 0,
    k_sd: int | None = None,
    horizon: int | None = None,
    unfed: bool = False,
) -> tuple[str, dict[str, float]]:
    """Return the option with the lowest expected seconds per emitted token, and all the scores
    (each option's modelled round time calibrated by its measured / modelled round times).

    `ngram`: this round's n-gram drafts, from the lookups' match lengths: an NgramPlan (priced per sequence), or
    (acceptance, draft length) for every sequence; without it n-gram SD is priced at the overall n-gram
    acceptance and length k.
    `prepared`: the share of sequences whose speculation for this round is ready (an SSD round just
    ran). The others must first be drafted: just in time by the draft model (SSD with the neural
    backup) or by lookup (the fast backup). That one-off cost is spread over the SWITCH_HORIZON rounds
    a switch is expected to last: charged to one round, it kept the policy out of SSD for good on
    prompts where steady-state SSD beat AR (MT-Bench); not charged at all, the policy flapped.
    `current`: last round's option. From a ready SSD pipeline (`prepared` = 1) only an SSD option, or
    one cheaper by SWITCH_MARGIN, is taken.
    `lag`: tokens the draft has not been fed yet (rounds on borrowed cores leave it idle). SD and SSD
    feed them first, a one-off cost spread over the switch horizon like the catch-up draft, or over the
    rounds of `horizon` (the tokens the lagging request has left) where those are more: staying on AR or
    n-gram only grows the backlog, so the choice is SD / SSD for the rest of the request, backlog
    included, against AR for all of it. Spread over 4 rounds, a backlog of ~30 tokens kept `auto` on AR
    and n-gram for the rest of a prompt while it grew (session 18: the 1.5B's SD at 35 tok/s, AR at 23).
    `k_sd`: plain SD's draft length if it differs from k (see `best_sd_len`).
    `unfed`: AR and n-gram rounds leave the draft unfed (the target borrows its cores), so each token they
    emit is one more the first SD or SSD round must feed; that feed is priced into their tokens. Without
    it, on the first prompt (acceptance still near its prior) AR and n-gram came out a few % cheaper than
    SD, their rounds grew a backlog, and the backlog then priced SD out for the rest of the prompt (lag 68
    tokens, SD 44.7 ms a token against AR's 33.4; session 19).
    """
    a, a_fast, p = cost.acceptance.value, cost.fast_acceptance.value, cost.hit_rate(k)
    e_sd = expected_tokens(a, k)
    k_sd = k if k_sd is None else k_sd
    e_sd_len = expected_tokens(a, k_sd)
    gated = cost.gated_sd
    sd_tokens = None
    if gated is not None and gated.length.n:  # gated drafts: their measured length and tokens per round
        e_sd_len = gated.gain.value * expected_tokens(a, gated.length.value)
        k_sd = max(1, round(gated.longest.value))  # the draft's forwards: until the batch's longest stops
        sd_tokens = batch * (max(1, round(gated.length.value)) + 1)  # verified: each sequence's own
    e_fast = expected_tokens(a_fast, k)
    t_draft = cost.draft_time(k)
    share_neural = cost.share_primary(k, "neural")
    hit_neural = share_neural * p + (1 - share_neural) * cost.hit_after_neural.value
    all_hit = hit_neural**batch  # one miss stalls the whole batch
    a_ngram, k_ngram = ngram[:2] if ngram is not None else (a_fast, k)
    # per sequence (NgramPlan): the batch's expected tokens and the tokens it verifies, each lookup at its length
    ngram_tokens = ngram[2] if ngram is not None and len(ngram) > 2 else batch * expected_tokens(a_ngram, k_ngram)
    ngram_verified = ngram[3] if ngram is not None and len(ngram) > 3 else None
    verified = {"sd": sd_tokens, "ngram": ngram_verified}
    t = {o: round_seconds(cost, o, batch, k_sd if o == "sd" else k, k_ngram, missed=1 - all_hit,
                          verified=verified.get(o)) * cost.calibration_factor(o) for o in OPTIONS}
    h = SWITCH_HORIZON
    backlog = cost.backlog_time(lag, lent=False)  # the draft's first forward feeds the tokens it has not seen
    lent_backlog = cost.backlog_time(lag, lent=True)  # ... in a just-in-time draft (SD, SSD's catch-up)
    catch_up = t_draft if prepared < 1.0 else 0.0  # one batched just-in-time draft for the unprepared
    share_fast = cost.share_primary(k, "fast")
    steady_fast = share_fast * e_sd + (1 - share_fast) * e_fast  # tokens per sequence and round
    first_fast = prepared * steady_fast + (1 - prepared) * e_fast  # the unprepared draft by lookup
    # the later feed of one token: the draft's first forward feeds every sequence's backlog, its cost growing with
    # their total
    unfed_token = cost.backlog_time(1, lent=True) if unfed else 0.0

    def spread(tokens_per_round: float) -> float:  # rounds the backlog is spread over
        return max(h, horizon / tokens_per_round) if horizon else h

    scores = {
        "ar": t["ar"] / batch + unfed_token,
        "sd": (t["sd"] + lent_backlog / spread(e_sd_len)) / (batch * e_sd_len),
        "ssd_neural": (t["ssd_neural"] + catch_up / h + lent_backlog / spread(e_sd)) / (batch * e_sd),
        "ssd_fast": (h * t["ssd_fast"] + backlog * h / spread(steady_fast))
        / (batch * (first_fast + (h - 1) * steady_fast)),
        "ngram": t["ngram"] / ngram_tokens + unfed_token,
    }
    best = min((o for o in OPTIONS if o in allowed), key=lambda o: scores[o])
    if current == "sd" and best != "sd" and "sd" in allowed and scores[best] > SD_STAY_MARGIN * scores["sd"]:
        best = "sd"
    if current in allowed and current.startswith("ssd") and prepared >= 1.0 and not best.startswith("ssd"):
        stay = min((o for o in OPTIONS if o in allowed and o.startswith("ssd")), key=lambda o: scores[o])
        if scores[best] > SWITCH_MARGIN * scores[stay]:
            best = stay
    return best, scores
