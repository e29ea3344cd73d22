"""benchmarks/bench.py: greedy runs are checked token for token against AR at the same placement."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench  # noqa: E402


def run(mode: str, placement: str, ids: list[list[int]], temperature: float = 0.0, system: str = "ssd") -> dict:
    return {"system": system, "mode": mode, "placement": placement, "temperature": temperature, "batch": 1,
            "prompts": {"humaneval": {"token_ids": ids}}}


def test_counts_outputs_equal_to_ar_at_the_same_placement():
    results = {"runs": [
        run("ar", "a", [[1, 2], [3, 4]]),
        run("ar", "b", [[1, 2], [3, 5]]),
        run("sd", "a", [[1, 2], [3, 4]]),
        run("ssd", "a", [[1, 2], [3, 9]]),
        run("auto", "b", [[1, 2], [3, 4]]),
    ]}
    bench.mark_same_as_ar(results)
    got = [r["prompts"]["humaneval"].get("same_as_ar") for r in results["runs"]]
    assert got == [None, None, "2/2", "1/2", "1/2"]


def test_sampled_runs_and_runs_without_ar_are_left_unmarked():
    results = {"runs": [run("ar", "a", [[1]]), run("sd", "a", [[2]], temperature=0.7), run("sd", "b", [[1]])]}
    bench.mark_same_as_ar(results)
    assert all("same_as_ar" not in r["prompts"]["humaneval"] for r in results["runs"])
