"""benchmarks/linears.py: how it groups a model's quantised layers and what it reports per group."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from linears import layer_bytes, linear_groups, measure  # noqa: E402
from tiny_models import random_model  # noqa: E402

from ssd.kernels import cpu as qk  # noqa: E402
from ssd.workers.models.quant import quantize_model  # noqa: E402

pytestmark = pytest.mark.skipif(not qk.available(), reason=str(qk.unavailable_reason()))


def test_groups_cover_every_block_layer_and_report_rates():
    model = quantize_model(random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=3), "w4a8")
    groups = linear_groups(model)
    layers = [m for m in model.modules() if hasattr(m, "scale_bits")]
    assert sum(len(g) for g in groups.values()) == len(layers)  # each block layer in exactly one group
    assert ("W8A8Linear", "lm_head", 64, 64) in groups  # the head keeps 8 bits
    for (cls, _, k, n), mods in groups.items():
        assert all(type(m).__name__ == cls and (m.in_features, m.out_features) == (k, n) for m in mods)
    rows = measure(model, [1, 3], reps=2)
    assert len(rows) == len(groups)
    for r in rows:
        mods = groups[(r["class"], r["layer"], r["in"], r["out"])]
        assert r["count"] == len(mods) and r["mb"] == round(sum(map(layer_bytes, mods)) / 1e6, 2)
        for m, c in r["by_rows"].items():
            # rates follow from the time: m rows x in x out multiply-adds per layer
            want = int(m) * r["in"] * r["out"] * r["count"] / (c["ms"] / 1e3) / 1e9
            assert c["ms"] > 0 and c["gmac_s"] == pytest.approx(want, rel=0.05, abs=0.1)
