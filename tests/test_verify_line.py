"""The policy's price of a verification: a line fitted to the start-up measurement plus its bend."""

from __future__ import annotations

import pytest

from ssd.policy import CostModel, Ema, RateEma, VerifyLine, choose, fit_line, interpolate

# The 1.5B's forwards on the Zen 4 machine at 2 threads (session 27): flat to 2 tokens (the AVX-512 tile
# pairs start at 3 rows), then compute-bound.
KINKED = {1: 0.0357, 2: 0.0358, 4: 0.0431, 8: 0.0725}


def test_interpolate_is_piecewise_linear_and_held_outside_the_knots():
    knots = {1: 0.0, 3: 2.0, 5: -2.0}
    assert [interpolate(knots, n) for n in range(0, 8)] == [0.0, 0.0, 1.0, 2.0, 0.0, -2.0, -2.0, -2.0]
    assert interpolate({}, 4) == 0.0


def test_the_fitted_curve_prices_every_measured_forward_and_interpolates_between_them():
    v = VerifyLine.fit(KINKED)
    for n, t in KINKED.items():
        assert v.time(n) == pytest.approx(t, rel=1e-12)
    assert v.time(3) == pytest.approx((KINKED[2] + KINKED[4]) / 2, rel=1e-12)
    assert v.time(6) == pytest.approx((KINKED[4] + KINKED[8]) / 2, rel=1e-12)
    _, slope = fit_line(KINKED)
    assert v.time(12) == pytest.approx(KINKED[8] + 4 * slope, rel=1e-12)  # past the last point: the line's slope
    assert (v.v0.n, v.v1.n) == (1, 1)  # one observation's weight: rounds refine it
    # The straight line alone (what the policy priced before the bend) is 15-21 % high at 2-4 tokens.
    line = VerifyLine(Ema(v.v0.value), Ema(v.v1.value))
    assert line.time(1) == pytest.approx(KINKED[1]) and 1.1 < line.time(2) / KINKED[2] < 1.25
    assert 1.15 < line.time(4) / KINKED[4] < 1.25


def test_rounds_move_their_own_price_most_and_every_price_a_little():
    v = VerifyLine.fit(KINKED)
    assert v.observe(4, 1.3 * KINKED[4]) == pytest.approx(0.3 / 1.3)  # the error of the price before the update
    for _ in range(40):  # the machine turned 30 % slower for 4-token verifications
        v.observe(4, 1.3 * KINKED[4])
    assert v.time(4) == pytest.approx(1.3 * KINKED[4], rel=0.02)
    # The other measured points followed by the intercept's share only, all by the same amount.
    shift = v.time(1) - KINKED[1]
    assert 0 < shift < 0.5 * (v.time(4) - KINKED[4])
    assert v.time(8) - KINKED[8] == pytest.approx(shift)
    assert v.observe(4, v.time(4)) == 0.0


def test_a_batch_past_the_measured_forwards_leaves_the_small_prices_alone():
    """A batch's verifications (here 32 tokens) run off the fitted line through its shape out there: their knot
    learns it, but the intercept, which would carry the error to one sequence's few tokens, stays."""
    v = VerifyLine.fit(KINKED)
    far = v.time(32)
    for _ in range(40):
        v.observe(32, 1.3 * far)
    assert v.time(32) == pytest.approx(1.3 * far, rel=0.02)
    for n, t in KINKED.items():
        assert v.time(n) == pytest.approx(t, rel=1e-9)
    v.observe(8, 1.3 * KINKED[8])  # within the measured forwards: drift, which moves every price a little
    assert v.time(1) > KINKED[1]
    unseeded = VerifyLine(Ema(0.05), Ema(0.002))  # no start-up timings: every round moves the intercept
    unseeded.observe(32, 2 * unseeded.time(32))
    assert unseeded.time(1) > 0.05 + 0.002


def test_an_unmeasured_token_count_gets_a_price_of_its_own():
    v = VerifyLine.fit(KINKED)
    assert v.time(3) == pytest.approx((KINKED[2] + KINKED[4]) / 2)
    for _ in range(40):
        v.observe(3, 0.050)
    assert v.time(3) == pytest.approx(0.050, rel=0.02) and 3 in v.bend


def test_a_concave_curve_seen_at_both_ends_converges_instead_of_diverging():
    """Session 38 (Zen 4, borrowed cores): 2-token verifications above the fitted line, 9-token ones below.
    Moving intercept and slope together drove the intercept negative and priced one token at 1 ms against
    40 measured; each price must instead converge to what its rounds measure."""
    v = VerifyLine.fit({1: 0.029, 3: 0.042, 4: 0.047, 5: 0.050, 6: 0.061, 7: 0.072, 9: 0.083})
    true = {1: 0.040, 2: 0.055, 5: 0.062, 9: 0.070}
    for i in range(400):
        n = (2, 9, 9, 2, 1, 5, 9, 2)[i % 8]
        v.observe(n, true[n])
        assert v.time(1) > 0.025
    for n, t in true.items():
        assert v.time(n) == pytest.approx(t, rel=0.03)


def test_the_bend_decides_sd_against_ar_where_the_line_misprices_the_verification():
    """At acceptance 0.6 and a 10 ms draft step, SD with 3 drafts costs (30 + 43.1) / 2.18 = 33.6 ms a token
    on the measured curve against AR's 35.7: SD. The straight line prices its 4-token verification at
    52 ms, and SD at 37.8: AR, on a machine where SD is the faster."""
    def cost(verify: VerifyLine) -> CostModel:
        c = CostModel(verify=verify, draft_step=Ema(0.010))
        c.acceptance = RateEma(0.6)
        return c

    fitted = VerifyLine.fit(KINKED)
    best, scores = choose(cost(fitted), 1, 3, allowed=("sd", "ar"))
    assert best == "sd" and scores["sd"] == pytest.approx((0.030 + KINKED[4]) / ((1 - 0.6**4) / 0.4))
    assert scores["ar"] == pytest.approx(KINKED[1])
    line_best, _ = choose(cost(VerifyLine(Ema(fitted.v0.value), Ema(fitted.v1.value))), 1, 3, allowed=("sd", "ar"))
    assert line_best == "ar"


def test_borrowed_verifications_get_a_fitted_curve_of_their_own():
    c = CostModel()
    c.seed({n: 2 * t for n, t in KINKED.items()})
    c.enable_borrow(t_borrowed=KINKED)
    assert [c.lent_verify_time(n) for n in KINKED] == pytest.approx(list(KINKED.values()))
    assert c.verify_time(4) == pytest.approx(2 * KINKED[4])
    assert c.observe_verify(4, KINKED[4], borrowed=True) == pytest.approx(0.0, abs=1e-12)
    shared = CostModel()
    shared.seed(KINKED)
    shared.enable_borrow(0.5)  # without a measurement: a share of the own curve, bend included
    assert [shared.lent_verify_time(n) for n in KINKED] == pytest.approx([0.5 * t for t in KINKED.values()])
