"""Core loans (mode="auto" on CPU): the target borrows the draft's cores in rounds where the draft idles,
the draft the target's while the target waits for a just-in-time draft."""

import os

import pytest
import torch
from test_ssd_engine import cycle_policy
from tiny_models import GREEDY, PROMPTS, random_model

from ssd import LLM
from ssd.config import Config
from ssd.launch.placement import plan_placement
from ssd.policy import CostModel, Ema, RateEma, VerifyLine, choose, expected_tokens
from ssd.workers.base import CoreLoan
from ssd.workers.draft_worker import DraftWorker
from ssd.workers.messages import Draft, SamplingSpec
from ssd.workers.target_worker import TargetWorker

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores to lend one")


@pytest.fixture
def restore_cpu_state():
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    yield
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, cores)


def watch_threads(worker) -> list[tuple[int, set[int]]]:
    """Record (torch threads, affinity) at every forward of the worker's runner."""
    seen: list[tuple[int, set[int]]] = []
    forward = worker.runner.forward

    def spy(*args, **kwargs):
        seen.append((torch.get_num_threads(), os.sched_getaffinity(0)))
        return forward(*args, **kwargs)

    worker.runner.forward = spy
    return seen


@two_cores
def test_core_loan_widens_then_restores(restore_cpu_state):
    own, spare = CORES[:1], CORES[1:2]
    loan = CoreLoan(own, spare)
    os.sched_setaffinity(0, set(own))
    torch.set_num_threads(1)
    with loan.borrowed():
        assert torch.get_num_threads() == 2 and os.sched_getaffinity(0) == set(own + spare)
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == set(own)


@pytest.mark.parametrize("own, spare", [([0], [0, 1]), ([], [1]), ([0], [])])
def test_core_loan_rejects_overlapping_or_empty_cores(own, spare):
    with pytest.raises(ValueError, match="disjoint"):
        CoreLoan(own, spare)


@two_cores
def test_borrowed_verification_runs_on_both_cores_with_the_same_bits(restore_cpu_state):
    """Verification with the draft's core borrowed runs 2 threads and scores every token with the same
    bits (the kernels split rows of outputs between threads, never a sum), so outcomes are equal."""
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=2, seed=7)
    worker = TargetWorker(model, dtype="float32", quantization="w4a8", max_slots=2, max_len=64,
                          cpu_cores=CORES[:1], spare_cores=CORES[1:2])
    seen = watch_threads(worker)
    logits = {}
    for seq_id, borrow in ((0, False), (1, True)):
        worker.add(seq_id, [3, 9, 4, 1, 7], SamplingSpec(temperature=0))
        seen.clear()
        with worker._cores(borrow):
            logits[borrow] = worker.runner.forward([worker.seqs[seq_id].slot], [[7, 2, 5, 11]])
        assert seen == [(2 if borrow else 1, set(CORES[:2] if borrow else CORES[:1]))]
    assert torch.equal(logits[False], logits[True])
    draft = [2, 5, 11]
    outs = [worker.verify([Draft(seq_id=s, tokens=draft)], borrow=b)[0] for s, b in ((0, False), (1, True))]
    assert outs[0].tokens == outs[1].tokens
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == set(CORES[:1])


@two_cores
def test_in_process_workers_compute_on_their_own_cores(models, ar_outputs, restore_cpu_state):
    """In one process each worker's calls run on its LocalHandle's thread, pinned to that worker's cores per
    call; building the workers leaves the caller's cores and thread count as they were. (Before: both
    threads kept the affinity of the thread that built the draft last, so the target ran on the draft's core.)"""
    before = os.sched_getaffinity(0), torch.get_num_threads()
    with LLM(target=models[0], draft=models[1], mode="ssd", k=3, fanout=8, dtype="float32", max_batch=4, max_len=128,
             use_ray=False, target_cores=CORES[:1], draft_cores=CORES[1:2]) as llm:
        assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
        mode = llm.engine.mode
        seen_target, seen_draft = watch_threads(mode.target.worker), watch_threads(mode.draft.worker)
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_outputs
    assert seen_target and {(n, frozenset(c)) for n, c in seen_target} == {(1, frozenset(CORES[:1]))}
    assert seen_draft and {(n, frozenset(c)) for n, c in seen_draft} == {(1, frozenset(CORES[1:2]))}


def test_borrowing_without_spare_cores_is_an_error():
    worker = TargetWorker(random_model(vocab=40, layers=1), dtype="float32", max_slots=1, max_len=32)
    worker.add(0, [1, 2, 3], SamplingSpec(temperature=0))
    with pytest.raises(ValueError, match="no cores to borrow"):
        worker.verify([Draft(seq_id=0)], borrow=True)
    assert worker.info()["borrow_threads"] == 0


def test_time_forwards_prefills_once_and_goes_round_the_token_counts():
    from ssd.workers.messages import SamplingSpec

    worker = TargetWorker(random_model(vocab=40, layers=1), dtype="float32", max_slots=1, max_len=64)
    fed: list[tuple[int, bool]] = []
    forward = worker.runner.forward

    def spy(slots, tokens, parents=None, **kwargs):
        fed.append((len(tokens[0]), parents is not None))
        return forward(slots, tokens, parents, **kwargs)

    worker.runner.forward = spy
    t = worker.time_forwards([1, 3, 5], context=16, reps=2)
    assert set(t) == {1, 3, 5} and all(v > 0 for v in t.values())
    # One prefill of the context, then 3 rounds over the n's (the first one a warm-up).
    assert fed == [(16, False)] + [(1, False), (3, False), (5, False)] * 3
    assert worker.num_free_slots() == 0  # the timing slot stays for the next timing call
    fed.clear()
    assert set(worker.time_forwards([4], context=16, tree=True, reps=1)) == {4}
    assert fed == [(4, True), (4, True)]  # n siblings of the same prefilled context
    fed.clear()
    worker.time_forwards([2], context=12, reps=1)  # another context: prefilled anew
    assert fed == [(12, False), (2, False), (2, False)] and worker.num_free_slots() == 0
    worker.release_probe()
    assert worker.num_free_slots() == 1
    worker.time_forwards([2], context=12, reps=1)
    worker.add(0, [1, 2, 3], SamplingSpec(temperature=0))  # a sequence takes the probe's slot back
    assert worker.num_free_slots() == 0 and worker.runner.kv.lengths[worker.seqs[0].slot] == 2
    with pytest.raises(ValueError, match="token counts"):
        worker.time_forwards([0, 2])
    with pytest.raises(ValueError, match="no cores to borrow"):
        worker.time_forwards([1], borrow=True)


def test_keep_busy_runs_forwards_for_the_time_asked_and_frees_its_slot():
    import time

    worker = DraftWorker(random_model(vocab=40, layers=1), dtype="float32", max_slots=1, max_len=64)
    fed: list[int] = []
    forward = worker.runner.forward

    def spy(slots, tokens, parents=None, **kwargs):
        fed.append(len(tokens[0]))
        return forward(slots, tokens, parents, **kwargs)

    worker.runner.forward = spy
    assert worker.keep_busy(0.0, n=3, context=16) == 1  # at least one forward, whatever the time
    assert fed == [16, 3] and worker.num_free_slots() == 0  # the probe's slot, kept for the next timing call
    fed.clear()
    t0 = time.perf_counter()
    done = worker.keep_busy(0.05, n=2, context=8)
    assert time.perf_counter() - t0 >= 0.05
    assert done == len(fed) - 1 >= 1 and fed[0] == 8 and set(fed[1:]) == {2}
    worker.release_probe()
    assert worker.num_free_slots() == 1


def test_placement_lends_cores_both_ways_only_in_auto():
    cores = [0, 1]
    plan = plan_placement(Config(target="t", draft="d", mode="auto"), cores)
    assert (plan.target.cpu_cores, plan.target.spare_cores, plan.draft.cpu_cores, plan.draft.spare_cores) == (
        [0], [1], [1], [0])
    assert plan.target.num_threads == plan.draft.num_threads == 1  # own thread counts; a loan adds the rest per call
    for cfg in (Config(target="t", draft="d", mode="ssd"), Config(target="t", draft="d", core_loans=False),
                Config(target="t", draft="d", mode="auto", target_cores=[0, 1], draft_cores=[0, 1])):
        plan = plan_placement(cfg, cores)
        assert plan.target.spare_cores is None and plan.draft.spare_cores is None
    shared = plan_placement(Config(target="t", draft="d", mode="auto"), [0])  # one core: nothing to lend
    assert shared.target.spare_cores is None and shared.draft.spare_cores is None


@two_cores
def test_a_borrowed_draft_proposes_on_both_cores_with_the_same_tokens_and_q(restore_cpu_state):
    """The draft's just-in-time drafts on the target's core too: 2 threads, the same tokens and q (the
    kernels split output rows between threads), and its own core and thread count afterwards."""
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=2, seed=11)
    worker = DraftWorker(model, dtype="float32", quantization="w4a8", max_slots=2, max_len=64,
                         cpu_cores=CORES[1:2], spare_cores=CORES[:1])
    seen = watch_threads(worker)
    out = {}
    for seq_id, borrow in ((0, False), (1, True)):
        worker.add(seq_id, [3, 9, 4, 1, 7], SamplingSpec(temperature=0.8, seed=5))
        seen.clear()
        drafts, qs = worker.propose([(seq_id, 4)], borrow=borrow)
        assert seen == [(2 if borrow else 1, set(CORES[:2] if borrow else CORES[1:2]))] * 4
        out[borrow] = (drafts[0].tokens, qs[0])
    assert out[False][0] == out[True][0] and torch.equal(out[False][1], out[True][1])
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == set(CORES[1:2])
    with pytest.raises(ValueError, match="no cores to borrow"):
        DraftWorker(model, dtype="float32", max_slots=1, max_len=32).propose([], borrow=True)


def test_policy_prices_rounds_that_leave_the_draft_idle_on_borrowed_cores():
    c = CostModel()
    c.verify = VerifyLine(Ema(0.10), Ema(0.02))
    c.speculate, c.draft_step = Ema(0.05), Ema(0.04)
    c.hit_full = c.hit_partial = c.hit_after_neural = c.hit_after_fast = RateEma(0.9)
    c.acceptance = RateEma(0.7)
    _, own = choose(c, 1, 3)
    c.enable_borrow(0.5)
    best, lent = choose(c, 1, 3)
    assert lent["ar"] == pytest.approx(own["ar"] * 0.5) and lent["ngram"] == pytest.approx(own["ngram"] * 0.5)
    assert lent["sd"] == pytest.approx(own["sd"] - 0.5 * c.verify_time(4) / ((1 - 0.7**4) / 0.3))
    assert lent["ssd_neural"] == own["ssd_neural"] and lent["ssd_fast"] == own["ssd_fast"]
    # SSD (~0.19 s per 2.5 tokens) beats AR on the target's own core (0.12 s per token), not on two (0.06).
    assert min(own, key=own.get).startswith("ssd") and best == "ar"
    # A borrowed verification moves the borrowed line, not the own one.
    line = (c.verify.v0.value, c.verify.v1.value)
    c.observe_verify(4, 0.18 * 0.6, borrowed=True)
    assert (c.verify.v0.value, c.verify.v1.value) == line
    assert 0.5 < c.borrow_factor() < 0.6 and 0.5 < c.borrow_factor(4) < 0.6
    with pytest.raises(ValueError, match="enable_borrow"):
        CostModel().observe_verify(4, 0.1, borrowed=True)


# Start-up latencies of the real pair (w4a8, target and draft on a core each, session 20): the target's
# forwards of n tokens on its own core and on both, and one draft step on both.
REAL_OWN = {1: 0.0343, 2: 0.0449, 6: 0.0600}
REAL_BORROWED = {1: 0.0321, 6: 0.0381}
REAL_DRAFT_STEP = 0.0101


def test_borrowed_verification_is_a_line_of_its_own():
    """Borrowing speeds a long verification more than a decode step (0.94x at 1 token, 0.64x at 6 on the
    real pair): the measured borrowed times are fitted as a line, so each is priced at what it measured,
    where one share of the own line priced AR 16 % cheap and long verifications dear."""
    c = CostModel()
    c.seed(REAL_OWN, draft_step=REAL_DRAFT_STEP)
    c.enable_borrow(t_borrowed=REAL_BORROWED)
    assert c.lent_verify_time(1) == pytest.approx(0.0321) and c.lent_verify_time(6) == pytest.approx(0.0381)
    assert c.borrow_factor(6) == pytest.approx(0.0381 / c.verify_time(6))
    _, scores = choose(c, 1, 4, allowed=("sd", "ar"))
    assert scores["ar"] == pytest.approx(0.0321)
    shared = CostModel()
    shared.seed(REAL_OWN, draft_step=REAL_DRAFT_STEP)
    shared.enable_borrow(sum(REAL_BORROWED[n] / shared.verify_time(n) for n in REAL_BORROWED) / 2)
    assert shared.lent_verify_time(1) < 0.9 * 0.0321 and shared.lent_verify_time(6) > 1.1 * 0.0381
    # At acceptance 0.7 the line prices SD below AR, as the real pair measures (SD mode 45 tok/s, AR 34);
    # the share priced AR below SD, and AR rounds never measure the draft to correct it.
    c.acceptance = shared.acceptance = RateEma(0.7)
    assert choose(c, 1, 4, allowed=("sd", "ar"))[0] == "sd"
    assert choose(shared, 1, 4, allowed=("sd", "ar"))[0] == "ar"


def test_an_outlying_verification_moves_a_line_by_at_most_its_cap():
    """One verification at 4x its line (a request's first, on the real pair) counts as OUTLIER_CAP times the
    prediction, on the own and on the borrowed line alike; steady drifts still move them."""
    from ssd.policy import OUTLIER_CAP

    capped, plain = CostModel(), CostModel()
    for c in (capped, plain):
        c.seed(REAL_OWN)
        c.enable_borrow(t_borrowed=REAL_BORROWED)
    before = (capped.verify_time(6), capped.lent_verify_time(1))
    capped.observe_verify(6, 4 * before[0])
    capped.observe_verify(1, 4 * before[1], borrowed=True)
    plain.observe_verify(6, OUTLIER_CAP * before[0])
    plain.observe_verify(1, OUTLIER_CAP * before[1], borrowed=True)
    assert (capped.verify_time(6), capped.lent_verify_time(1)) == (plain.verify_time(6), plain.lent_verify_time(1))
    assert capped.verify_time(6) > before[0] and capped.lent_verify_time(1) > before[1]
    for _ in range(40):  # the machine turned 30 % slower: the lines follow
        capped.observe_verify(6, 1.3 * before[0])
    assert capped.verify_time(6) == pytest.approx(1.3 * before[0], rel=0.02)


def test_a_slow_first_draft_does_not_set_the_price_of_a_draft_call():
    """The start-up step seeds the per-call intercept at 0 as one observation: a request's first draft
    (50 ms for one 10 ms step) moves it, and no longer sets it alone (which priced SD out for a prompt)."""
    c = CostModel()
    c.seed(REAL_OWN, draft_step=REAL_DRAFT_STEP)
    assert (c.draft_call.value, c.draft_call.n) == (0.0, 1)
    c.observe_draft(1, 0.050)
    assert 0.0 < c.draft_call.value < 0.005
    unseeded = CostModel()
    unseeded.observe_draft(1, 0.050)
    assert unseeded.draft_call.value > 0.01


def lend_cores(llm: LLM):
    """The in-process target and draft each borrow the other's core, as the placement arranges for `auto`
    on CPU."""
    mode = llm.engine.mode
    own = sorted(os.sched_getaffinity(0))[:1]
    other = [c for c in CORES if c not in own][:1]
    mode.target.worker.loan = CoreLoan(own, other)
    mode.draft.worker.loan = CoreLoan(other, own)
    mode.borrow = mode.draft_borrow = True
    mode.cost.enable_borrow()
    return mode


@two_cores
def test_auto_borrows_in_idle_draft_rounds_and_stays_exact(models, ar_outputs, monkeypatch):
    """AR, SD and n-gram rounds verify on borrowed cores and keep the draft's commits lazy; SSD rounds'
    verifications never borrow (the draft speculates meanwhile). Just-in-time drafts (SD, catch-ups, the
    neural backup's) run on the target's core too; speculation never does. Greedy output still equals AR."""
    cycle_policy(monkeypatch, ["ssd_neural", "ngram", "ar", "ssd_fast", "sd", "ar", "ssd_neural", "ssd_neural"])
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8,
             dtype="float32", max_batch=4, max_len=128, use_ray=False) as llm:
        mode = lend_cores(llm)
        calls: list[tuple[str, tuple]] = []
        for name, handle in (("target", mode.target), ("draft", mode.draft)):
            real = handle.call

            def spy(method, *args, name=name, real=real):
                calls.append((f"{name}.{method}", args))
                return real(method, *args)

            monkeypatch.setattr(handle, "call", spy)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        policy = llm.stats()["policy"]
    borrowed = [a for m, a in calls if m == "target.verify" and len(a) == 3 and a[2] is True]
    own_cores = [a for m, a in calls if m == "target.verify" and len(a) == 2]
    assert len(borrowed) == policy["ar"] + policy["sd"] + policy["ngram"] > 0
    assert len(own_cores) == policy["ssd_neural"] + policy["ssd_fast"] > 0
    assert not any(a[2] for m, a in calls if m == "draft.commit")  # lazy: the target has the draft's core
    proposes = [a for m, a in calls if m == "draft.propose"]
    assert proposes and all(a[2] is True for a in proposes)
    resolves = [a for m, a in calls if m == "draft.resolve"]
    assert {a[1] for a in resolves} == {True, False} and all(a[3] is a[1] for a in resolves)  # borrow iff neural


def test_exploration_while_borrowing_stays_with_options_that_need_no_catch_up(models):
    """Borrowed rounds feed the draft nothing, so a re-measurement of SD or SSD from there would pay a
    catch-up over every token since; SD is re-measured only with at most EXPLORE_SD_LAG tokens to feed.
    From a ready SSD pipeline only SSD options are tried, as before."""
    from ssd.modes.ssd import EXPLORE_SD_LAG

    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8,
             dtype="float32", max_batch=2, max_len=64, use_ray=False) as llm:
        mode = llm.engine.mode
        assert all(mode._explorable(o, "ar", 0.0) for o in ("ssd_neural", "ssd_fast", "sd", "ngram"))
        mode.borrow = True
        mode._round_lag = EXPLORE_SD_LAG + 1
        assert [o for o in ("ssd_neural", "ssd_fast", "sd", "ngram") if mode._explorable(o, "ar", 0.0)] == ["ngram"]
        assert mode._explorable("ar", "ngram", 0.0) and not mode._explorable("sd", "ngram", 0.0)
        for lag in (0, EXPLORE_SD_LAG):
            mode._round_lag = lag
            assert [o for o in ("ssd_neural", "ssd_fast", "sd", "ngram") if mode._explorable(o, "ar", 0.0)] == [
                "sd", "ngram"]
        for borrow in (True, False):
            mode.borrow = borrow
            assert mode._explorable("ssd_neural", "ssd_fast", 1.0) and not mode._explorable("ar", "ssd_fast", 1.0)


def test_stale_sd_is_re_measured_when_it_can_be_tried(models):
    """SD not run for EXPLORE_EVERY rounds is tried as soon as it can be without a catch-up (a request's
    first rounds while borrowing), if it scores within EXPLORE_WITHIN of the choice or a request starts."""
    from ssd.modes.ssd import EXPLORE_EVERY, EXPLORE_SD_LAG, EXPLORE_WITHIN

    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8, dtype="float32", max_batch=2,
             max_len=64) as llm:
        mode = llm.engine.mode
        mode.borrow = True
        mode.stats.rounds = 100
        mode._last_tried = {"sd": 100 - EXPLORE_EVERY, "ar": 99}
        mode.last_scores = {"ar": 0.030, "ngram": 0.032, "sd": 0.030 * EXPLORE_WITHIN * 0.99,
                            "ssd_neural": 0.05, "ssd_fast": 0.05}
        mode._round_lag = EXPLORE_SD_LAG
        assert mode._sd_stale("ar", 0.0)
        assert not mode._sd_stale("sd", 0.0)
        assert not mode._sd_stale("ssd_fast", 1.0)  # a ready SSD pipeline keeps to SSD options
        mode._round_lag = EXPLORE_SD_LAG + 1  # a catch-up to pay first: not now
        assert not mode._sd_stale("ar", 0.0)
        mode._round_lag = 0
        mode._last_tried["sd"] = 100 - EXPLORE_EVERY + 1  # tried recently
        assert not mode._sd_stale("ar", 0.0)
        mode._last_tried["sd"] = 100 - EXPLORE_EVERY
        mode.last_scores["sd"] = 0.030 * EXPLORE_WITHIN * 1.01  # far from the best
        assert not mode._sd_stale("ar", 0.0)
        assert mode._sd_stale("ar", 0.0, fresh=True)  # a request's first round re-measures it anyway
        mode._last_tried["sd"] = 100 - EXPLORE_EVERY + 1
        assert not mode._sd_stale("ar", 0.0, fresh=True)  # not when it was measured recently
        mode._round_lag = EXPLORE_SD_LAG + 1
        mode._last_tried["sd"] = 100 - EXPLORE_EVERY
        assert not mode._sd_stale("ar", 0.0, fresh=True)  # nor with a catch-up to pay (a batch's older rows)
        mode._round_lag = 0
        mode.last_scores["sd"] = 0.040
        mode.borrow = False  # own cores: no backlog, SD can be tried at any lag
        mode._round_lag = 50
        assert mode._sd_stale("ar", 0.0)
        mode.allowed = tuple(o for o in mode.allowed if o != "sd")
        assert not mode._sd_stale("ar", 0.0)


def test_periodic_re_measurement_is_not_starved_by_a_stale_sd(monkeypatch):
    """Every option within EXPLORE_WITHIN of the choice is re-measured now and then, SD among them: SD's own
    staleness check (due as often) had taken every due round, so the others never ran."""
    import collections

    import ssd.modes.ssd as ssd_mode
    from ssd.sampling_params import SamplingParams
    from ssd.sequence import Sequence

    scores = {"ngram": 1.0, "ssd_fast": 1.1, "ar": 1.2, "sd": 1.3, "ssd_neural": 1.4}
    monkeypatch.setattr(ssd_mode, "choose", lambda cost, *a, **kw: ("ngram", dict(scores)))
    mode = ssd_mode.SSDMode(None, None, 4, planner=None, allowed=ssd_mode.policy_options("auto", "auto"),
                            vocab_size=100)
    seq = Sequence(0, list(range(20)), SamplingParams(max_tokens=10_000), [], None)
    seq.output_ids = [1, 2, 3]
    picks = collections.Counter()
    for _ in range(400):
        picks[mode._choose([seq])] += 1
        mode.stats.rounds += 1
    assert set(picks) == set(scores) and min(picks.values()) >= 5, picks
    assert picks["ngram"] > 300, picks


def test_policy_prices_the_draft_backlog_of_borrowed_rounds():
    """Tokens the draft has not been fed (lazy commits while the target borrows its core) are a one-off
    cost of the next SD or SSD round, spread over the switch horizon; AR and n-gram do not pay it."""
    from ssd.policy import SWITCH_HORIZON

    c = CostModel()
    c.verify, c.feed = VerifyLine(Ema(0.10), Ema(0.02)), Ema(0.004)
    c.enable_borrow(0.5)
    _, base = choose(c, 1, 3, prepared=0.0)
    best, lagged = choose(c, 1, 3, prepared=0.0, lag=50)
    backlog = 50 * 0.004 / SWITCH_HORIZON  # seconds per round
    e_sd = expected_tokens(c.acceptance.value, 3)
    assert lagged["sd"] == pytest.approx(base["sd"] + backlog / e_sd)
    assert lagged["ssd_neural"] == pytest.approx(base["ssd_neural"] + backlog / e_sd)
    assert lagged["ssd_fast"] > base["ssd_fast"]
    assert lagged["ar"] == base["ar"] and lagged["ngram"] == base["ngram"]
    assert min(base, key=base.get) != "ar" and best == "ar"  # a long backlog keeps the policy on AR
    # Where just-in-time drafts borrow the target's cores, SD and the neural catch-up feed the backlog at
    # the borrowed speed; the fast backup leaves it to speculation on the draft's own cores.
    c.draft_lend = 0.5
    _, lent = choose(c, 1, 3, prepared=0.0, lag=50)
    assert lent["sd"] == pytest.approx(base["sd"] + 0.5 * backlog / e_sd)
    assert lent["ssd_neural"] == pytest.approx(base["ssd_neural"] + 0.5 * backlog / e_sd)
    assert lent["ssd_fast"] == lagged["ssd_fast"] and lent["ar"] == base["ar"]


def test_a_backlog_is_spread_over_the_rest_of_the_request():
    """Staying on AR only grows the backlog, so it is priced over the rounds the lagging request has left
    (never fewer than the switch horizon): a backlog that keeps a short request on AR does not keep a
    long one there."""
    from ssd.policy import RATE_ALPHA, SWITCH_HORIZON, RateEma

    c = CostModel()
    c.verify, c.feed = VerifyLine(Ema(0.10), Ema(0.02)), Ema(0.004)
    c.acceptance = RateEma(0.8, RATE_ALPHA)
    c.enable_borrow(0.5)
    best_base, base = choose(c, 1, 3, prepared=0.0)
    e_sd = expected_tokens(c.acceptance.value, 3)
    assert best_base == "sd" and choose(c, 1, 3, prepared=0.0, lag=50)[0] == "ar"
    short, _ = choose(c, 1, 3, prepared=0.0, lag=50, horizon=3)
    assert short == "ar"  # as without a horizon: 3 tokens are fewer than the switch horizon's rounds
    best, spread = choose(c, 1, 3, prepared=0.0, lag=50, horizon=200)
    rounds = 200 / e_sd
    assert rounds > SWITCH_HORIZON
    assert spread["sd"] == pytest.approx(base["sd"] + 50 * 0.004 / rounds / e_sd)
    assert spread["ar"] == base["ar"] and best == "sd"


def test_tokens_of_rounds_that_leave_the_draft_unfed_carry_their_later_feed():
    """While the target borrows the draft's cores, each token an AR or n-gram round emits is one the next SD
    or SSD round must feed: `unfed` adds that feed (at the lent speed; the feed of a batch's backlog grows with its
    total, so a whole token's) to their price, so an AR a little cheaper than SD per token no longer wins and
    grows the backlog that then prices SD out."""
    from ssd.policy import RATE_ALPHA, RateEma

    c = CostModel()
    c.verify, c.feed = VerifyLine(Ema(0.10), Ema(0.02)), Ema(0.010)
    c.acceptance = RateEma(0.65, RATE_ALPHA)
    c.enable_borrow(0.5)
    c.draft_lend = 0.5
    _, base = choose(c, 2, 3, prepared=0.0)
    _, unfed = choose(c, 2, 3, prepared=0.0, unfed=True)
    per_token = 0.010 * 0.5  # one token's feed on lent cores
    assert unfed["ar"] == pytest.approx(base["ar"] + per_token)
    assert unfed["ngram"] == pytest.approx(base["ngram"] + per_token)
    assert all(unfed[o] == base[o] for o in ("sd", "ssd_neural", "ssd_fast"))
    # Batch 1: AR ~4 ms a token cheaper than SD, the feed 5 ms: it decides for SD.
    best, scores = choose(c, 1, 3, prepared=0.0)
    assert best == "ar" and scores["sd"] - scores["ar"] < 0.010 * 0.5
    assert choose(c, 1, 3, prepared=0.0, unfed=True)[0] == "sd"


def test_sd_rounds_that_fed_a_backlog_calibrate_without_it():
    """An SD round that first fed the draft a backlog still calibrates SD's price, with the backlog's
    modelled feed time taken off; an SSD round that fed one does not count."""
    from types import SimpleNamespace

    from ssd.modes.ssd import SSDMode
    from ssd.policy import round_seconds

    def mode(choice: str, lag: int) -> SimpleNamespace:
        c = CostModel()
        c.verify, c.feed, c.draft_lend = VerifyLine(Ema(0.10), Ema(0.02)), Ema(0.004), 0.5
        # an SD round drafts (nothing prepared); an SSD one verifies a prepared speculation
        prepared = 0.0 if choice == "sd" else 1.0
        return SimpleNamespace(last_choice=choice, last_scores=dict.fromkeys(("sd", "ssd_neural"), 1.0),
                               _prepared=prepared, _round_lag=lag, _round_backlog=lag, cost=c, _sd_k=3, _round_k=3,
                               _ngram_k=3, _verified=4, _missed=0.0, gate=False)

    seqs = [object()]
    m = mode("sd", 20)
    predicted = round_seconds(m.cost, "sd", 1, 3)
    SSDMode._calibrate(m, seqs, predicted + 20 * 0.004 * 0.5)  # on time once the feed is taken off
    assert m.cost.calibration["sd"].n == 1 and m.cost.calibration["sd"].value == pytest.approx(1.0)
    m = mode("sd", 20)
    SSDMode._calibrate(m, seqs, 0.8 * predicted + 20 * 0.004 * 0.5)
    assert m.cost.calibration["sd"].value < 1.0
    m = mode("ssd_neural", 20)
    SSDMode._calibrate(m, seqs, 1.0)
    assert "ssd_neural" not in m.cost.calibration


class _BusyLoad:
    """keep_busy's future: the draft counts as busy until the caller collects the result."""

    def __init__(self, handle: "TimedHandle") -> None:
        self.handle = handle
        handle.busy_until_result = True

    def result(self, timeout=None) -> int:
        self.handle.busy_until_result = False
        return 1


class TimedHandle:
    """A worker handle whose time_forwards answers from a formula (seconds), halved on borrowed cores and
    1.5x while `busy_draft` runs keep_busy."""

    def __init__(self, per_token: float, fixed: float) -> None:
        self.per_token, self.fixed, self.borrowed = per_token, fixed, []
        self.busy_draft: TimedHandle | None = None
        self.busy_until_result = False
        self.released = False  # release_probe called

    def call(self, method, ns=(), context=128, tree=False, reps=3, borrow=False):
        from concurrent.futures import Future

        if method == "keep_busy":
            return _BusyLoad(self)
        if method == "release_probe":
            self.released = True
            f = Future()
            f.set_result(None)
            return f
        assert method == "time_forwards"
        self.borrowed.append(borrow)
        slow = 1.5 if self.busy_draft is not None and self.busy_draft.busy_until_result else 1.0
        f: Future = Future()
        f.set_result({n: (self.fixed + self.per_token * n) * (0.5 if borrow else slow) for n in ns})
        return f


def test_start_up_times_a_ladder_of_fanout_sizes_and_interpolates_the_rest():
    from ssd.autoconfig import BRANCH_TIMED, K_CHOICES, autoconfigure, budgets

    class Recording(TimedHandle):
        def __init__(self, per_token: float, fixed: float) -> None:
            super().__init__(per_token, fixed)
            self.asked: list[tuple[list[int], bool]] = []

        def call(self, method, ns=(), context=128, tree=False, reps=3, borrow=False):
            if method == "time_forwards":
                self.asked.append((list(ns), tree))
            return super().call(method, ns, context, tree, reps, borrow)

    draft, target = Recording(0.004, 0.02), TimedHandle(0.03, 0.05)
    ac = autoconfigure(target, draft, ssd=True)
    assert target.released and draft.released  # both timing slots go back before serving
    sizes = sorted({b for k in K_CHOICES for b in budgets(k)})
    trees = [ns for ns, tree in draft.asked if tree]
    assert len(trees) == 1 and set(trees[0]) == {b for b in sizes if b in BRANCH_TIMED} | {sizes[-1]}
    assert len(trees[0]) < len(sizes)
    # Times on a straight line come back exactly at every budget, timed or not.
    assert ac.t_draft == pytest.approx({b: 0.02 + 0.004 * b for b in sizes})


def test_auto_with_core_loans_prices_ssd_rounds_beside_a_busy_draft():
    """Where the target borrows the draft's cores, start-up also times the target's verification while the
    draft runs forwards (keep_busy), and that seeds the own-cores line, which then prices only SSD rounds.
    Without loans nothing extra is timed and the line is the target's forwards alone."""
    from ssd.autoconfig import autoconfigure
    from ssd.build import make_mode

    def pair():
        target, draft = TimedHandle(0.03, 0.05), TimedHandle(0.004, 0.02)
        target.busy_draft = draft
        return target, draft

    target, draft = pair()
    ac = autoconfigure(target, draft, ssd=True, busy=True)
    assert ac.t_verify_busy == pytest.approx({n: 1.5 * t for n, t in ac.t_verify.items()})
    assert not draft.busy_until_result  # the load was collected
    assert autoconfigure(*pair(), ssd=True).t_verify_busy is None
    lent = make_mode(Config(target="t", draft="d", mode="auto"), *pair(), 64, borrow=True, draft_borrow=True)
    own = make_mode(Config(target="t", draft="d", mode="auto"), *pair(), 64)
    assert lent.cost.verify_time(4) == pytest.approx(1.5 * own.cost.verify_time(4))
    assert lent.cost.lent_verify_time(4) == pytest.approx(0.5 * own.cost.verify_time(4))


def test_make_mode_seeds_just_in_time_drafts_at_the_borrowed_speed():
    from ssd.build import make_mode

    def built(borrow: bool, draft_borrow: bool):
        target, draft = TimedHandle(0.03, 0.05), TimedHandle(0.004, 0.02)
        mode = make_mode(Config(target="t", draft="d", mode="auto"), target, draft, 64, borrow=borrow,
                         draft_borrow=draft_borrow)
        return mode, target, draft

    own, _, d_own = built(False, False)
    lent, t_lent, d_lent = built(True, True)
    assert not any(d_own.borrowed) and any(d_lent.borrowed) and any(t_lent.borrowed)
    assert (lent.borrow, lent.draft_borrow, own.draft_borrow) == (True, True, False)
    assert lent.cost.draft_lend == pytest.approx(0.5) and own.cost.draft_lend == 1.0
    assert lent.cost.draft_step.value == pytest.approx(0.5 * own.cost.draft_step.value)
    assert lent.cost.borrow_factor() == pytest.approx(0.5)
    assert lent.cost.speculate.value == own.cost.speculate.value  # speculation stays on the draft's own core
    # mode="ssd" never lends, whatever the workers could do.
    d_ssd = TimedHandle(0.004, 0.02)
    ssd = make_mode(Config(target="t", draft="d", mode="ssd"), TimedHandle(0.03, 0.05), d_ssd, 64, borrow=True,
                    draft_borrow=True)
    assert not ssd.borrow and not ssd.draft_borrow and not any(d_ssd.borrowed) and ssd.cost.draft_lend == 1.0


def test_borrowed_rounds_count_the_draft_backlog_until_a_draft_round_feeds_it(models, ar_outputs, monkeypatch):
    import itertools

    import ssd.modes.ssd as ssd_mode

    order, lags, unfed_flags = itertools.cycle(["ar", "ar", "ngram", "ssd_neural", "ar", "sd"]), [], set()

    def fake_choose(cost, batch, k, allowed, ngram=None, prepared=1.0, current=None, lag=0, k_sd=None,
                    horizon=None, unfed=False):
        lags.append(lag)
        unfed_flags.add(unfed)
        return next(order), dict.fromkeys(allowed, 1.0)

    monkeypatch.setattr(ssd_mode, "choose", fake_choose)
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8, dtype="float32", max_batch=1,
             max_len=128) as llm:
        mode = llm.engine.mode
        mode.borrow = True
        mode.cost.enable_borrow()
        monkeypatch.setattr(mode, "_verify", lambda drafts, q_draft=None, borrow=False: ssd_mode.SSDMode._verify(
            mode, drafts, q_draft))  # the choice logic only: no loan needed on this machine
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert out.token_ids == ar_outputs[0]
        assert not mode._lag  # forgotten with the finished sequence
    # Rounds: ar (+1), ar (+1), ngram (+n), ssd_neural (fed: 0), ar (+1), sd (fed), ...
    assert lags[:2] == [0, 1] and lags[2] == 2 and lags[3] > 2 and lags[4] == 0 and lags[5] == 1 and lags[6] == 0
    assert unfed_flags == {True}  # borrowing: the policy is told AR and n-gram leave the draft unfed


LONG_PROMPTS = [[(7 * i + 3) % 37 + 1 for i in range(45)], [(5 * i + 1) % 39 + 1 for i in range(60)]]


@two_cores
@pytest.mark.parametrize("n, cuts, dtype", [(40, (13, 30), "float32"), (150, (40, 70), "bfloat16")])
def test_a_prompt_prefilled_in_pieces_equals_one_piece(restore_cpu_state, n, cuts, dtype):
    """add(first piece) + extend(rest, the last piece on borrowed cores) leaves the same cache bits and
    state as adding the whole prompt, so verification gives the same outcomes. The 150-token prompt is
    longer than any verification block: prefilled whole through a masked SDPA, it used to get other
    bits than in pieces."""
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=2, seed=5)
    worker = TargetWorker(model, dtype=dtype, quantization="w4a8", max_slots=2, max_len=192,
                          cpu_cores=CORES[:1], spare_cores=CORES[1:2])
    prompt = [(11 * i + 2) % 60 + 1 for i in range(n)]
    worker.add(0, prompt, SamplingSpec(temperature=0))
    worker.add(1, prompt[: cuts[0]], SamplingSpec(temperature=0))
    worker.extend(1, prompt[cuts[0] : cuts[1]])
    worker.extend(1, prompt[cuts[1] :], borrow=True)
    a, b = worker.seqs[0], worker.seqs[1]
    assert (a.pending, a.committed) == (b.pending, b.committed) == (prompt[-1], len(prompt) - 1)
    kv = worker.runner.kv
    assert kv.lengths[a.slot] == kv.lengths[b.slot] == len(prompt) - 1
    m = len(prompt) - 1
    assert torch.equal(kv.k[:, a.slot, :, :m], kv.k[:, b.slot, :, :m])
    assert torch.equal(kv.v[:, a.slot, :, :m], kv.v[:, b.slot, :, :m])
    outs = [worker.verify([Draft(seq_id=s, tokens=[5, 9, 2])])[0] for s in (0, 1)]
    assert outs[0].tokens == outs[1].tokens and outs[0].num_accepted == outs[1].num_accepted
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == set(CORES[:1])


def test_extend_refuses_what_is_not_a_prompt_piece():
    worker = TargetWorker(random_model(vocab=40, layers=1, seed=2), dtype="float32", max_slots=1, max_len=32)
    with pytest.raises(KeyError, match="not added"):
        worker.extend(3, [1, 2])
    worker.add(0, [1, 2, 3], SamplingSpec(temperature=0))
    with pytest.raises(ValueError, match="at least one"):
        worker.extend(0, [])
    with pytest.raises(ValueError, match="no cores to borrow"):
        worker.extend(0, [5], borrow=True)
    worker.runner.forward([worker.seqs[0].slot], [[3, 4]])  # tokens past the committed ones, as a draft leaves
    with pytest.raises(ValueError, match="speculative tokens"):
        worker.extend(0, [5])


def test_prefill_cut_follows_the_measured_costs(models):
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8,
             dtype="float32", max_batch=1, max_len=64, use_ray=False) as llm:
        mode = llm.engine.mode
        mode.cost.feed, mode.cost.verify.v1 = Ema(0.005, n=1), Ema(0.02, n=1)
        assert mode.prefill_cut(200) is None  # not borrowing
        mode.borrow = True
        assert mode.prefill_cut(200) == 50  # the draft's prefill takes as long as a quarter of the target's
        assert mode.prefill_cut(20) is None  # short: one piece
        mode.cost.feed = Ema(0.05, n=1)
        assert mode.prefill_cut(200) == 199  # the draft is the slower: nearly all on the target's own core
        mode.cost.feed = Ema(0.005)
        assert mode.prefill_cut(200) is None  # costs not measured yet
        # A split prefill: the draft took 2 s for 200 tokens (10 ms each); the target 1.5 s for the last 150
        # on borrowed cores, i.e. 10 ms each, 20 ms on its own core at a borrowed / own share of 0.5.
        mode.cost.enable_borrow(0.5)
        mode.observe_prefill(200, 50, 2.0, 1.5)
        assert mode.prefill_ratio.value == pytest.approx(0.5)
        assert mode.prefill_cut(200) == 100  # measured prefills now decide, not the decode costs


@two_cores
def test_auto_prefills_the_rest_of_a_prompt_on_borrowed_cores_and_stays_exact(models, monkeypatch):
    with LLM(target=models[0], mode="ar", dtype="float32", max_batch=2, max_len=128) as llm:
        expected = [o.token_ids for o in llm.generate(LONG_PROMPTS, GREEDY)]
    cycle_policy(monkeypatch, ["ngram", "ar", "ssd_neural", "sd"])
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, fanout=8,
             dtype="float32", max_batch=2, max_len=128, use_ray=False) as llm:
        mode = lend_cores(llm)
        mode.cost.feed, mode.cost.verify.v1 = Ema(0.004, n=1), Ema(0.012, n=1)
        calls: list[tuple[str, tuple]] = []
        real = mode.target.call

        def spy(method, *args):
            calls.append((method, args))
            return real(method, *args)

        monkeypatch.setattr(mode.target, "call", spy)
        observed: list[tuple] = []
        mode.observe_prefill = lambda *a: observed.append(a)  # recorded; the seeded ratio stays for both
        outs = llm.generate(LONG_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    for prompt in LONG_PROMPTS:
        cut = round(len(prompt) / 3)
        assert [a[1] for m, a in calls if m == "add" and a[1][0] == prompt[0] and len(a[1]) == cut] == [prompt[:cut]]
        assert [(a[1], a[2]) for m, a in calls if m == "extend" and a[1] == prompt[cut:]] == [(prompt[cut:], True)]
    assert [(n, cut) for n, cut, _, _ in observed] == [(len(p), round(len(p) / 3)) for p in LONG_PROMPTS]
    assert all(draft_s > 0 and rest_s > 0 for _, _, draft_s, rest_s in observed)


def test_ngram_draft_length_is_priced_on_the_cores_it_verifies_on():
    """With core loans n-gram rounds verify on both cores: their draft length follows that line, not the own one."""
    from ssd.policy import plan_ngram

    c = CostModel()
    c.verify = VerifyLine(Ema(0.030), Ema(0.020))  # own cores: each token dear
    a = 0.75
    own = plan_ngram(c, [(8, a)], 8).k
    c.enable_borrow(t_borrowed={n: 0.020 + 0.002 * n for n in (1, 2, 4, 9)})  # both cores: nearly flat
    lent = plan_ngram(c, [(8, a)], 8).k
    assert lent > own
    assert lent == min(range(1, 9), key=lambda k: c.lent_verify_time(k + 1) / expected_tokens(a, k))


def test_speculation_price_starts_from_the_fanout_the_mode_uses(models, monkeypatch):
    """K auto-configured but the budget given: the policy's speculation price is that budget's, not the one
    auto-configuration would have picked."""
    import ssd.build as build
    from ssd.autoconfig import rows_time

    seen = {}
    cached = build.cached_autoconfigure
    monkeypatch.setattr(build, "cached_autoconfigure",
                        lambda *a, **kw: seen.setdefault("ac", cached(*a, **kw)))
    with LLM(target=models[0], draft=models[1], mode="ssd", fanout=1, dtype="float32", max_len=64,
             use_ray=False) as llm:
        mode = llm.engine.mode
        ac, k = seen["ac"], mode.k
        assert mode.planner.B == 1
        want = rows_time(ac.t_chain, k + 1) + k * rows_time(ac.t_draft, 1)
        assert mode.cost.speculate.value == pytest.approx(want)


def test_speculation_is_priced_at_the_batch_it_runs_for():
    """A round's speculation grows with the batch (its forwards' rows): kept as one sequence's and scaled by the
    start-up timings, so rounds at batch 8 do not price batch 1's SSD at batch 8's speculation (or the reverse)."""
    from ssd.policy import round_seconds

    c = CostModel()
    c.verify = VerifyLine(Ema(0.010), Ema(0.001))
    assert c.speculate_time(8) == c.speculate.value  # no timings: one sequence's at any batch
    c.spec_batch_factor = lambda n: 0.5 + 0.5 * n  # a draft forward's cost half fixed, half per row
    c.speculate = Ema(0.040)
    for _ in range(20):
        c.observe_speculate(8, 0.040 * 4.5)  # batch 8 measured as its timings say
    assert c.speculate.value == pytest.approx(0.040)
    assert c.speculate_time(1) == pytest.approx(0.040) and c.speculate_time(8) == pytest.approx(0.180)
    assert round_seconds(c, "ssd_fast", 8, 2) == pytest.approx(max(c.verify_time(24), 0.180))
    assert round_seconds(c, "ssd_fast", 1, 2) == pytest.approx(max(c.verify_time(3), 0.040))


def test_speculation_batch_factor_comes_from_start_up_timings(models):
    with LLM(target=models[0], draft=models[1], mode="ssd", dtype="float32", max_len=64, use_ray=False) as llm:
        f = llm.engine.mode.cost.spec_batch_factor
        assert f is not None and f(1) == pytest.approx(1.0) and f(8) > 1.0


def test_gated_sd_at_a_batch_prices_its_longest_draft_and_the_tokens_verified():
    """Gated drafts stop at different lengths: the batch's draft forwards run until the longest stops, and the
    target verifies each sequence's own draft (not batch x (longest + 1) tokens)."""
    from ssd.policy import GatedSD

    c = CostModel(gated_sd=GatedSD())
    c.verify, c.draft_step = VerifyLine(Ema(0.030), Ema(0.006)), Ema(0.004)
    c.gated_sd.observe(c.acceptance.value, [8, 2, 2, 2], [9, 3, 3, 3])
    assert c.gated_sd.longest.value == 8 and c.gated_sd.length.value == 3.5
    _, scores = choose(c, 4, 3, prepared=0.0)
    e = c.gated_sd.gain.value * expected_tokens(c.acceptance.value, 3.5)
    t_round = c.draft_time(8) + c.lent_verify_time(4 * (round(3.5) + 1))
    assert scores["sd"] == pytest.approx(t_round / (4 * e))


def test_the_backlog_is_priced_by_its_total_over_the_batch(models, monkeypatch):
    """The first SD / SSD forward feeds every sequence's unfed tokens: the policy prices their sum, not the
    longest one's."""
    import ssd.modes.ssd as ssd_mode
    from ssd.sampling_params import SamplingParams
    from ssd.sequence import Sequence

    asked = {}
    monkeypatch.setattr(ssd_mode, "choose", lambda cost, batch, k, allowed, ngram=None, **kw: (
        asked.update(kw), ("ar", dict.fromkeys(allowed, 1.0)))[1])
    mode = ssd_mode.SSDMode(None, None, 4, planner=None, allowed=ssd_mode.policy_options("auto", "auto"),
                            vocab_size=100)
    seqs = [Sequence(i, list(range(20)), SamplingParams(max_tokens=100), [], None) for i in range(3)]
    for s in seqs:
        s.output_ids = [1, 2]
    mode._lag = {0: 10, 1: 20, 2: 0}
    mode._choose(seqs)
    assert asked["lag"] == 30 and mode._round_lag == 20 and mode._round_backlog == 30
