"""benchmarks/kernel_ab.py: the base kernels from a folder or a git revision, and the random-layer A/B."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kernel_ab import ROOT, attention_ab, base_library, layers_ab  # noqa: E402

from ssd.kernels import cpu as qk  # noqa: E402

pytestmark = pytest.mark.skipif(not qk.available(), reason=str(qk.unavailable_reason()))
KERNELS = Path(qk.__file__).parent


def in_git_checkout() -> bool:
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    return proc.returncode == 0


def test_base_from_a_folder_or_a_revision_and_clear_errors(tmp_path):
    assert base_library(str(KERNELS)) is not None
    with pytest.raises(SystemExit, match="has no qgemm.cpp"):
        base_library(str(tmp_path))
    with pytest.raises(SystemExit, match="neither a folder nor a revision"):
        base_library("no-such-revision-anywhere")
    if in_git_checkout():  # a clean clone (CI) has HEAD; HEAD's sources build like any other
        assert base_library("HEAD") is not None


def test_use_routes_every_kernel_call_and_resets():
    lib = qk.load(qk.isa(), KERNELS)
    default = qk._require()
    try:
        qk.use(lib)
        assert qk._require() is lib
    finally:
        qk.use(None)
    assert qk._require() is default


def test_layers_ab_times_each_format_and_compares_bits():
    lib = qk.load(qk.isa(), KERNELS)
    table = layers_ab({"base": lib, "new": lib}, ["q4", "q6"], k=256, n=16, count=2, rows=[1, 3], rounds=1)
    assert [(r["format"], r["rows"]) for r in table] == [("q4", 1), ("q4", 3), ("q6", 1), ("q6", 3)]
    for r in table:
        assert r["same_bits"] == {"base": True, "new": True}  # one library: the same bits
        for name in ("base", "new"):
            want = r["rows"] * 256 * 16 * 2 / (r["ms"][name] / 1e3) / 1e9  # rows x K x N x layers per call
            assert r["ms"][name] > 0 and r["gmac_s"][name] == pytest.approx(want, rel=0.05, abs=0.1)
    assert qk._override is None  # the default library is back


def test_attention_ab_times_each_row_count_and_compares_bits():
    lib = qk.load(qk.isa(), KERNELS)
    table = attention_ab({"base": lib, "new": lib}, heads=4, kv_heads=2, head_dim=16, layers=2, context=20,
                         rows=[1, 3], rounds=1)
    assert [r["rows"] for r in table] == [1, 3]
    for r in table:
        assert r["same_bits"] == {"base": True, "new": True} and all(ms > 0 for ms in r["ms"].values())
    assert qk._override is None
