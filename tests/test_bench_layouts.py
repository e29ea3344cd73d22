"""benchmarks/layouts.py: the cores each mode gets, and the summary over engines."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from layouts import main, placement, summarize  # noqa: E402


def test_ssd_and_auto_split_the_cores_the_others_share_them():
    assert placement("ssd", [0, 1]) == placement("auto", [0, 1]) == {"target_cores": [0], "draft_cores": [1]}
    assert placement("sd", [0, 1]) == placement("ar", [0, 1]) == {"target_cores": [0, 1], "draft_cores": [0, 1]}


def _run(rate, draft_ms, verify_ms, tokens):
    return {"decode_tokens_per_s": rate, "draft_ms_per_round": draft_ms, "verify_ms_per_round": verify_ms,
            "token_ids": tokens}


def test_summary_takes_medians_per_layout_and_checks_the_outputs():
    runs = {"in-process": [_run(70.0, 30.0, 35.0, [[1, 2]]), _run(80.0, 32.0, 33.0, [[1, 2]]),
                           _run(75.0, 31.0, 34.0, [[1, 2]])],
            "ray": [_run(60.0, 35.0, 40.0, [[1, 2]])]}
    summary, same = summarize(runs)
    assert same
    assert summary["in-process"] == {"decode_tokens_per_s": 75.0, "draft_ms_per_round": 31.0,
                                     "verify_ms_per_round": 34.0}
    assert summary["ray"]["decode_tokens_per_s"] == 60.0
    runs["ray"].append(_run(61.0, 35.0, 40.0, [[1, 3]]))
    assert summarize(runs)[1] is False


@pytest.mark.parametrize("bad", [["--passes", "0"], ["--rounds", "0"], ["--layouts", "ray,grpc"]])
def test_passes_and_rounds_must_be_positive(bad):
    with pytest.raises(SystemExit):
        main(bad)

