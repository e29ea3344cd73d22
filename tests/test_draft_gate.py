"""Confidence-gated drafts: with K auto-configured, greedy plain drafts run up to the longest K and stop once
another forward is worth less than its price (DraftWorker._worth vs KTuner.stop_below / SSDMode._gate_price).
A gated draft is a prefix of the ungated one, so greedy output still equals AR; sampled rows are never gated."""

import copy
import random

import pytest
from tiny_models import GREEDY, PROMPTS, random_model

from ssd import LLM
from ssd.autoconfig import K_CHOICES, KTuner
from ssd.workers.draft_worker import DraftWorker
from ssd.workers.messages import SamplingSpec

V = 24


@pytest.fixture(scope="module")
def draft_model():
    return random_model(vocab=V, layers=1, seed=11, scale=2.0)


def run_rounds(model, stop_below: float, spec: SamplingSpec, seed: int = 0, rounds: int = 20):
    """Propose / commit rounds with random K and acceptance; every round commits the same tokens whatever
    `stop_below` is (drawn from the rng and the longest draft), so runs with different gates stay comparable."""
    w = DraftWorker(model, dtype="float32", max_slots=2, max_len=512, lookahead=3)
    ref = DraftWorker(model, dtype="float32", max_slots=2, max_len=512, lookahead=3)
    rng = random.Random(seed)
    for x in (w, ref):
        x.add(0, [1, 2, 3, 4, 1, 2, 3], spec)
    out = []
    for _ in range(rounds):
        k = rng.randrange(1, 9)
        got = w.propose([(0, k)], None, False, stop_below)[0][0].tokens
        full = ref.propose([(0, k)])[0][0].tokens
        out.append((k, list(got), list(full)))
        a = rng.randrange(0, k + 1)
        tokens = [*full[:a], (full[a] + 1) % V if a < k else rng.randrange(V)]
        w.commit(0, tokens)
        ref.commit(0, tokens)
    return out, w


@pytest.mark.parametrize("stop_below", [0.0, 0.3, 0.8, 1e9])
def test_gated_draft_is_a_prefix_of_the_full_draft(draft_model, stop_below):
    rounds, w = run_rounds(draft_model, stop_below, SamplingSpec(temperature=0))
    for k, got, full in rounds:
        assert len(full) == k and 1 <= len(got) <= k
        assert got == full[: len(got)]
    stopped = sum(len(got) < k for k, got, _ in rounds)
    assert w.gate_stats["stopped"] == stopped
    if stop_below == 0.0:  # no gate: every draft runs to its k and none counts as gated
        assert stopped == 0 and w.gate_stats["drafts"] == 0
    else:
        assert w.gate_stats["drafts"] == len(rounds)
    if stop_below == 1e9:  # no second forward is ever worth that much: one forward, its guesses taken
        assert stopped > 0 and sum(len(got) for _, got, _ in rounds) < sum(k for k, _, _ in rounds)


def test_gate_stops_more_as_the_price_rises(draft_model):
    lengths = []
    for stop_below in (0.0, 0.3, 1e9):
        rounds, _ = run_rounds(draft_model, stop_below, SamplingSpec(temperature=0), seed=3)
        lengths.append(sum(len(got) for _, got, _ in rounds))
    assert lengths[0] >= lengths[1] >= lengths[2] and lengths[0] > lengths[2]


def test_commit_teaches_acceptance_by_confidence(draft_model):
    """A gated draft's confidences are judged at commit: the tokens up to and including the first rejected
    one count (later ones were never verified); the pending record is cleared."""
    w = DraftWorker(draft_model, dtype="float32", max_slots=1, max_len=256, lookahead=0)
    w.add(0, [1, 2, 3], SamplingSpec(temperature=0))
    x = w.propose([(0, 6)], None, False, 1e-9)[0][0].tokens  # a tiny price: the draft runs to k
    st = w.dseqs[0]
    assert len(x) == 6 and st.proposed == x and len(st.proposed_conf) == 6
    assert all(0.0 < c <= 1.0 for c in st.proposed_conf)
    want = copy.deepcopy(w.acceptance)
    want.observe(list(st.proposed_conf), 2)
    assert want.seen != w.acceptance.seen
    w.commit(0, [*x[:2], (x[2] + 1) % V])  # two accepted, the third rejected
    assert (w.acceptance.seen, w.acceptance.accepted) == (want.seen, want.accepted)
    assert st.proposed == [] and st.proposed_conf == []
    # An ungated draft leaves nothing to judge
    seen = list(w.acceptance.seen)
    y = w.propose([(0, 3)])[0][0].tokens
    w.commit(0, [*y, 5])
    assert w.acceptance.seen == seen


def test_sampled_rows_are_never_gated(draft_model):
    rounds, w = run_rounds(draft_model, 1e9, SamplingSpec(temperature=0.8, seed=5))
    assert all(len(got) == k for k, got, _ in rounds)
    assert w.gate_stats == {"drafts": 0, "stopped": 0}


def test_k_tuner_gated_takes_the_longest_k_and_prices_a_forward():
    t_verify = {n: 0.02 + 0.004 * n for n in range(1, 10)}
    plain = KTuner(t_verify=t_verify, t_draft1=0.01)
    gated = KTuner(t_verify=t_verify, t_draft1=0.01, gated=True)
    assert plain.stop_below(8, [0]) == 0.0 and plain.choose([0]) in K_CHOICES
    assert gated.choose([0]) == max(K_CHOICES)
    p0 = gated.stop_below(8, [0])  # before any round: the best ungated K's modelled rate
    assert p0 > 0
    # ... at the batch's own verification: batch x (K + 1) tokens (a fresh tuner: nothing measured yet)
    from ssd.autoconfig import expected_tokens, gate_price, interpolate, rows_time

    batch = list(range(8))
    k0 = gated._best_plain(batch)
    rate = 8 * expected_tokens(gated.acceptance_of(batch), k0) / (k0 * 0.01 + rows_time(t_verify, 8 * (k0 + 1)))
    row = (interpolate(t_verify, 9) - interpolate(t_verify, 1)) / 8
    assert gated.stop_below(8, batch) == pytest.approx(gate_price(rate, 0.01, row, 8))
    gated.observe_rate(10, 0.1)  # 100 tok/s measured
    p1 = gated.stop_below(8, [0])
    assert p1 == pytest.approx(100 * (0.01 + (t_verify[9] - t_verify[1]) / 8))
    gated.observe_rate(40, 0.1)  # faster rounds: a forward costs more tokens
    assert gated.stop_below(8, [0]) > p1
    # Rows of a batch share the draft forward: each sequence's price falls
    assert gated.stop_below(8, [0, 1, 2]) < gated.stop_below(8, [0])
    assert gated.stop_below(8, []) == 0.0


@pytest.fixture(scope="module")
def models():
    return random_model(vocab=40, layers=2, seed=3, scale=2.0), random_model(vocab=40, layers=1, seed=4, scale=2.0)


@pytest.fixture(scope="module")
def ar_outputs(models):
    with LLM(target=models[0], mode="ar", dtype="float32", max_batch=4, max_len=128) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("price", [None, 0.05, 1e9])
def test_gated_sd_greedy_equals_ar(models, ar_outputs, monkeypatch, price):
    """mode="sd" with K auto: gated by the tuner's own price, or by a forced one (1e9: every draft stops
    after its first forward)."""
    if price is not None:
        monkeypatch.setattr(KTuner, "stop_below", lambda self, k, seq_ids: price)
    with LLM(target=models[0], draft=models[1], mode="sd", dtype="float32", max_batch=3, max_len=128) as llm:
        assert llm.engine.mode.tuner.gated
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        gate = llm.engine.mode.draft.worker.gate_stats
    assert gate["drafts"] > 0
    if price == 1e9:
        assert gate["stopped"] > 0


def test_no_draft_gate_drafts_plain_k(models, ar_outputs):
    with LLM(target=models[0], draft=models[1], mode="sd", dtype="float32", max_batch=3, max_len=128,
             draft_gate=False) as llm:
        assert not llm.engine.mode.tuner.gated
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        assert llm.engine.mode.draft.worker.gate_stats["drafts"] == 0


def test_gated_sd_rounds_of_auto_greedy_equal_ar(models, ar_outputs, monkeypatch):
    """mode="auto" with K auto: its SD rounds draft gated (forced to stop after one forward here), mixed with
    every other option; greedy output still equals AR."""
    import itertools

    import ssd.modes.ssd as ssd_mode

    order = itertools.cycle(["sd", "ssd_neural", "sd", "ngram", "ar", "sd", "ssd_fast"])
    monkeypatch.setattr(ssd_mode, "choose", lambda cost, batch, k, allowed, *a, **kw: (next(order),
                                                                                        dict.fromkeys(allowed, 1.0)))
    monkeypatch.setattr(ssd_mode.SSDMode, "_gate_price", lambda self, batch: 1e9)
    with LLM(target=models[0], draft=models[1], mode="auto",
             dtype="float32", max_batch=3, max_len=128, use_ray=False) as llm:
        assert llm.engine.mode.gate
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
        gate = llm.engine.mode.draft.worker.gate_stats
        assert llm.engine.mode.cost.gated_sd.length.n > 0  # its SD rounds priced by what they drafted
    assert gate["drafts"] > 0 and gate["stopped"] > 0


def test_no_draft_gate_flag():
    from ssd.launch.cli import config_kwargs, serve_parser

    def kw(*argv: str) -> dict:
        return config_kwargs(serve_parser().parse_args(list(argv)))

    assert "draft_gate" not in kw("--target", "qwen-coder-1.5b", "--draft", "qwen-coder-0.5b")
    assert kw("--target", "qwen-coder-1.5b", "--draft", "qwen-coder-0.5b", "--no-draft-gate")["draft_gate"] is False


def test_policy_prices_gated_sd_at_its_measured_length_and_tokens():
    """auto's gated SD rounds: once measured, SD is priced at the drafts' mean length and at the tokens they
    emitted against a fixed-length draft's expectation (gated drafts stop before unsure tokens)."""
    from ssd.policy import CostModel, GatedSD, choose, expected_tokens

    allowed = ("sd", "ar")
    plain = CostModel()
    gated = CostModel(gated_sd=GatedSD())
    assert choose(gated, 1, 4, allowed, k_sd=4)[1]["sd"] == choose(plain, 1, 4, allowed, k_sd=4)[1]["sd"]
    a = gated.acceptance.value
    gated.gated_sd.observe(a, [6], [6])  # a 6-token draft, 5 accepted
    assert gated.gated_sd.length.value == 6
    assert gated.gated_sd.gain.value == pytest.approx(6 / expected_tokens(a, 6))
    score = choose(gated, 1, 4, allowed, k_sd=4)[1]["sd"]
    t_round = gated.draft_time(6) + gated.lent_verify_time(7)
    assert score == pytest.approx(t_round / 6)
    gated.gated_sd.observe(a, [0], [1])  # no draft: nothing learnt
    assert gated.gated_sd.length.n == 1
    for _ in range(20):  # every gated draft rejected at once: SD priced out
        gated.gated_sd.observe(a, [2], [1])
    assert choose(gated, 1, 4, allowed, k_sd=4)[1]["sd"] > score
