"""benchmarks/alternate.py: the side-by-side timing kernel_ab.py and huge_pages.py share."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import alternate  # noqa: E402
from tiny_models import random_model  # noqa: E402


def test_alternates_variants_and_compares_their_logits(capsys):
    model = random_model(vocab=6000)  # the prefilled prompt uses token ids up to ~5100
    entered: list[str] = []
    variants = {}
    for name, m in (("a", model), ("b", copy.deepcopy(model)), ("c", random_model(vocab=6000, seed=1))):
        v = alternate.prefilled(m, longest=8)
        v.enter = lambda name=name: entered.append(name)
        variants[name] = v
    spent, logits = alternate.alternate(variants, threads=[1], ns=[1, 8], rounds=2)
    assert entered == ["a", "b", "c", "a", "b", "c", "c", "b", "a", "c", "b", "a"]  # order flips each round
    assert set(spent) == {(v, 1, n) for v in "abc" for n in (1, 8)} and all(s > 0 for s in spent.values())
    assert logits[("a", 8)].shape == (1, 8, 6000) and logits[("a", 1)].shape == (1, 6000)
    rows, same = alternate.report(spent, logits, "a", "b", [1], [1, 8])
    assert same == {1: True, 8: True}  # the same weights give the same bits
    assert [(r["threads"], r["n"]) for r in rows] == [(1, 1), (1, 8)]
    assert rows[1]["ratio"] == round(spent[("b", 1, 8)] / spent[("a", 1, 8)], 3)
    assert "t(8)/t(1)" in capsys.readouterr().out
    _, same = alternate.report(spent, logits, "a", "c", [1], [1, 8])
    assert same == {1: False, 8: False}  # other weights are told apart
