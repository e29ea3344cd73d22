"""The SSD coordinator's estimates learn from the right samples: n-gram acceptance by the verified draft's
match, SD's calibration from rounds that drafted, no Saguaro drafts where no speculation follows, and no
next draft for a request that ends this round."""

import pytest
from test_ssd_engine import cycle_policy
from tiny_models import random_model

from ssd import LLM, SamplingParams


def test_ngram_acceptance_is_filed_under_the_verified_drafts_match(monkeypatch):
    """A miss's fast backup looks up the next draft during the round; the round's own n-gram draft must be
    scored under the suffix length it matched, not the next lookup's."""
    import ssd.modes.ssd as ssd_mode
    from ssd.policy import CostModel

    expected: list[tuple[int, int, int]] = []
    seen: list[tuple[int, int, int]] = []
    shadow_depth: list[int] = []
    ssd_round = ssd_mode.SSDMode._ssd_round

    def spy_round(self, seqs, drafts, q_draft, sources, neural):
        matches = [self._match.get(s.seq_id) for s in seqs]  # as they were when the drafts were made
        outcomes = ssd_round(self, seqs, drafts, q_draft, sources, neural)
        expected.extend((m, len(d.tokens), o.num_accepted) for m, d, o in zip(matches, drafts, outcomes)
                        if d.q_kind == "point" and d.tokens)
        return outcomes

    shadow = ssd_mode.SSDMode._shadow_ngram

    def spy_shadow(self, *a):  # scores rounds the n-gram drafter did not draft: not this test's subject
        shadow_depth.append(1)
        try:
            return shadow(self, *a)
        finally:
            shadow_depth.pop()

    observe = CostModel.observe_ngram

    def spy_observe(self, match, drafted, accepted):
        if not shadow_depth:
            seen.append((match, drafted, accepted))
        return observe(self, match, drafted, accepted)

    monkeypatch.setattr(ssd_mode.SSDMode, "_ssd_round", spy_round)
    monkeypatch.setattr(ssd_mode.SSDMode, "_shadow_ngram", spy_shadow)
    monkeypatch.setattr(CostModel, "observe_ngram", spy_observe)
    target = random_model(vocab=12, layers=2, seed=3, scale=2.0)
    draft = random_model(vocab=12, layers=1, seed=9, scale=2.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 6, 1, 2, 3, 4]
    with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, backup="ngram", dtype="float32", max_batch=1,
             max_len=160, use_ray=False) as llm:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert len(expected) >= 10 and len({m for m, _, _ in expected}) >= 2, expected
    assert seen == expected


def test_sd_calibration_skips_rounds_that_verified_prepared_drafts(models, monkeypatch):
    """An `sd` choice from a ready SSD pipeline verifies the prepared drafts without a draft call: priced as an
    SD round (draft + verification) it would drag SD's calibration down."""
    import ssd.modes.ssd as ssd_mode
    from ssd.policy import CostModel

    cycle_policy(monkeypatch, ["ssd_neural", "ssd_neural", "sd", "ar", "sd"])
    drafted: list[bool] = [False]
    draft_call = ssd_mode.SSDMode._draft_call

    def spy_call(self, method, *a):
        drafted[0] = drafted[0] or method == "propose"
        return draft_call(self, method, *a)

    rnd = ssd_mode.SSDMode._round

    def spy_round(self, seqs):
        drafted[0] = False
        return rnd(self, seqs)

    calibrated: list[bool] = []  # per calibrated SD round: whether it drafted
    sd_rounds: list[bool] = []
    observe = CostModel.observe_round

    def spy_observe(self, option, predicted, seconds):
        if option == "sd":
            calibrated.append(drafted[0])
        return observe(self, option, predicted, seconds)

    record = ssd_mode.SSDMode._record

    def spy_record(self, seqs, drafts, outcomes, choice):
        if choice == "sd":
            sd_rounds.append(drafted[0])
        return record(self, seqs, drafts, outcomes, choice)

    monkeypatch.setattr(ssd_mode.SSDMode, "_draft_call", spy_call)
    monkeypatch.setattr(ssd_mode.SSDMode, "_round", spy_round)
    monkeypatch.setattr(ssd_mode.SSDMode, "_record", spy_record)
    monkeypatch.setattr(CostModel, "observe_round", spy_observe)
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8, dtype="float32", max_batch=1, max_len=160,
             use_ray=False) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert True in sd_rounds and False in sd_rounds, sd_rounds  # both kinds of SD round ran
    assert calibrated and all(calibrated) and len(calibrated) == sd_rounds.count(True), (calibrated, sd_rounds)


def test_sd_rounds_draft_without_saguaro(models, monkeypatch):
    """Saguaro sampling trades the draft's acceptance for hits of the outcome cache; an SD round has none to
    fill, so its drafts take no fan-out. Neural drafts that an SSD round speculates on do."""
    import ssd.modes.ssd as ssd_mode

    cycle_policy(monkeypatch, ["sd", "ar", "ssd_neural", "ar"])
    asks: list[tuple[str, list[list[int]] | None]] = []  # (the round's choice, its just-in-time draft's fan-out)
    draft_call = ssd_mode.SSDMode._draft_call

    def spy_call(self, method, *a):
        if method == "propose":
            asks.append((self.last_choice, a[1]))
        return draft_call(self, method, *a)

    monkeypatch.setattr(ssd_mode.SSDMode, "_draft_call", spy_call)
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=i, ignore_eos=True) for i in range(3)]
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8, saguaro_c=0.5, dtype="float32", max_batch=3,
             max_len=96, use_ray=False) as llm:
        llm.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], params)
    assert {c for c, _ in asks} == {"sd", "ssd_neural"}, asks
    for c, fo in asks:
        assert (fo is None) == (c == "sd"), (c, fo)


def test_no_next_draft_for_a_request_that_stops_this_round(models, monkeypatch):
    """A round that emits a stop id ends its request: resolve asks for no next draft (k_next 0), so a miss
    drafts nothing just in time for it."""
    from ssd.workers.draft_worker import DraftWorker

    with LLM(target=models[0], mode="ar", dtype="float32", max_batch=1, max_len=160) as llm:
        full = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    stop = full[20]
    asks: list[tuple[list[int], int]] = []  # (emitted, k_next) per resolved sequence
    resolve = DraftWorker.resolve

    def spy_resolve(self, outcomes, neural_backup, fanout=None, borrow=False):
        asks.extend((list(o[2]), o[3]) for o in outcomes)
        return resolve(self, outcomes, neural_backup, fanout, borrow)

    monkeypatch.setattr(DraftWorker, "resolve", spy_resolve)
    with LLM(target=models[0], draft=models[1], mode="ssd", k=4, fanout=10, backup="neural", dtype="float32",
             max_batch=1,
             max_len=160, use_ray=False) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[: full.index(stop) + 1]
    assert asks and any(stop in emitted for emitted, _ in asks)
    for emitted, k_next in asks:
        assert (k_next == 0) == (stop in emitted), asks


def test_draft_keeps_its_context_through_ar_rounds(models, monkeypatch):
    """Without core loans, `auto`'s AR rounds commit to the draft ahead of time (feed_ahead); no committed
    token may be lost there: with draft == target every SD draft after them is accepted whole."""
    cycle_policy(monkeypatch, ["ar", "ar", "ar", "sd"])
    prompts = [[1, 2, 3, 4], [7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    with LLM(target=models[0], draft=models[0], mode="auto", k=3, fanout=8, core_loans=False, use_ray=False,
             dtype="float32",
             max_batch=3, max_len=128) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        st = llm.stats()
    assert st["policy"].get("sd", 0) >= 3 and st["policy"].get("ar", 0) >= 9, st["policy"]
    assert st["drafted_tokens"] > 0 and st["acceptance_rate"] == 1.0


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_drafts_stop_one_token_short_of_max_tokens(models, mode):
    """A round emits at most its draft + 1 tokens, so a draft never runs to max_tokens: a token drafted there
    would be verified only to be cut, and counted in the acceptance statistics."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(target=models[0], draft=models[0], mode=mode, k=4, fanout=10, dtype="float32", max_batch=4, max_len=64,
             use_ray=False) as llm:
        outs = llm.generate([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], params)
    for o in outs:  # draft == target: every drafted token accepted, so each round emits its draft + 1, none cut
        m = o.metrics
        assert len(o.token_ids) == 3 and m["accepted_tokens"] == m["drafted_tokens"] > 0, m
        assert m["emitted_tokens"] == m["drafted_tokens"] + m["rounds"], m


def test_outcome_cache_counts_a_too_short_entry_as_the_miss_it_is():
    """An entry drafted for a smaller K than the next round's is not used (resolve drafts afresh): the cache's
    own per-k statistics count it as a miss, as the coordinator does."""
    from ssd.cache.outcome_cache import CacheEntry, OutcomeCache

    cache = OutcomeCache()
    entry = CacheEntry(tokens=[4, 5], q=None, path=[0, 1, 2])
    cache.fill(7, round_id=3, entries={(1, 9): entry})
    assert cache.lookup(7, 3, 1, 9, min_len=3) is None
    cache.fill(7, round_id=3, entries={(1, 9): entry})
    assert cache.lookup(7, 3, 1, 9, min_len=2) is entry
    assert cache.lookup(7, 4, 1, 9) is None  # only the round filled last is held
    assert (dict(cache.hits), dict(cache.misses)) == ({1: 1}, {1: 2})
