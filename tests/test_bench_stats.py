"""benchmarks/bench.py: each prompt set's share of the engine's cumulative statistics."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench import split_delta  # noqa: E402


def test_split_delta_keeps_this_runs_rounds_only():
    before = {"primary": {"hits": 5, "misses": 2}, "fast": {"hits": 1, "misses": 1}}
    after = {"primary": {"hits": 9, "misses": 2}, "fast": {"hits": 1, "misses": 1}, "neural": {"hits": 0, "misses": 3}}
    # "fast" saw no round in this run; "neural" is new since `before`
    assert split_delta(before, after) == {"primary": {"hits": 4, "misses": 0}, "neural": {"hits": 0, "misses": 3}}
    assert split_delta({}, {}) == {}
