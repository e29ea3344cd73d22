"""benchmarks/host_overhead.py: the kernel clock and the wall / kernel / host split it reports."""

import sys
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from host_overhead import KernelClock, measure  # noqa: E402


def test_kernel_time_is_split_from_host_time():
    def kernel(x, fail=False):
        time.sleep(0.02)
        if fail:
            raise RuntimeError("kernel failed")
        return 2 * x

    module = types.SimpleNamespace(kernel=kernel)
    clock = KernelClock(module, ("kernel", "absent"))  # a name the module lacks is skipped
    assert module.kernel(21) == 42 and clock.total >= 0.02
    with pytest.raises(RuntimeError, match="kernel failed"):
        module.kernel(1, fail=True)
    assert clock.total >= 0.04  # a failing call's time counts too

    def call():  # 20 ms in the kernel, 10 ms around it
        time.sleep(0.01)
        module.kernel(1)

    rows = measure(clock, {"call": call}, iters=3, warmup=1)["call"]
    assert rows["kernel_ms"] >= 20 and rows["host_ms"] >= 10
    assert abs(rows["wall_ms"] - rows["kernel_ms"] - rows["host_ms"]) < 5
