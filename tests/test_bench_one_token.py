"""benchmarks/one_token.py: the lean one-token path against the general forward on a tiny model."""

import sys
from pathlib import Path

import pytest
import torch
from tiny_models import random_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from one_token import compare  # noqa: E402

from ssd.kernels import cpu as cpu_kernels  # noqa: E402
from ssd.workers.models.quant import quantize_model  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def tiny():  # prefilled() feeds token ids up to 5099
    return quantize_model(random_model(vocab=5120, hidden=64, heads=4, kv_heads=2, layers=2, seed=3)
                          .to(torch.bfloat16), "w4a8")


def test_compare_times_both_paths_and_they_agree(capsys):
    model = tiny()
    rows, same = compare(model, [1], rounds=2)
    assert same == {1: True}
    assert len(rows) == 1 and rows[0]["general_ms"] > 0 and rows[0]["lean_ms"] > 0
    assert "lean/general" in capsys.readouterr().out


def test_without_the_lean_path_it_says_so(monkeypatch):
    model = tiny()
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)  # runners then have no OneTokenStep
    with pytest.raises(SystemExit, match="no OneTokenStep"):
        compare(model, [1], rounds=1)
