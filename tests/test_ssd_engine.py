"""SSD (Saguaro): greedy equality with AR for every backup, hits, tau, fan-out, outcome cache."""

import pytest
from tiny_models import GREEDY, PROMPTS, random_model

from ssd import LLM, SamplingParams


@pytest.mark.parametrize("backup", ["neural", "ngram", "random", "auto"])
@pytest.mark.parametrize("k", [1, 4])
def test_ssd_greedy_equals_ar(models, ar_outputs, backup, k):
    with LLM(
        target=models[0], draft=models[1], mode="ssd", k=k, fanout=2 * (k + 1), backup=backup, dtype="float32",
        max_batch=3, max_len=128
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        st = llm.stats()
        assert st["cache_hits_per_k"] or st["cache_misses_per_k"]
        totals = (sum(st["cache_hits_per_k"].values()), sum(st["cache_misses_per_k"].values()))
        for split in ("cache_by_source", "cache_by_budget"):  # the same rounds, split another way
            assert tuple(sum(v[w] for v in st[split].values()) for w in ("hits", "misses")) == totals, st
        # what the verified speculations came from: the cache, or this backup kind
        backups = {"neural": {"neural"}, "ngram": {"fast"}, "random": {"fast"}, "auto": {"neural", "fast"}}[backup]
        assert set(st["cache_by_source"]) <= {"primary"} | backups, st
        assert all(isinstance(b, int) and b >= 1 for b in st["cache_by_budget"]), st
        wait = st["ssd_wait_s"]  # the SSD rounds' waits: a part of draft_s, split by cause
        assert set(wait) <= {"overrun", "backup", "other"} and all(v >= 0 for v in wait.values())
        assert 0 < sum(wait.values()) <= st["draft_s"] + 1e-9
        if backup == "neural":  # a different draft misses, and its misses draft just in time
            assert wait.get("backup", 0) > 0 and st["cache_misses_per_k"]


def test_ssd_auto_mode_greedy_equals_ar(models, ar_outputs):
    with LLM(target=models[0], draft=models[1], dtype="float32", max_batch=4, max_len=128) as llm:
        assert llm.config.mode == "auto"
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        assert sum(llm.stats()["policy"].values()) == llm.stats()["rounds"]


def cycle_policy(monkeypatch, order):
    """Force mode="auto"'s per-round choice through `order`, round after round."""
    import itertools

    import ssd.modes.ssd as ssd_mode

    it = itertools.cycle(order)
    monkeypatch.setattr(
        ssd_mode, "choose",
        lambda cost, batch, k, allowed, ngram=None, prepared=1.0, current=None, lag=0, k_sd=None, horizon=None,
        unfed=False: (
            next(it), dict.fromkeys(allowed, 1.0)
        ),
    )


def force_ngram_speculation(monkeypatch, on: bool) -> list[int]:
    """Make n-gram rounds speculate (SSD rounds on n-gram drafts) or not; returns a log of the asks."""
    import ssd.modes.ssd as ssd_mode

    asked: list[int] = []
    monkeypatch.setattr(ssd_mode.SSDMode, "_speculate_on_ngram", lambda self, drafts: (asked.append(1), on)[1])
    return asked


@pytest.mark.parametrize("ngram_speculates", [False, True])
def test_auto_switching_through_every_option_greedy_equals_ar(models, ar_outputs, monkeypatch, ngram_speculates):
    """Every option of the policy, n-gram SD included, and every switch between them keeps greedy == AR."""
    cycle_policy(monkeypatch, ["ssd_neural", "ngram", "ssd_fast", "sd", "ngram", "ar", "ssd_neural", "sd"])
    asked = force_ngram_speculation(monkeypatch, ngram_speculates)
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8, dtype="float32", max_batch=4,
             max_len=128) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        policy = llm.stats()["policy"]
    assert all(policy.get(o, 0) > 0 for o in ("ssd_neural", "ssd_fast", "sd", "ngram", "ar")), policy
    assert len(asked) >= policy["ngram"]


@pytest.mark.parametrize("speculates", [True, False])
def test_ngram_rounds_speculate_and_hit(models, monkeypatch, speculates):
    """n-gram rounds that speculate leave a prepared neural draft: with draft == target (greedy) the
    neural round after an n-gram round takes it from the cache instead of drafting just in time."""
    from ssd.workers.draft_worker import DraftWorker

    cycle_policy(monkeypatch, ["ngram", "ssd_neural"])
    force_ngram_speculation(monkeypatch, speculates)
    proposes: list[int] = []
    propose = DraftWorker.propose
    monkeypatch.setattr(DraftWorker, "propose", lambda self, *a, **kw: (proposes.append(1), propose(self, *a, **kw))[1])
    prompt = [5, 6, 7, 8] * 4  # the lookup always matches
    with LLM(target=models[0], mode="ar", dtype="float32", max_batch=1, max_len=160) as llm:
        want = llm.generate([prompt], GREEDY)[0].token_ids
    with LLM(target=models[0], draft=models[0], mode="auto", k=3, fanout=[1, 1, 1, 1], dtype="float32", use_ray=False,
             max_batch=1, max_len=160) as llm:
        out = llm.generate([prompt], GREEDY)[0]
        st = llm.stats()
    assert out.token_ids == want
    neural_rounds = st["policy"]["ssd_neural"]
    assert st["policy"]["ngram"] >= 3 and neural_rounds >= 3, st
    if speculates:  # only the first round drafts just in time
        assert len(proposes) <= 1 and sum(st["cache_hits_per_k"].values()) >= neural_rounds, st
    else:
        assert len(proposes) >= neural_rounds


def test_draft_equal_to_target_hits_every_round(models):
    k = 4
    with LLM(
        target=models[0], draft=models[0], mode="ssd", k=k, fanout=2 * (k + 1), backup="neural", dtype="float32",
        max_batch=2,
        max_len=160,
    ) as llm:
        n_rounds = 6
        sp = SamplingParams(temperature=0, max_tokens=n_rounds * (k + 1), ignore_eos=True)
        out = llm.generate([[5, 6, 7]], sp)[0]
        m = out.metrics
        assert m["rounds"] == n_rounds
        assert m["tau"] == k + 1
        # every outcome was predicted (k = K, t* = bonus): rounds 2.. came from the outcome cache
        assert m["cache_misses"] == 0 and m["cache_hits"] == n_rounds
        assert set(llm.stats()["cache_hits_per_k"]) == {k}
        # the first draft is the draft's own too, so every verified speculation counts as primary
        assert llm.stats()["cache_by_source"] == {"primary": {"hits": n_rounds, "misses": 0}}
        assert llm.stats()["ssd_wait_s"].get("backup", 0) == 0  # no miss, so no just-in-time draft


def test_ssd_seeded_sampling_reproducible_in_any_batch(models):
    sp = SamplingParams(temperature=0.9, max_tokens=12, seed=99, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=9, seed=5, ignore_eos=True)
    with LLM(
        target=models[0], draft=models[1], mode="ssd", k=3, fanout=8, backup="neural", dtype="float32", max_batch=4,
        max_len=128,
    ) as llm:
        alone = llm.generate([[1, 2]], sp)[0].token_ids
        batch = llm.generate([[4], [1, 2], [9, 9, 9]], [other, sp, other])
        assert batch[1].token_ids == alone


@pytest.mark.parametrize("fanout", [[1, 1, 1, 1, 1], 12])
def test_ssd_explicit_and_budget_fanout(models, ar_outputs, fanout):
    with LLM(
        target=models[0], draft=models[1], mode="ssd", k=4, fanout=fanout, backup="ngram", dtype="float32",
        max_batch=4, max_len=160,
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs


def test_ngram_rounds_speculate_only_on_short_drafts_that_fit(models):
    from ssd.policy import Ema, VerifyLine
    from ssd.workers.messages import Draft

    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8,
             dtype="float32", max_batch=2, max_len=64, use_ray=False) as llm:
        mode = llm.engine.mode
        mode.cost.verify = VerifyLine(Ema(0.1), Ema(0.02))  # verifying n tokens: 0.1 + 0.02 n seconds
        short, long = [Draft(seq_id=0, tokens=[1, 2, 3])], [Draft(seq_id=0, tokens=[1] * 4)]
        mode.cost.speculate = Ema(0.15)
        assert mode._speculate_on_ngram(short) and not mode._speculate_on_ngram(long)  # longer than K
        mode.cost.speculate = Ema(0.2)  # more than verifying 4 tokens (0.18 s)
        assert not mode._speculate_on_ngram(short)
        assert mode._speculate_on_ngram([Draft(seq_id=0, tokens=[1, 2]), Draft(seq_id=1, tokens=[3, 4, 5])])


def test_greedy_hits_take_the_shipped_draft_without_waiting_for_resolve(models, monkeypatch):
    """Where every sequence hits, the coordinator finds the next draft among those speculate shipped and
    sends resolve without waiting for it; the draft's next reply is checked against what it took."""
    from ssd.modes.ssd import SSDMode

    settled: list[bool] = []
    real = SSDMode._settle_resolve

    def spy(self):
        settled.append(self._pending is not None)
        real(self)

    monkeypatch.setattr(SSDMode, "_settle_resolve", spy)
    with LLM(target=models[0], draft=models[0], mode="ssd", k=3, fanout=8, backup="neural", dtype="float32",
             max_batch=2, max_len=160) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    m = out.metrics
    assert m["cache_misses"] == 0 and m["rounds"] == 6
    assert sum(settled) == m["rounds"] - 1  # every round's resolve unwaited, checked in the next (not the last)


def test_a_resolve_that_disagrees_with_the_shipped_drafts_loses_the_draft():
    """The coordinator took drafts the draft's cache does not hold: the draft is out of step, so it counts as
    lost (WorkerDied: rounds go on without it while a fresh one replaces it)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from ssd.handles import WorkerDied
    from ssd.modes.ssd import SSDMode
    from ssd.workers.draft_worker import Resolution
    from ssd.workers.messages import Draft

    mode = SSDMode.__new__(SSDMode)
    mode.draft = SimpleNamespace(name="draft")
    took: Future = Future()
    took.set_result([Resolution(1, True, Draft(seq_id=1, tokens=[4, 5]), None)])
    mode._pending = (took, [[4, 5]])
    mode._settle_resolve()
    assert mode._pending is None
    other: Future = Future()
    other.set_result([Resolution(1, True, Draft(seq_id=1, tokens=[4, 5]), None)])
    mode._pending = (other, [[4, 6]])
    with pytest.raises(WorkerDied, match="disagrees"):
        mode._settle_resolve()


@pytest.mark.parametrize("mode,kw", [
    ("sd", {"k": 3}),
    ("ssd", {"k": 3, "fanout": [2, 2, 1, 1], "backup": "neural"}),
    ("ssd", {"k": 3, "fanout": [2, 2, 1, 1], "backup": "ngram"}),
])
def test_seeded_sample_reproduces_alone_in_a_batch_and_again(mode, kw):
    """With K, the fan-out and the backup fixed, a seeded request's draws do not depend on its neighbours
    or the engine's history (docs/architecture.md: adaptive schedules fix the draws, not the sample)."""
    target = random_model(vocab=40, layers=2, seed=3, scale=3.0)
    sp = SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=10, seed=9, ignore_eos=True)
    with LLM(target=target, draft=target, mode=mode, dtype="float32", max_batch=4, max_len=128, use_ray=False,
             **kw) as llm:
        alone = llm.generate([[1, 2, 3]], sp)[0].token_ids
        batch = llm.generate([[7, 7], [1, 2, 3], [9]], [other, sp, other])[1].token_ids
        again = llm.generate([[1, 2, 3]], sp)[0].token_ids
        stats = llm.stats()
    assert alone == batch == again
    if mode == "ssd":
        assert 0 < stats["cache_hit_rate"] < 1  # hits and misses both exercised
