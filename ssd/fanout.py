"""Saguaro geometric fan-out: how many candidate outcomes to prepare for each accepted length k.

With budget B = sum_k F_k, draft acceptance rate a and cache misses modelled as
1 - p_hit(F) = F^(-r) (ssd-algorithm.md 3a):
    F_k = F_0 * a^(k/(1+r))                         k < K
    F_K = F_0 * a^(K/(1+r)) * (1-a)^(-1/(1+r))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ssd.policy import RateEma, acceptance_counts


def round_keep_sum(x: list[float], total: int) -> list[int]:
    """Largest-remainder rounding: integers within 1 of x that sum exactly to `total`."""
    floors = [math.floor(v) for v in x]
    short = total - sum(floors)
    order = sorted(range(len(x)), key=lambda i: (-(x[i] - floors[i]), i))
    for i in order[:short]:
        floors[i] += 1
    return floors


def geometric_weights(a: float, r: float, K: int) -> list[float]:
    a = min(max(a, 1e-3), 1 - 1e-3)
    e = 1.0 / (1.0 + r)
    w = [a ** (k * e) for k in range(K)]
    w.append(a ** (K * e) * (1 - a) ** (-e))
    return w


def geometric_fanout(a: float, r: float, K: int, B: int) -> list[int]:
    """F_0..F_K (K + 1 entries) summing to B."""
    w = geometric_weights(a, r, K)
    f0 = B / sum(w)
    return round_keep_sum([f0 * v for v in w], B)


def uniform_fanout(K: int, B: int) -> list[int]:
    return round_keep_sum([B / (K + 1)] * (K + 1), B)


def outcome_probs(a: float, K: int) -> list[float]:
    """P(k accepted) for k = 0..K under an i.i.d. per-token acceptance rate a."""
    return [a**k * (1 - a) for k in range(K)] + [a**K]


def expected_hit_rate(fanout: list[int], a: float, r: float) -> float:
    """Model hit probability: sum_k P(k) * (1 - F_k^-r) (F_k = 0 never hits)."""
    return sum(p * (1 - f ** (-r)) for p, f in zip(outcome_probs(a, len(fanout) - 1), fanout) if f > 0)


@dataclass
class FanoutPlanner:
    """Chooses F_0..F_K per round from online estimates of a (per request) and r (global).

    Separate acceptance estimates after a primary (cache-hit) speculation and after a backup one,
    since their acceptance differs; r is fitted from observed hit rates per (F) value.
    """

    K: int
    B: int
    kind: str = "geometric"  # or "uniform"
    explicit: list[int] | None = None
    r_default: float = 1.0
    a_default: float = 0.7
    ema: float = 0.2
    _a: dict[tuple[int, str], RateEma] = field(default_factory=dict)
    _hit_obs: dict[int, list[int]] = field(default_factory=dict)  # F -> [hits, total]

    def __post_init__(self) -> None:
        if self.explicit is not None and len(self.explicit) != self.K + 1:
            raise ValueError(f"an explicit fan-out needs K + 1 = {self.K + 1} entries, got {len(self.explicit)}")

    def acceptance(self, seq_id: int, source: str) -> float:
        ema = self._a.get((seq_id, source), self._a.get((-1, source)))
        return self.a_default if ema is None else ema.value

    def observe_round(self, seq_id: int, source: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        counts = acceptance_counts(drafted, accepted)  # pooled over rounds: accepted tokens / trials
        for key in ((seq_id, source), (-1, source)):
            self._a.setdefault(key, RateEma(self.a_default, self.ema)).update(*counts)

    def observe_hit(self, fanout_at_k: int, hit: bool) -> None:
        if fanout_at_k <= 0:
            return
        h = self._hit_obs.setdefault(fanout_at_k, [0, 0])
        h[0] += int(hit)
        h[1] += 1

    @property
    def r(self) -> float:
        """Fit 1 - p_hit(F) = F^-r: pooled least squares of log(miss) on -log(F) through the origin."""
        num = den = 0.0
        for f, (hits, total) in self._hit_obs.items():
            if f < 2 or total < 8:
                continue
            miss = max(1 - hits / total, 0.5 / total)
            lf = math.log(f)
            num += total * (-math.log(miss)) * lf
            den += total * lf * lf
        if den == 0:
            return self.r_default
        return min(max(num / den, 0.1), 8.0)

    def forget(self, seq_id: int) -> None:
        for key in [k for k in self._a if k[0] == seq_id]:
            del self._a[key]

    def plan(self, seq_id: int, source: str, k: int | None = None) -> list[int]:
        """F_0..F_K; with `k` (a draft of another length than K) F_0..F_k, the budget scaled to k + 1 positions."""
        if self.explicit is not None:
            return list(self.explicit)
        K, B = self.K, self.B
        if k is not None and k != K:
            K, B = k, max(1, round(B * (k + 1) / (K + 1)))
        if self.kind == "uniform":
            return uniform_fanout(K, B)
        return geometric_fanout(self.acceptance(seq_id, source), self.r, K, B)
