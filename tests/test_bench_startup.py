"""benchmarks/startup.py: the timing wrapper it puts around the start-up's stages."""

import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from startup import timed  # noqa: E402


def test_timed_records_each_call_and_passes_results_and_errors_through():
    def stage(x, fail=False):
        time.sleep(0.01)
        if fail:
            raise RuntimeError("stage failed")
        return 2 * x

    module = types.SimpleNamespace(stage=stage)
    spent: dict[str, float] = {}
    timed(module, "stage", spent)
    assert module.stage(21) == 42 and spent["stage"] >= 0.01
    spent.clear()
    with pytest.raises(RuntimeError, match="stage failed"):
        module.stage(1, fail=True)
    assert spent["stage"] >= 0.01  # a failing stage's time counts too
