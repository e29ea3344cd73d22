"""Auto-configuration's stored measurements: reused while one forward of each worker still matches them,
measured again when it does not, keyed by what sets them, and never in the way of a start."""

import itertools
import json
from pathlib import Path

import pytest
from test_borrow_cores import TimedHandle

from ssd import autoconfig_cache as acc
from ssd.autoconfig import autoconfigure
from ssd.config import Config


class CountingHandle(TimedHandle):
    def __init__(self, per_token: float, fixed: float) -> None:
        super().__init__(per_token, fixed)
        self.timed: list[list[int]] = []

    def call(self, method, ns=(), context=128, tree=False, reps=3, borrow=False):
        if method == "time_forwards":
            self.timed.append(list(ns))
        return super().call(method, ns, context, tree, reps, borrow)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_AUTOCONFIG_CACHE", str(tmp_path))
    return tmp_path


def measured(h: CountingHandle) -> bool:
    """A full measurement (the check times one forward, n = 1, only)."""
    return any(ns != [1] for ns in h.timed)


def start(parts, target, draft):
    return acc.cached_autoconfigure(parts, target, draft, lambda: autoconfigure(target, draft, ssd=True))


def test_a_second_start_reuses_the_measurements(cache):
    target, draft = CountingHandle(0.03, 0.05), CountingHandle(0.004, 0.02)
    first = start({"models": "a"}, target, draft)
    assert measured(target) and measured(draft) and len(list(cache.glob("*.json"))) == 1
    target2, draft2 = CountingHandle(0.03, 0.05), CountingHandle(0.004, 0.02)
    again = start({"models": "a"}, target2, draft2)
    assert again == first
    assert target2.timed == [[1]] and draft2.timed == [[1]]  # only the check: one forward each
    assert target2.released and draft2.released  # the check's timing slots go back


def test_a_machine_in_another_speed_phase_measures_again(cache):
    start({"models": "a"}, CountingHandle(0.03, 0.05), CountingHandle(0.004, 0.02))
    slower_target, draft = CountingHandle(0.03 * 1.3, 0.05 * 1.3), CountingHandle(0.004, 0.02)
    ac = start({"models": "a"}, slower_target, draft)
    assert measured(slower_target)
    assert ac.t_verify[1] == pytest.approx(1.3 * 0.08)
    entry = json.loads(next(cache.glob("*.json")).read_text())  # the entry now holds the new prices
    assert entry["check"]["target"] == pytest.approx(1.3 * 0.08)
    third_target = CountingHandle(0.03 * 1.3, 0.05 * 1.3)
    start({"models": "a"}, third_target, CountingHandle(0.004, 0.02))
    assert third_target.timed == [[1]]


def test_other_settings_are_other_entries_and_bad_entries_are_measured_over(cache):
    start({"models": "a"}, CountingHandle(0.03, 0.05), CountingHandle(0.004, 0.02))
    other = CountingHandle(0.03, 0.05)
    start({"models": "b"}, other, CountingHandle(0.004, 0.02))
    assert measured(other) and len(list(cache.glob("*.json"))) == 2
    good = json.loads(next(cache.glob("*.json")).read_text())
    shaped_wrong = [json.dumps({**good, "check": {"verify": 1.0, "draft": 1.0}}),  # a check key renamed
                    json.dumps({**good, "config": {**good["config"], "t_verify": [0.1, 0.2]}}),  # a table as a list
                    json.dumps({**good, "config": {**good["config"], "k": "4"}})]  # K as a string
    for bad in ("{not json", "[]", "null", f'{{"format": {acc.FORMAT}, "config": null, "check": null}}',
                *shaped_wrong):
        for f in cache.glob("*.json"):
            f.write_text(bad)  # truncated, or JSON of another shape
        broken = CountingHandle(0.03, 0.05)
        ac = start({"models": "a"}, broken, CountingHandle(0.004, 0.02))
        assert measured(broken) and ac.k > 0


def test_the_machine_key_sees_the_kernel_build(monkeypatch):
    monkeypatch.delenv("SSD_CPU_ISA", raising=False)
    base = acc.machine()
    monkeypatch.setenv("SSD_CPU_ISA", "avx2")
    assert acc.machine()["kernels"] != base["kernels"]  # another compiled library prices forwards differently
    assert {"cpu", "cpu_flags", "cpus"} <= set(base)
    # the key hashes the kernels' sources wherever the package lives (an installed wheel: ssd/kernels/cpu)
    import ssd.kernels.cpu as cpu_kernels

    sources = acc.kernel_sources()
    assert sources == Path(cpu_kernels.__file__).parent
    assert {"qgemm.cpp", "decoder_layer.cpp"} <= {f.name for f in sources.glob("*.cpp")}


def test_no_key_or_cache_off_always_measures(cache, monkeypatch):
    for _ in range(2):
        t = CountingHandle(0.03, 0.05)
        start(None, t, CountingHandle(0.004, 0.02))
        assert measured(t)
    assert not list(cache.glob("*.json"))
    monkeypatch.setenv("SSD_AUTOCONFIG_CACHE", "off")
    assert acc.cache_dir() is None
    for _ in range(2):
        t = CountingHandle(0.03, 0.05)
        start({"models": "a"}, t, CountingHandle(0.004, 0.02))
        assert measured(t)


def test_an_unwritable_directory_only_warns(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SSD_AUTOCONFIG_CACHE", str(blocker / "sub"))
    ac = start({"models": "a"}, CountingHandle(0.03, 0.05), CountingHandle(0.004, 0.02))
    assert ac.k > 0 and "could not store" in caplog.text


def test_the_key(tmp_path):
    """Named models key by file identity, workers by what sets their speed (not their pids); in-memory models,
    or autoconfig_cache=False, store nothing."""
    pids = itertools.count(100)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    ident = acc.model_identity(str(model))
    assert ident["size"] == 10 and ident["path"] == str(model.resolve())
    assert acc.model_identity(object()) is None and acc.model_identity(str(tmp_path / "missing")) is None
    folder = tmp_path / "hf"  # a directory's identity follows its files, rewritten in place or not
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    before = acc.model_identity(str(folder))
    (folder / "model.safetensors").write_bytes(b"x" * 20)
    assert acc.model_identity(str(folder)) != before
    info = TimedHandle(0.03, 0.05)
    info.call = lambda method, *a, **k: _done({"num_threads": 1, "pid": next(pids), "node_id": "n"})
    cfg = Config(target=str(model), draft=str(model), mode="ssd", use_ray=False)
    parts = acc.autoconfig_key(cfg, info, info, {"ssd": True})
    assert parts["models"] == [ident, ident] and parts["config"]["use_ray"] is False
    assert parts["workers"][0]["num_threads"] == 1
    assert acc.cache_key(acc.autoconfig_key(cfg, info, info, {"ssd": True})) == acc.cache_key(parts)  # new pids
    other = acc.autoconfig_key(Config(target=str(model), draft=str(model), mode="ssd", use_ray=False, draft_vocab=8),
                               info, info, {"ssd": True})
    assert acc.cache_key(other) != acc.cache_key(parts)
    off = Config(target=str(model), draft=str(model), autoconfig_cache=False)
    assert acc.autoconfig_key(off, info, info, {}) is None
    assert acc.autoconfig_key(Config(target=object(), draft=str(model)), info, info, {}) is None
    with pytest.raises(ValueError, match="autoconfig_cache"):
        Config(target="t", autoconfig_cache="yes")


def _done(value):
    from concurrent.futures import Future

    f = Future()
    f.set_result(value)
    return f


def test_an_engine_started_twice_reuses_its_measurements(tmp_path, monkeypatch, caplog):
    """End to end: two starts of the same named models and settings; the second re-times one forward per worker
    and takes the stored configuration (the same K); greedy outputs do not depend on it."""
    import logging

    from tiny_hf import write_model_dir

    from ssd import LLM, SamplingParams

    monkeypatch.setenv("SSD_AUTOCONFIG_CACHE", str(tmp_path / "store"))
    monkeypatch.setattr(acc, "TOLERANCE", 100.0)  # the tiny models' forwards take microseconds: jittery checks
    target, draft = str(write_model_dir(tmp_path / "t", seed=0)), str(write_model_dir(tmp_path / "d", seed=5))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ssd"):
            with LLM(target=target, draft=draft, mode="sd", dtype="float32", max_len=128, use_ray=False) as llm:
                runs.append((llm.config.k, llm.generate([[3, 4, 5]], sp)[0].token_ids, caplog.text))
    assert len(list((tmp_path / "store").glob("*.json"))) == 1
    assert "stored measurements" not in runs[0][2]
    assert "stored measurements reused" in runs[1][2]
    assert runs[1][0] == runs[0][0] and runs[1][1] == runs[0][1]
