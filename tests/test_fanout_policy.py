"""Geometric fan-out formula and the batch-size-aware policy."""

import math

import pytest

from ssd import policy
from ssd.fanout import FanoutPlanner, expected_hit_rate, geometric_fanout, geometric_weights, round_keep_sum
from ssd.policy import CostModel, Ema, choose, expected_tokens


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
    c.v0, c.v1 = Ema(v0), Ema(v1)
    c.draft_step, c.speculate = Ema(draft_step), Ema(speculate)
    c.acceptance, c.fast_acceptance, c.p_hit = Ema(a), Ema(a_fast), Ema(p_hit)
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


def test_ssd_with_auto_k_tunes_and_stays_exact(models, ar_outputs):
    from tiny_models import GREEDY, PROMPTS

    from ssd import LLM

    with LLM(target=models[0], draft=models[0], mode="ssd", dtype="float32", max_batch=3, max_len=160) as llm:
        mode = llm.engine.mode
        assert mode.tuner is not None
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        assert mode.tuner.acceptance > 0.9  # draft == target: every draft accepted
        assert (mode.k, mode.planner.B) == mode.tuner.choose()
    with LLM(target=models[0], draft=models[1], mode="ssd", fanout=6, dtype="float32", max_len=160) as llm:
        assert llm.engine.mode.tuner is None  # a fan-out the user fixed keeps K fixed too


def test_sd_with_auto_k_tunes_and_stays_exact(models, ar_outputs):
    from tiny_models import GREEDY, PROMPTS

    from ssd import LLM

    with LLM(target=models[0], draft=models[0], mode="sd", dtype="float32", max_batch=3, max_len=160) as llm:
        tuner = llm.engine.mode.tuner
        assert tuner is not None
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        assert tuner.acceptance > 0.9  # draft == target: every draft accepted
        assert llm.stats()["k"] == tuner.choose()
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
        assert min(cost.v0.n, cost.v1.n, cost.draft_step.n, cost.speculate.n) == 1  # seeded, no round run yet


def test_measured_round_times_correct_the_modelled_prices():
    """Rounds that take longer than the model says (host time, a backup's catch-up) raise that option's
    price by the measured ratio, within CALIBRATION_RANGE; AR measured as modelled keeps its price."""
    c = costs(v0=0.12, v1=0.01, draft_step=0.05, speculate=0.12, a=0.5, p_hit=0.9)
    allowed = ("ssd_neural", "ar")
    best, before = choose(c, batch=1, k=3, allowed=allowed)
    assert best == "ssd_neural" and before["ssd_neural"] * 1.6 > before["ar"]
    for _ in range(300):
        c.observe_round("ssd_neural", before["ssd_neural"], 1.6 * before["ssd_neural"] * 2, 2)
        c.observe_round("ar", before["ar"], before["ar"], 1)
    best, after = choose(c, batch=1, k=3, allowed=allowed)
    assert best == "ar"
    assert after["ssd_neural"] == pytest.approx(1.6 * before["ssd_neural"], rel=0.01)
    assert after["ar"] == pytest.approx(before["ar"], rel=0.01)
    for _ in range(300):
        c.observe_round("ar", before["ar"], 5 * before["ar"], 1)
    clamped = choose(c, batch=1, k=3, allowed=allowed)[1]["ar"]
    assert clamped == pytest.approx(policy.CALIBRATION_RANGE[1] * before["ar"])


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
