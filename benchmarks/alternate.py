"""Two variants of one model's forward timed side by side in one process (kernel_ab.py, huge_pages.py).

Sequential runs drift by 5-10 % on a shared machine; here every round times the same forwards with each
variant in turn, in alternating order, so drift hits both alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ssd.workers.model_runner import ModelRunner

CACHE = 200  # tokens in the KV cache before each timed forward


@dataclass
class Variant:
    runner: ModelRunner
    slot: int
    enter: Callable[[], None] = field(default=lambda: None)  # switch to this variant (e.g. a kernel library)


def prefilled(model: torch.nn.Module, longest: int) -> Variant:
    """A one-slot runner for `model` with CACHE tokens in its cache and room for `longest` more."""
    runner = ModelRunner(model, max_slots=1, max_len=CACHE + longest + 8)
    slot = runner.allocate()
    runner.forward([slot], [[(i * 7919) % 5000 + 100 for i in range(CACHE)]], last_only=True)
    return Variant(runner, slot)


def alternate(variants: dict[str, Variant], threads: list[int], ns: list[int], rounds: int
              ) -> tuple[dict[tuple[str, int, int], float], dict[tuple[str, int], torch.Tensor]]:
    """Median seconds per forward for each (variant, threads, n) and each variant's last logits per n.
    Each switch runs 4 forwards and counts the last 3 (the first warms caches)."""
    spent: dict[tuple[str, int, int], list[float]] = {(v, t, n): [] for v in variants for t in threads for n in ns}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    names = list(variants)
    for r in range(rounds):
        for t in threads:
            torch.set_num_threads(t)
            for n in ns:
                for name in names if r % 2 == 0 else names[::-1]:
                    v = variants[name]
                    v.enter()
                    for rep in range(4):
                        t0 = time.perf_counter()
                        logits[(name, n)] = v.runner.forward([v.slot], [[100 + i for i in range(n)]], last_only=n == 1)
                        dt = time.perf_counter() - t0
                        v.runner.truncate(v.slot, CACHE)
                        if rep > 0:
                            spent[(name, t, n)].append(dt)
    return {k: statistics.median(ts) for k, ts in spent.items()}, logits


def report(spent: dict[tuple[str, int, int], float], logits: dict[tuple[str, int], torch.Tensor],
           base: str, other: str, threads: list[int], ns: list[int]) -> tuple[list[dict], dict[int, bool]]:
    """Prints ms per forward of `base` and `other` and their ratio, t(8) / t(1) where both were timed, and
    whether the two gave the same logits; returns the rows and that comparison."""
    rows = []
    print(f"{'threads':>7} {'n':>3} {base:>8} {other:>8} {other + '/' + base:>12}")
    for t in threads:
        for n in ns:
            a, b = spent[(base, t, n)] * 1e3, spent[(other, t, n)] * 1e3
            rows.append(dict(threads=t, n=n, **{f"{base}_ms": round(a, 2), f"{other}_ms": round(b, 2)},
                             ratio=round(b / a, 3)))
            print(f"{t:>7} {n:>3} {a:>8.1f} {b:>8.1f} {b / a:>12.3f}")
    if 1 in ns and 8 in ns:
        for t in threads:
            r = {v: spent[(v, t, 8)] / spent[(v, t, 1)] for v in (base, other)}
            print(f"threads {t}: t(8)/t(1) {base} {r[base]:.2f}, {other} {r[other]:.2f}")
    same = {n: bool(torch.equal(logits[(base, n)], logits[(other, n)])) for n in ns}
    print("same logits: " + ", ".join(f"n={n}: {s}" for n, s in same.items()))
    return rows, same
