"""Geometric fan-out formula and the batch-size-aware policy."""

import math
import random

import pytest

from ssd import policy
from ssd.fanout import FanoutPlanner, expected_hit_rate, geometric_fanout, geometric_weights, round_keep_sum
from ssd.policy import CostModel, Ema, VerifyLine, choose, expected_tokens, round_seconds


def test_geometric_formula_values():
    a, r, K = 0.8, 1.0, 3
    w = geometric_weights(a, r, K)
    e = 1 / (1 + r)
    assert w[:K] == pytest.approx([a ** (k * e) for k in range(K)])
    assert w[K] == pytest.approx(a ** (K * e) * (1 - a) ** (-e))
    B = 20
    f0 = B / sum(w)
    exact = [f0 * v for v in w]
    got = geometric_fanout(a, r, K, B)
    assert sum(got) == B
    assert all(abs(g - x) < 1 for g, x in zip(got, exact))


@pytest.mark.parametrize("B", [1, 4, 7, 16, 33, 100])
@pytest.mark.parametrize("a", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("r", [0.3, 1.0, 3.0])
def test_rounding_keeps_the_budget(B, a, r):
    f = geometric_fanout(a, r, 5, B)
    assert len(f) == 6 and sum(f) == B and min(f) >= 0


def test_round_keep_sum_is_largest_remainder():
    assert round_keep_sum([1.5, 1.5, 1.0], 4) == [2, 1, 1]
    assert round_keep_sum([0.2, 0.3, 0.5], 1) == [0, 0, 1]


def test_monotone_in_acceptance_rate():
    """Higher a -> more budget on the all-accepted outcome, less on early rejections."""
    prev = None
    for a in [0.1, 0.3, 0.5, 0.7, 0.9, 0.97]:
        w = geometric_weights(a, 1.0, 4)
        share = [v / sum(w) for v in w]
        if prev is not None:
            assert share[-1] > prev[-1]
            assert share[0] < prev[0]
        prev = share


def test_geometric_beats_uniform_in_model_hit_rate():
    a, r, K, B = 0.85, 1.0, 4, 15
    geo = geometric_fanout(a, r, K, B)
    uni = [3] * 5
    assert expected_hit_rate(geo, a, r) > expected_hit_rate(uni, a, r)


def test_planner_fits_r_and_tracks_acceptance():
    pl = FanoutPlanner(K=3, B=12)
    assert pl.r == pl.r_default
    true_r = 1.5
    for f in (2, 4, 8):
        miss = f ** (-true_r)
        n = 1000
        hits = round(n * (1 - miss))
        for i in range(n):
            pl.observe_hit(f, i < hits)
    assert pl.r == pytest.approx(true_r, rel=0.05)
    for _ in range(50):
        pl.observe_round(7, "primary", drafted=3, accepted=3)
    assert pl.acceptance(7, "primary") > 0.95
    assert pl.acceptance(7, "backup") == pl.a_default  # separate schedules after a hit / a miss
    assert sum(pl.plan(7, "primary")) == 12
    assert pl.plan(7, "primary")[-1] > pl.plan(7, "backup")[-1]


def test_explicit_fanout_validated():
    with pytest.raises(ValueError, match="K \\+ 1"):
        FanoutPlanner(K=3, B=4, explicit=[1, 1, 2])


def costs(v0, v1, draft_step, speculate, a, p_hit, a_fast=0.2):
    c = CostModel()
    c.verify = VerifyLine(Ema(v0), Ema(v1))
    c.draft_step, c.speculate = Ema(draft_step), Ema(speculate)
    c.acceptance, c.fast_acceptance = Ema(a), Ema(a_fast)
    # the same hit rate whatever the acceptance and the draft verified
    c.hit_full = c.hit_partial = c.hit_after_neural = c.hit_after_fast = Ema(p_hit)
    return c


def test_policy_batch1_high_hit_rate_chooses_ssd():
    c = costs(v0=0.06, v1=0.001, draft_step=0.02, speculate=0.05, a=0.85, p_hit=0.9)
    best, scores = choose(c, batch=1, k=4)
    assert best.startswith("ssd")
    assert scores[best] < scores["sd"] < scores["ar"]


def test_policy_prices_the_draft_an_unprepared_ssd_round_needs_first():
    """After AR / SD / n-gram rounds no speculation is ready: an SSD round then drafts just in time
    (neural) or by lookup (fast) first, a one-off cost spread over the SWITCH_HORIZON rounds a switch
    lasts. Steady-state neural SSD beats AR here by less than that: a switch into it does not pay."""
    h = policy.SWITCH_HORIZON
    c = costs(v0=0.12, v1=0.01, draft_step=0.05, speculate=0.12, a=0.5, p_hit=0.5, a_fast=0.1)
    neural = ("ssd_neural", "ar")
    best, ready = choose(c, batch=1, k=3, allowed=neural)
    assert best == "ssd_neural"
    best, cold = choose(c, batch=1, k=3, allowed=neural, prepared=0.0)
    assert best == "ar"
    e_sd, e_fast = expected_tokens(0.5, 3), expected_tokens(0.1, 3)
    assert cold["ssd_neural"] - ready["ssd_neural"] == pytest.approx(3 * 0.05 / (h * e_sd))  # a 3-step draft
    steady = 0.5 * e_sd + 0.5 * e_fast  # fast: the first round's drafts are lookups, the rest as usual
    overlap = max(c.verify_time(4), 0.12)
    assert ready["ssd_fast"] == pytest.approx(overlap / steady)
    assert cold["ssd_fast"] == pytest.approx(h * overlap / (e_fast + (h - 1) * steady))
    assert cold["ar"] == ready["ar"]


def test_policy_large_batch_stops_speculating():
    # compute-bound verification: cost grows with every scored token
    c = costs(v0=0.01, v1=0.004, draft_step=0.05, speculate=0.3, a=0.6, p_hit=0.7)
    best, _ = choose(c, batch=256, k=4)
    assert best == "ar"


def test_policy_prefers_fast_backup_when_misses_stall_a_big_batch():
    c = costs(v0=0.06, v1=0.0001, draft_step=0.01, speculate=0.05, a=0.8, p_hit=0.7, a_fast=0.2)
    best, scores = choose(c, batch=16, k=4, allowed=("ssd_neural", "ssd_fast"))
    assert best == "ssd_fast" and scores["ssd_fast"] < scores["ssd_neural"]
    best1, _ = choose(c, batch=1, k=4, allowed=("ssd_neural", "ssd_fast"))
    assert best1 == "ssd_neural"


def test_policy_picks_the_cheaper_of_injected_options():
    # a slow draft and low acceptance: SD loses to AR, SSD can't hide the draft either
    c = costs(v0=0.05, v1=0.0, draft_step=0.2, speculate=1.0, a=0.1, p_hit=0.1, a_fast=0.0)
    best, scores = choose(c, batch=1, k=4)
    assert best == "ar" and scores["sd"] > scores["ar"] and scores["ngram"] >= scores["ar"]


def test_policy_takes_ngram_sd_when_lookups_are_accepted():
    # code that copies its context: n-gram drafts accepted 80 %, a slow draft model
    c = costs(v0=0.1, v1=0.01, draft_step=0.08, speculate=0.4, a=0.5, p_hit=0.5, a_fast=0.8)
    best, scores = choose(c, batch=1, k=4)
    assert best == "ngram" and scores["ngram"] < min(scores[o] for o in ("sd", "ssd_neural", "ssd_fast", "ar"))
    c.fast_acceptance = type(c.fast_acceptance)(0.05)
    assert choose(c, batch=1, k=4)[0] != "ngram"


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert math.isfinite(expected_tokens(1.0, 4))


# -- auto-configured K: the SD tuner ---------------------------------------------------------------

CHEAP_VERIFY = {n: 0.10 + 0.005 * n for n in range(2, 10)}  # verification nearly flat in n (GPU-like)


def test_k_tuner_grows_k_when_drafts_are_accepted_and_shrinks_it_when_not():
    from ssd.autoconfig import K_CHOICES, PRIOR_ACCEPTANCE, KTuner, _choose_sd

    tuner = KTuner(t_verify=CHEAP_VERIFY, t_draft1=0.02)
    assert tuner.acceptance == pytest.approx(PRIOR_ACCEPTANCE)
    assert tuner.choose() == _choose_sd(CHEAP_VERIFY, 0.02, PRIOR_ACCEPTANCE)
    for _ in range(30):
        tuner.observe(drafted=tuner.choose(), accepted=tuner.choose())  # everything accepted
    assert tuner.acceptance > 0.95 and tuner.choose() == max(K_CHOICES)
    for _ in range(30):
        tuner.observe(drafted=tuner.choose(), accepted=0)
    assert tuner.acceptance < 0.5 and tuner.choose() == min(K_CHOICES)
    tuner.observe(drafted=0, accepted=0)  # an empty draft says nothing
    assert tuner.acceptance < 0.5


def test_k_tuner_prices_drafts_at_their_measured_cost():
    """Lookahead guesses make draft tokens cheaper than start-up's one forward each: once drafts are
    measured at a third of that, the tuner drafts longer; measured dearer, shorter."""
    from ssd.autoconfig import KTuner, _choose_sd

    slow_verify = {n: 0.10 + 0.002 * n for n in range(2, 10)}
    tuner = KTuner(t_verify=slow_verify, t_draft1=0.03)
    start = tuner.choose()
    for _ in range(20):
        tuner.observe_draft(start, start * 0.01)
    assert tuner.draft_scale == pytest.approx(1 / 3, rel=0.01)
    assert tuner.choose() == _choose_sd(slow_verify, 0.01, tuner.acceptance) > start
    for _ in range(20):
        tuner.observe_draft(4, 4 * 0.09)
    assert tuner.choose() < start
    tuner.observe_draft(0, 0.5)  # an empty draft says nothing
    assert tuner.draft_scale == pytest.approx(3, rel=0.01)


def test_ssd_tuner_grows_k_when_drafts_are_accepted_and_shrinks_it_when_not():
    from ssd.autoconfig import K_CHOICES, PRIOR_ACCEPTANCE, SSDTuner, _choose_ssd

    chain = {n: 0.010 + 0.001 * n for n in range(1, 40)}  # a draft far faster than the target
    branch = {n: 0.005 + 0.0005 * n for n in range(1, 40)}
    tuner = SSDTuner(t_verify=CHEAP_VERIFY, t_chain=chain, t_branch=branch)
    assert tuner.choose() == _choose_ssd(CHEAP_VERIFY, chain, branch, PRIOR_ACCEPTANCE)
    for _ in range(30):
        k, _ = tuner.choose()
        tuner.observe(drafted=k, accepted=k)
    k, b = tuner.choose()
    assert k == max(K_CHOICES) and b >= 1
    for _ in range(30):
        tuner.observe(drafted=tuner.choose()[0], accepted=0)
    assert tuner.choose()[0] == min(K_CHOICES)


def test_tuners_follow_each_requests_own_acceptance():
    """A request starts from the engine-wide estimate and its own rounds take over within a few rounds,
    where the engine-wide counts still price the previous request's acceptance."""
    from ssd.autoconfig import K_CHOICES, KTuner, SSDTuner

    chain = {n: 0.010 + 0.001 * n for n in range(1, 40)}
    branch = {n: 0.005 + 0.0005 * n for n in range(1, 40)}
    for tuner in (KTuner(t_verify=CHEAP_VERIFY, t_draft1=0.02),
                  SSDTuner(t_verify=CHEAP_VERIFY, t_chain=chain, t_branch=branch)):
        def k_of(ids=(), tuner=tuner):
            c = tuner.choose(ids)
            return c if isinstance(c, int) else c[0]

        for _ in range(30):  # request 1: every draft accepted
            tuner.observe(k_of([1]), k_of([1]), seq_id=1)
        assert k_of([1]) == k_of() == max(K_CHOICES)
        assert k_of([2]) == k_of()  # a new request starts from what the engine saw
        for _ in range(3):  # request 2 rejects its first token three rounds running
            tuner.observe(k_of([2]), 0, seq_id=2)
        assert tuner.acceptance_of([2]) < 0.6 < 0.9 < tuner.acceptance
        assert k_of([2]) < k_of() == max(K_CHOICES)  # the engine-wide counts still price K = max
        assert k_of([1]) == max(K_CHOICES)  # request 1 keeps its own estimate
        assert tuner.acceptance_of([1]) > tuner.acceptance_of([1, 2]) > tuner.acceptance_of([2])
        tuner.forget(2)
        assert tuner.acceptance_of([2]) == tuner.acceptance and 2 not in tuner.requests


def test_ssd_tuner_corrects_start_up_latencies_with_measured_rounds():
    from ssd.autoconfig import SSDTuner, spec_time

    chain = {n: 0.010 + 0.001 * n for n in range(1, 40)}
    branch = {n: 0.005 + 0.0005 * n for n in range(1, 40)}
    tuner = SSDTuner(t_verify=CHEAP_VERIFY, t_chain=chain, t_branch=branch)  # prior acceptance 0.8
    k0, b0 = tuner.choose()
    for _ in range(40):  # the speculation really takes 20x its start-up estimate and always overruns
        k, b = tuner.choose()
        t_spec = 20 * spec_time(chain, branch, k, b)
        tuner.observe_round_times(k, b, CHEAP_VERIFY[k + 1], t_spec, t_spec - CHEAP_VERIFY[k + 1] + 0.01)
    assert tuner.spec_scale == pytest.approx(20, rel=0.01)
    assert tuner.t_fixed == pytest.approx(0.01, rel=0.05)  # the wait the overrun does not explain
    k1, b1 = tuner.choose()
    assert k1 < k0 and b1 < b0  # a slower draft: shorter, narrower speculation
    tuner.observe_round_times(99, 1, 1.0, 1.0, 0.0)  # a length never measured at start-up: ignored
    assert tuner.spec_scale == pytest.approx(20, rel=0.01)


def test_ssd_tuner_prices_misses_from_their_own_waits():
    """A miss's just-in-time draft calibrates the miss price (miss_scale), not the fixed per-round wait:
    counted in both, every miss would be paid twice, and a constant per round favours long drafts."""
    from ssd.autoconfig import SSDTuner, _choose_ssd, spec_time

    chain = {n: 0.010 + 0.001 * n for n in range(1, 40)}
    branch = {n: 0.005 + 0.0005 * n for n in range(1, 40)}
    tuner = SSDTuner(t_verify=CHEAP_VERIFY, t_chain=chain, t_branch=branch)
    k, b = 2, 3
    t_spec = spec_time(chain, branch, k, b)
    overrun = max(0.0, t_spec - CHEAP_VERIFY[k + 1])
    for i in range(60):  # hits wait 2 ms; every other round misses and drafts k tokens at 3x their start-up time
        miss = i % 2 == 1
        wait = overrun + 0.002 + (3 * k * branch[1] if miss else 0.0)
        tuner.observe_round_times(k, b, CHEAP_VERIFY[k + 1], t_spec, wait, jit_draft=miss)
    assert tuner.t_fixed == pytest.approx(0.002, rel=0.01)
    assert tuner.miss_scale == pytest.approx(3.0, rel=0.01)
    a = tuner.acceptance
    assert tuner.choose() == _choose_ssd(CHEAP_VERIFY, chain, branch, a, tuner.verify_scale, tuner.spec_scale,
                                         0.002, miss_scale=3.0)
    # a dearer miss moves the choice towards what misses less or costs less to redraft
    cheap = _choose_ssd(CHEAP_VERIFY, chain, branch, 0.6, hit_rate=lambda b: min(0.95, 0.3 + 0.05 * b))
    dear = _choose_ssd(CHEAP_VERIFY, chain, branch, 0.6, hit_rate=lambda b: min(0.95, 0.3 + 0.05 * b), miss_scale=50.0)
    assert dear != cheap and (dear[0] < cheap[0] or dear[1] > cheap[1])


def test_autoconfig_hit_model_credits_the_drafts_top_choice_at_the_bonus_position():
    from ssd.autoconfig import budgets, model_hit_rate

    a, r = 0.98, 1.0
    # one branch at k = K hits when all K drafts are accepted and the bonus is the draft's top choice
    assert model_hit_rate([0, 0, 0, 1], a, r) == pytest.approx(a**3 * a)
    # positions k < K follow the paper's power law exactly
    assert model_hit_rate([4, 2, 0, 0], a, r) == pytest.approx(expected_hit_rate([4, 2, 0, 0], a, r))
    assert budgets(3) == [1, 2, 4, 8, 12, 16]


def test_planner_plans_for_a_draft_of_another_length():
    planner = FanoutPlanner(K=4, B=10)
    assert sum(planner.plan(0, "primary")) == 10 and len(planner.plan(0, "primary")) == 5
    short = planner.plan(0, "primary", k=1)
    assert len(short) == 2 and sum(short) == 4  # budget scaled to 2 of 5 positions
    long = planner.plan(0, "primary", k=6)
    assert len(long) == 7 and sum(long) == 14


def record_choices(tuner) -> list:
    """Wrap tuner.choose so each call appends (request ids, choice); returns that list."""
    chosen: list = []
    choose = tuner.choose
    tuner.choose = lambda ids=(): chosen.append((list(ids), choose(ids))) or chosen[-1][1]
    return chosen


def test_ssd_with_auto_k_tunes_and_stays_exact(models, ar_outputs):
    from tiny_models import GREEDY, PROMPTS

    from ssd import LLM

    with LLM(target=models[0], draft=models[0], mode="ssd", dtype="float32", max_batch=3, max_len=160) as llm:
        mode = llm.engine.mode
        tuner = mode.tuner
        assert tuner is not None
        chosen = record_choices(tuner)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        assert tuner.acceptance > 0.9  # draft == target: every draft accepted
        assert chosen and all(ids for ids, _ in chosen)  # every round chose for its own requests
        assert (mode.k, mode.planner.B) == chosen[-1][1]  # and the mode took that choice
        assert not tuner.requests  # finished requests' counts are gone
    with LLM(target=models[0], draft=models[1], mode="ssd", fanout=6, dtype="float32", max_len=160) as llm:
        assert llm.engine.mode.tuner is None  # a fan-out the user fixed keeps K fixed too


def test_ssd_with_a_users_k_still_fits_its_budget_to_the_measured_latencies(models, ar_outputs):
    """K given, fan-out not: start-up times the pair at that K and picks the budget B that fits the speculation
    inside a verification, re-chosen every round; K never moves, the policy starts from the measured prices.
    (Before, B was 2 per position, unmeasured: on the real pair, placement a, K = 4 spent 43 % of its time
    waiting for overrunning speculations, 0.58x the auto-configured SSD.)"""
    from tiny_models import GREEDY, PROMPTS

    from ssd import LLM
    from ssd.autoconfig import budgets

    with LLM(target=models[0], draft=models[1], mode="ssd", k=3, dtype="float32", max_batch=3, max_len=160) as llm:
        mode = llm.engine.mode
        tuner = mode.tuner
        assert tuner is not None and not tuner.chooses_k and set(tuner.t_verify) == {1, 4}
        assert min(mode.cost.verify.v0.n, mode.cost.draft_step.n, mode.cost.speculate.n) == 1  # seeded
        chosen = record_choices(tuner)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        assert chosen and all(k == 3 and b in budgets(3) for _, (k, b) in chosen)
        assert (mode.k, mode.planner.B) == chosen[-1][1]
    with LLM(target=models[0], draft=models[1], mode="ssd", k=3, fanout=5, dtype="float32", max_len=160) as llm:
        assert llm.engine.mode.tuner is None and llm.engine.mode.planner.B == 5  # both fixed: nothing measured


def test_sd_with_auto_k_tunes_and_stays_exact(models, ar_outputs):
    from tiny_models import GREEDY, PROMPTS

    from ssd import LLM

    with LLM(target=models[0], draft=models[0], mode="sd", dtype="float32", max_batch=3, max_len=160) as llm:
        tuner = llm.engine.mode.tuner
        assert tuner is not None
        # The K chosen for each round's own requests (after they finish, choose() falls back to the
        # engine-wide counts, which may tip a near tie of measured times the other way).
        chosen = record_choices(tuner)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        assert tuner.acceptance > 0.9  # draft == target: every draft accepted
        assert chosen and all(ids for ids, _ in chosen)  # every round chose for its own requests
        assert llm.stats()["k"] == chosen[-1][1]  # and the mode took that choice
        assert not tuner.requests  # finished requests' counts are gone
    with LLM(target=models[0], draft=models[1], mode="sd", k=3, dtype="float32", max_len=160) as llm:
        assert llm.engine.mode.tuner is None  # a K the user fixed stays fixed


def test_seeding_from_measured_latencies():
    c = CostModel()
    c.seed({1: 0.1, 3: 0.2, 5: 0.3}, draft_step=0.04, speculate=0.25)
    assert c.verify_time(1) == pytest.approx(0.1) and c.verify_time(5) == pytest.approx(0.3)
    assert (c.draft_step.value, c.speculate.value) == (0.04, 0.25)
    c.observe_verify(1, 0.12)  # a seed counts as one observation: rounds refine it, not replace it
    assert 0.1 < c.verify_time(1) < 0.12
    with pytest.raises(ValueError, match="one-token time"):
        CostModel().seed({3: 0.2, 5: 0.3})


def test_seeded_verification_cost_keeps_rejected_ngram_rounds_off():
    """Prose: n-gram drafts accepted 15 % of the time. With the generic 2 ms/token slope a 4-token n-gram
    round looks cheaper per token than AR; with a CPU's measured slope it is not."""
    allowed = ("ar", "ngram")
    generic = costs(v0=0.05, v1=0.002, draft_step=0.02, speculate=0.08, a=0.7, p_hit=0.5, a_fast=0.15)
    assert choose(generic, batch=1, k=3, allowed=allowed)[0] == "ngram"
    generic.seed({1: 0.1, 4: 0.25, 6: 0.35})
    assert choose(generic, batch=1, k=3, allowed=allowed)[0] == "ar"


def test_auto_starts_from_the_measured_latencies():
    from tiny_models import random_model

    from ssd import LLM

    with LLM(target=random_model(vocab=40, layers=2, seed=3), draft=random_model(vocab=40, layers=1, seed=4),
             mode="auto", dtype="float32", max_batch=1, max_len=128) as llm:
        cost = llm.engine.mode.cost
        # seeded, no round run yet
        assert min(cost.verify.v0.n, cost.verify.v1.n, cost.draft_step.n, cost.speculate.n) == 1
        assert set(cost.verify.bend) == set(llm.engine.mode.tuner.t_verify)  # every measured point priced as measured
        from ssd.sampling_params import SamplingParams

        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=12))
        stats, rounds = llm.engine.mode.stats, llm.engine.mode.stats.rounds
        # Every round's verification was priced, and the mean error is reported.
        assert rounds > 0 and sum(stats.priced.values()) == rounds
        assert set(llm.stats()["verify_price_error"]) == set(stats.priced) and all(
            e > 0 for e in llm.stats()["verify_price_error"].values())


def test_measured_round_times_correct_the_modelled_prices():
    """Rounds that take longer than the model says (host time, a backup's catch-up) raise that option's
    price by the measured ratio, within CALIBRATION_RANGE; AR measured as modelled keeps its price."""
    c = costs(v0=0.12, v1=0.01, draft_step=0.05, speculate=0.12, a=0.5, p_hit=0.9)
    allowed = ("ssd_neural", "ar")
    best, before = choose(c, batch=1, k=3, allowed=allowed)
    assert best == "ssd_neural" and before["ssd_neural"] * 1.6 > before["ar"]
    t_ssd, t_ar = round_seconds(c, "ssd_neural", 1, 3, missed=0.1), round_seconds(c, "ar", 1, 3)
    for _ in range(300):
        c.observe_round("ssd_neural", t_ssd, 1.6 * t_ssd)
        c.observe_round("ar", t_ar, t_ar)
    best, after = choose(c, batch=1, k=3, allowed=allowed)
    assert best == "ar"
    assert after["ssd_neural"] == pytest.approx(1.6 * before["ssd_neural"], rel=0.01)
    assert after["ar"] == pytest.approx(before["ar"], rel=0.01)
    for _ in range(300):
        c.observe_round("ar", t_ar, 5 * t_ar)
    clamped = choose(c, batch=1, k=3, allowed=allowed)[1]["ar"]
    assert clamped == pytest.approx(policy.CALIBRATION_RANGE[1] * before["ar"])


def test_calibration_follows_within_a_prompt():
    """The calibration's prior weighs as one round, not as one second: rounds of ~80 ms measured 1.3x their
    price move the factor most of the way within the ~25 rounds of one prompt."""
    c = costs(v0=0.03, v1=0.01, draft_step=0.01, speculate=0.06, a=0.8, p_hit=0.7)
    t = round_seconds(c, "ssd_neural", 1, 2)
    assert 0.05 < t < 0.1
    for _ in range(25):
        c.observe_round("ssd_neural", t, 1.3 * t)
    assert 1.2 < c.calibration_factor("ssd_neural") < 1.3


def test_calibration_counts_time_not_tokens():
    """Rounds that take the modelled time but emit fewer tokens than expected (acceptance or hits below
    their estimates) leave the calibration alone: the rates themselves measure tokens, and a ratio of
    seconds per token counted a lagging hit rate twice."""
    c = costs(v0=0.09, v1=0.014, draft_step=0.03, speculate=0.12, a=0.7, p_hit=0.5)
    for hit in [True, False] * 50:
        t = round_seconds(c, "ssd_neural", 1, 2, missed=0.0 if hit else 1.0)
        c.observe_round("ssd_neural", t, t)  # on time, however few tokens came out
    assert c.calibration_factor("ssd_neural") == pytest.approx(1.0)
    assert round_seconds(c, "ssd_neural", 1, 2, missed=1.0) - round_seconds(c, "ssd_neural", 1, 2) == \
        pytest.approx(2 * 0.03)  # a neural miss costs a just-in-time draft of k steps


def test_ssd_hit_rate_follows_acceptance_measured_elsewhere():
    """The draft predicts a bonus token (all drafts accepted) far better than a correction. After a prose
    stretch (acceptance 0.5: few full acceptances, few hits) the policy leaves SSD, and hits are no longer
    observed while SD rounds keep measuring acceptance. When acceptance recovers, SSD's hit rate is
    re-priced from the two observed rates; one observed rate would stay at the prose dip."""
    k = 3
    c = costs(v0=0.09, v1=0.014, draft_step=0.03, speculate=0.12, a=0.5, p_hit=0.5, a_fast=0.05)
    c.hit_full, c.hit_partial = policy.RateEma(0.8, policy.RATE_ALPHA), policy.RateEma(0.3, policy.RATE_ALPHA)
    one_rate = policy.RateEma(0.5, policy.RATE_ALPHA)
    rng = random.Random(0)
    for _ in range(400):  # SSD rounds on prose
        full = rng.random() < 0.5**k
        hit = rng.random() < (0.9 if full else 0.1)
        c.observe_hit("primary", full, hit)
        one_rate.update(float(hit), 1.0)
    assert c.hit_full.value > 0.6 and c.hit_partial.value < 0.25 and one_rate.value < 0.3
    assert c.hit_rate(k) == pytest.approx(0.5**k * c.hit_full.value + (1 - 0.5**k) * c.hit_partial.value)
    assert c.hit_rate(k) == pytest.approx(one_rate.value, abs=0.1)  # the same rate on the prose itself
    c.acceptance = Ema(0.9)  # SD rounds measured the recovery
    assert c.hit_rate(k) > 0.6
    split = choose(c, 1, k)[1]
    c.hit_full = c.hit_partial = one_rate
    stale = choose(c, 1, k)[1]
    for option in ("ssd_fast", "ssd_neural"):
        assert split[option] < 0.9 * stale[option]
    assert split["sd"] == stale["sd"] and split["ar"] == stale["ar"]


def test_misses_come_in_runs():
    """The steady share of SSD rounds verifying a cached draft: a two-state chain (hit -> miss at 1 - p,
    backup -> hit at the backup rounds' own rate). With backup rounds hitting less often than cached
    ones, fewer rounds verify cached drafts than the cached rounds' hit rate says, and the fast backup's
    price rises."""
    c = costs(v0=0.09, v1=0.014, draft_step=0.03, speculate=0.12, a=0.7, p_hit=0.6, a_fast=0.05)
    assert c.share_primary(3, "fast") == pytest.approx(0.6)  # backup rounds hit as often: the plain rate
    even = choose(c, 1, 3)[1]
    c.hit_after_fast = Ema(0.3)
    share = 0.3 / (0.3 + 1 - 0.6)
    assert c.share_primary(3, "fast") == pytest.approx(share)
    runs = choose(c, 1, 3)[1]
    e_sd, e_fast = expected_tokens(0.7, 3), expected_tokens(0.05, 3)
    assert runs["ssd_fast"] / even["ssd_fast"] == pytest.approx(
        (0.6 * e_sd + 0.4 * e_fast) / (share * e_sd + (1 - share) * e_fast))
    assert runs["ssd_neural"] == even["ssd_neural"]  # the neural backup's rounds have their own rate
    c.hit_after_neural = Ema(0.3)
    assert choose(c, 1, 3)[1]["ssd_neural"] > runs["ssd_neural"]  # more misses: more just-in-time drafts


@pytest.mark.parametrize("ratio,kept", [(0.95, True), (0.85, False)])
def test_leaving_a_ready_ssd_pipeline_needs_a_clear_margin(ratio, kept):
    """From a ready SSD pipeline, AR at 95 % of SSD's price is not taken (the prepared speculation would be
    lost and coming back pays a catch-up); at 85 % it is. Without a ready pipeline the cheaper one wins."""
    c = costs(v0=0.12, v1=0.01, draft_step=0.05, speculate=0.12, a=0.5, p_hit=0.5, a_fast=0.1)
    allowed = ("ssd_fast", "ar")
    base = choose(c, batch=1, k=3, allowed=allowed)[1]
    c.calibration["ar"] = policy.RateEma(ratio * base["ssd_fast"] / base["ar"])  # AR's price: ratio x SSD's
    assert choose(c, batch=1, k=3, allowed=allowed)[0] == "ar"
    assert choose(c, batch=1, k=3, allowed=allowed, prepared=0.0, current="ssd_fast")[0] == "ar"
    best = choose(c, batch=1, k=3, allowed=allowed, current="ssd_fast")[0]
    assert best == ("ssd_fast" if kept else "ar")
    assert policy.SWITCH_MARGIN == 0.9


@pytest.mark.parametrize("ratio,kept", [(0.9, True), (0.8, False)])
def test_leaving_sd_needs_a_clear_margin(ratio, kept):
    """After an SD round, AR priced at 90 % of SD is not taken (SD's rounds are the best-measured option);
    at 80 % it is. Coming from another option, or with SD not allowed, the cheaper one wins."""
    c = costs(v0=0.12, v1=0.01, draft_step=0.08, speculate=0.12, a=0.8, p_hit=0.5, a_fast=0.1)  # SD ~ AR
    allowed = ("sd", "ar")
    base = choose(c, batch=1, k=3, allowed=allowed)[1]
    c.calibration["ar"] = policy.RateEma(ratio * base["sd"] / base["ar"])  # AR's price: ratio x SD's
    assert choose(c, batch=1, k=3, allowed=allowed)[0] == "ar"
    assert choose(c, batch=1, k=3, allowed=allowed, current="ar")[0] == "ar"
    assert choose(c, batch=1, k=3, allowed=allowed, current="sd")[0] == ("sd" if kept else "ar")
    assert choose(c, batch=1, k=3, allowed=("ar",), current="sd")[0] == "ar"
    assert policy.SD_STAY_MARGIN == 0.85


def test_plain_sd_option_prices_and_drafts_its_own_length():
    """With cheap draft steps and a well-accepted draft, SD's best draft is longer than SSD's K; choose()
    prices SD at that length (the minimum of its seconds per token), and the other options at K."""
    from ssd.policy import best_sd_len

    c = CostModel()
    c.verify, c.draft_step = VerifyLine(Ema(0.05), Ema(0.004)), Ema(0.006)
    c.acceptance = policy.RateEma(0.85)

    def per_token(k: int) -> float:
        return (k * 0.006 + c.verify_time(k + 1)) / expected_tokens(0.85, k)

    k_sd = best_sd_len(c, 0.85, 1, 8)
    assert k_sd > 3 and per_token(k_sd) == min(per_token(k) for k in range(1, 9))
    _, at_k = choose(c, 1, 3)
    _, own = choose(c, 1, 3, k_sd=k_sd)
    assert own["sd"] == pytest.approx(per_token(k_sd)) and own["sd"] < at_k["sd"]
    assert {o: s for o, s in own.items() if o != "sd"} == {o: s for o, s in at_k.items() if o != "sd"}
    c.draft_step, c.acceptance = Ema(0.05), policy.RateEma(0.4)  # slow, rarely accepted drafts: short ones
    assert best_sd_len(c, 0.4, 1, 8) < 3
    c.enable_borrow(0.5)  # cheaper verification on borrowed cores moves the balance towards longer drafts
    assert best_sd_len(c, 0.4, 1, 8) >= best_sd_len(CostModel(verify=c.verify, draft_step=c.draft_step), 0.4, 1, 8)


@pytest.mark.parametrize("fixed_k", [None, 3])
def test_auto_sd_rounds_draft_the_sd_length_and_stay_exact(models, ar_outputs, monkeypatch, fixed_k):
    """Where K is auto-configured, auto's SD rounds draft best_sd_len's length (SSD rounds keep K); a K
    the user fixed holds for SD rounds too. Greedy output equals AR either way. (Ungated: gated SD rounds
    draft up to SD_K_MAX and stop by confidence, tests/test_draft_gate.py.)"""
    from test_ssd_engine import cycle_policy
    from tiny_models import GREEDY, PROMPTS

    import ssd.modes.ssd as ssd_mode
    from ssd import LLM

    cycle_policy(monkeypatch, ["sd", "sd", "ssd_neural", "sd"])
    monkeypatch.setattr(ssd_mode, "best_sd_len", lambda cost, a, batch, k_max: 7)  # 7: no SSD K choice
    with LLM(target=models[0], draft=models[1], mode="auto", k=fixed_k, dtype="float32", max_batch=1,
             max_len=160, draft_gate=False) as llm:
        mode = llm.engine.mode
        lens: list[int] = []
        real = mode.draft.call

        def spy(method, *args):
            if method == "propose" and mode.last_choice == "sd":
                lens.extend(n for _, n in args[0])
            return real(method, *args)

        monkeypatch.setattr(mode.draft, "call", spy)
        outs = llm.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs[:2]
        want = 7 if fixed_k is None else fixed_k
        assert lens and max(lens) == want and set(lens) <= set(range(want + 1))
        # the budget is re-chosen every round either way; K only where the user left it open
        assert mode.tuner is not None and mode.tuner.chooses_k == (fixed_k is None)
        assert fixed_k is None or mode.k == fixed_k


def test_just_in_time_drafts_fit_a_line_so_one_step_drafts_do_not_inflate_the_step():
    """A draft call costs an intercept (RPC, the core loan's switch) plus k forwards: one-step drafts move
    only the intercept, longer ones the slope too, and a series of both recovers the line."""
    c = CostModel()
    c.draft_step, c.draft_call = Ema(0.015), Ema(0.0)
    for _ in range(200):
        c.observe_draft(1, 0.010 + 0.015)  # 10 ms of overhead per call, 15 ms per step
    assert c.draft_step.value == 0.015 and c.draft_call.value == pytest.approx(0.010, abs=1e-4)
    for _ in range(400):
        for k, n in ((1, 0.010 + 0.015), (4, 0.010 + 4 * 0.020)):  # the steps got slower
            c.observe_draft(k, n)
    assert c.draft_time(4) == pytest.approx(0.090, rel=0.05) and c.draft_time(1) == pytest.approx(0.025, rel=0.15)
    assert c.draft_time(0) == 0.0
    # Priced as a line, the one-step overhead no longer makes every extra step look as dear as the first.
    c.verify = VerifyLine(Ema(0.05), Ema(0.004))
    c.draft_step, c.draft_call = Ema(0.015), Ema(0.010)
    per_step_only = CostModel(verify=c.verify, draft_step=Ema(0.025))
    assert policy.best_sd_len(c, 0.8, 1, 8) > policy.best_sd_len(per_step_only, 0.8, 1, 8)


def test_the_policy_and_the_k_tuner_start_from_one_acceptance_prior():
    from ssd.autoconfig import PRIOR_ACCEPTANCE

    assert policy.CostModel().acceptance.value == PRIOR_ACCEPTANCE == policy.ACCEPTANCE_PRIOR


def test_tuners_price_the_batch_they_choose_for():
    """A batch of n verifies n x (K + 1) tokens and speculates n x B branches a round: on a CPU-like line
    (verification growing with its tokens) the tuners pick shorter drafts and smaller budgets for a batch,
    and the tuners' choice for n sequences is the model's at batch n (one sequence: unchanged)."""
    from ssd.autoconfig import KTuner, SSDTuner, _choose_sd, _choose_ssd, rows_time

    cpu_verify = {n: 0.030 + 0.006 * n for n in [1, *range(2, 10)]}
    chain = {n: 0.010 + 0.002 * n for n in range(1, 10)}
    branch = {n: 0.008 + 0.001 * n for n in range(1, 37)}
    assert rows_time(cpu_verify, 40) == pytest.approx(0.030 + 0.006 * 40)  # the line extended past its knots
    assert rows_time(branch, 100) == pytest.approx(0.008 + 0.001 * 100)
    a = 0.8
    one, four = (_choose_ssd(cpu_verify, chain, branch, a, batch=n) for n in (1, 4))
    assert four[0] <= one[0] and four[1] < one[1], (one, four)
    tuner = SSDTuner(t_verify=cpu_verify, t_chain=chain, t_branch=branch)
    assert tuner.choose([1]) == _choose_ssd(cpu_verify, chain, branch, tuner.acceptance_of([1]))
    ids = [1, 2, 3, 4]
    assert tuner.choose(ids) == _choose_ssd(cpu_verify, chain, branch, tuner.acceptance_of(ids), batch=4)
    k1, k8 = (_choose_sd(cpu_verify, 0.004, a, batch=n) for n in (1, 8))  # 3 and 2
    assert k8 < k1, (k1, k8)
    sd = KTuner(t_verify=cpu_verify, t_draft1=0.004)
    assert sd.choose(list(range(8))) == _choose_sd(cpu_verify, 0.004, sd.acceptance_of(list(range(8))), batch=8)
