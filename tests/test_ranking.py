"""Ranked SSD candidates (workers/ranking.py): the outcome probabilities against a brute-force reference, the
acceptance calibration, the draft worker's use of them, and the tuner's hit model."""

import math

import pytest
import torch

from ssd.autoconfig import RankedHits, _choose_ssd
from ssd.workers.draft_worker import DraftWorker, SpecRequest
from ssd.workers.messages import SamplingSpec
from ssd.workers.ranking import AcceptanceByConfidence, confidences, ranked_outcomes


def ref_outcome_probs(tokens, dists, accept):
    """Slow and obvious: P(k, t*) for every outcome, from the full distributions q_k (dicts token -> p)."""
    probs = {}
    for k in range(len(tokens) + 1):
        reach = math.prod(accept(dists[j].get(tokens[j], 0.0)) for j in range(k))
        if k == len(tokens):
            for t, p in dists[k].items():
                probs[(k, t)] = reach * p
            continue
        c = dists[k].get(tokens[k], 0.0)
        for t, p in dists[k].items():
            if t != tokens[k]:
                probs[(k, t)] = reach * (1 - accept(c)) * p / (1 - c)
    return probs


def random_dists(g, n, vocab=6):
    out = []
    for _ in range(n):
        p = torch.rand(vocab, generator=g) ** 3
        p = p / p.sum()
        out.append({t: float(v) for t, v in enumerate(p.tolist())})
    return out


def tops_of(dists):
    return [tuple(map(list, zip(*sorted(d.items(), key=lambda kv: -kv[1])))) for d in dists]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("accept", [lambda c: c, lambda c: 0.8, lambda c: 0.3 + 0.6 * c])
def test_ranked_outcomes_are_the_likeliest(seed, accept):
    g = torch.Generator().manual_seed(seed)
    K = 3
    dists = random_dists(g, K + 1)
    tokens = [int(torch.randint(6, (1,), generator=g)) for _ in range(K)]
    ref = ref_outcome_probs(tokens, dists, accept)
    for budget in (1, 2, 5, 9, 40):
        got = ranked_outcomes(tokens, tops_of(dists), budget, accept)
        assert len(got) == min(budget, sum(p > 0 for p in ref.values()))
        assert [k for k, _ in got] == sorted(k for k, _ in got)  # in order of k (then rank)
        assert all(k == K or t != tokens[k] for k, t in got)  # a rejected token is never a correction
        chosen = sorted((ref[o] for o in got), reverse=True)
        best = sorted(ref.values(), reverse=True)[: len(got)]
        assert chosen == pytest.approx(best, rel=1e-9)  # no outcome left out is likelier than one taken


def test_a_token_outside_the_kept_top_ends_the_chain():
    # x_1 = 5 is not among q_0's kept tokens: outcomes with k >= 1 get probability 0 and are not taken
    tops = [([1, 2], [0.6, 0.4]), ([3], [1.0]), ([4], [1.0])]
    assert ranked_outcomes([5, 3], tops, 10, lambda c: c) == [(0, 1), (0, 2)]
    assert confidences([5, 3], tops) == [0.0, 1.0]
    # with g(0) > 0 the chain goes on: (1, *) has no candidate besides x_2, (2, 4) follows
    assert ranked_outcomes([5, 3], tops, 10, lambda c: 0.9) == [(0, 1), (0, 2), (2, 4)]


def test_acceptance_by_confidence_learns_and_starts_at_the_prior():
    a = AcceptanceByConfidence(prior=0.7, weight=2.0, decay=1.0)
    assert a.rate(0.05) == pytest.approx(0.7) and a.rate(0.95) == pytest.approx(0.7)
    for _ in range(20):  # confident tokens accepted, unconfident ones rejected
        a.observe([0.95, 0.05, 0.5], accepted=1)
    assert a.rate(0.97) == pytest.approx((20 + 1.4) / 22)
    assert a.rate(0.02) == pytest.approx(1.4 / 22)
    assert a.rate(0.55) == pytest.approx(0.7)  # x_3 came after the rejection: never judged
    a.observe([0.55, 0.55], accepted=2)  # all accepted: both count
    assert a.rate(0.55) == pytest.approx((2 + 1.4) / 4)


def test_ranked_hits_model():
    h = RankedHits()
    assert h.hit_rate(1) == pytest.approx(0.5) and h.hit_rate(4) > h.hit_rate(2) > h.hit_rate(1)
    for _ in range(200):
        h.observe(2, True)
    assert h.hit_rate(1) > 0.9 and h.hit_rate(2) > 0.94
    before = h.hit_rate(2)
    h.observe(0, False)  # no budget: nothing learnt
    assert h.hit_rate(2) == before


def test_ranked_hits_per_request():
    """A request's hit rate starts at the engine-wide one and follows its own misses; a finished request's
    counts go."""
    h = RankedHits()
    for _ in range(200):
        h.observe(2, True, seq_id=1)
    assert h.hit_rate(2, [2]) == h.hit_rate(2) > 0.94  # a new request: the engine-wide rate
    for _ in range(4):
        h.observe(2, False, seq_id=2)
    assert h.hit_rate(2, [2]) < 0.6 < 0.8 < h.hit_rate(2)  # engine-wide: 4 misses among 204 rounds
    assert h.hit_rate(2, [1]) > 0.94
    assert h.hit_rate(2, [1]) > h.hit_rate(2, [1, 2]) > h.hit_rate(2, [2])
    h.forget(2)
    assert h.hit_rate(2, [2]) == h.hit_rate(2)


def test_the_tuner_takes_a_small_budget_when_ranked_hits_are_cheap():
    t_verify = {n: 0.050 + 0.002 * n for n in range(1, 10)}
    t_chain = {n: 0.010 + 0.002 * n for n in range(1, 10)}
    t_branch = {b: 0.010 + 0.004 * b for b in range(1, 40)}
    k_r, b_r = _choose_ssd(t_verify, t_chain, t_branch, 0.9, hit_rate=lambda b: 0.99)
    k_q, b_q = _choose_ssd(t_verify, t_chain, t_branch, 0.9)
    assert b_r <= b_q and b_r <= 2


def _speculate_once(worker, prompt, budget, K=3):
    worker.add(0, prompt, SamplingSpec(temperature=0))
    x = worker.propose([(0, K)])[0][0].tokens
    fed = []
    forward = worker.runner.forward

    def counted(slots, tokens, *a, **kw):
        fed.append(len(tokens[0]))
        return forward(slots, tokens, *a, **kw)

    worker.runner.forward = counted
    fanout = [0] * K + [budget]  # quotas would give every candidate to k = K
    info = worker.speculate([SpecRequest(seq_id=0, round_id=1, tokens=x, fanout=fanout, next_fanout=fanout, k_next=K)])
    worker.runner.forward = forward
    return x, info, sorted(worker.cache.keys(0)), fed


def _glue_logits(draft, x, full: bool = True, **kw):
    """q_0..q_K ([K + 1, V]): [x_0 = 5, x_1..x_K] fed after the prompt's first four tokens; `full`: on the
    whole vocabulary, else [K + 1, C] on the ids the worker drafts from, with those ids."""
    ref = DraftWorker(draft, dtype="float32", max_slots=1, max_len=128, **kw)
    ref.add(0, [3, 1, 4, 1, 5], SamplingSpec(temperature=0))
    assert ref.propose([(0, len(x))])[0][0].tokens == x
    st = ref.dseqs[0]
    ref.runner.truncate(st.slot, 4)
    if full:
        return ref.runner.forward([st.slot], [[5, *x]], full_vocab=True)[0], None
    logits, cols = ref._forward([st], [[5, *x]])  # [1, K + 1, C] on the columns cols
    return logits[0], cols


@pytest.mark.parametrize("candidate_vocab", ["full", "draft"])
def test_ranked_worker_fills_the_cache_with_the_likeliest_outcomes(models, candidate_vocab):
    """A ranked worker ranks k < K from the distributions it drafted x_1..x_K from (here a restricted layer's)
    and k = K from one glue row (on the whole vocabulary or the draft's own ids, `candidate_vocab`), and caches
    exactly ranked_outcomes of them; without kept tops it scores every k on that vocabulary (K + 1 glue rows);
    a quota worker caches F_k per k."""
    draft = models[1]
    K, budget = 3, 5
    kw = dict(dtype="float32", max_slots=1, max_len=128, draft_vocab=24, candidate_vocab=candidate_vocab)
    w = DraftWorker(draft, ranked=True, **kw)
    w.add(0, [3, 1, 4, 1, 5], SamplingSpec(temperature=0))
    x = w.propose([(0, K)])[0][0].tokens
    kept = list(w.dseqs[0].tops)
    assert len(kept) == K and all(t < 24 or t in (3, 1, 4, 5) for ids, _ in kept for t in ids)
    w.remove(0)
    x2, info, keys, fed = _speculate_once(w, [3, 1, 4, 1, 5], budget, K)
    assert x2 == x and fed[0] == 1
    logits, cols = _glue_logits(draft, x, full=candidate_vocab == "full", draft_vocab=24)
    bonus = w._tops(logits[K:], cols)
    assert candidate_vocab == "full" or all(t < 24 for t in bonus[0][0])  # the prompt's ids are kept ones
    want = ranked_outcomes(x, kept + bonus, budget, w.acceptance.rate)
    assert keys == sorted(want) and len(want) == budget
    assert info["fanout"] == [[0, [sum(k == j for k, _ in want) for j in range(K + 1)]]]

    full = DraftWorker(draft, ranked=True, **kw)
    full._has_tops = lambda st, r: False
    _, _, fkeys, ffed = _speculate_once(full, [3, 1, 4, 1, 5], budget, K)
    assert ffed[0] == K + 1
    assert fkeys == sorted(ranked_outcomes(x, full._tops(logits, cols), budget, full.acceptance.rate))

    quota = DraftWorker(draft, **kw)
    _, qinfo, qkeys, qfed = _speculate_once(quota, [3, 1, 4, 1, 5], budget, K)
    assert qinfo["fanout"] == [] and {k for k, _ in qkeys} == {K} and qfed[0] == 1
    top = logits[K].topk(budget).indices
    top = top if cols is None else cols[top]
    assert qkeys == sorted((K, t) for t in top.tolist())


def test_ranked_worker_with_the_whole_vocabulary_keeps_the_drafting_tops(models):
    """Without a restricted output layer the tops kept while drafting rank k < K: the glue feeds x_K alone,
    and the cache (and the next round's, from a hit) equals that of a worker re-scoring every k."""
    draft = models[1]
    K, budget = 3, 6
    fast = DraftWorker(draft, dtype="float32", max_slots=1, max_len=128, ranked=True)
    slow = DraftWorker(draft, dtype="float32", max_slots=1, max_len=128, ranked=True)
    slow._has_tops = lambda st, r: False  # never use the kept tops
    got = [_speculate_once(w, [2, 7, 1, 8], budget, K) for w in (fast, slow)]
    assert got[0][3][0] == 1 and got[1][3][0] == K + 1
    assert got[0][2] == got[1][2] and got[0][0] == got[1][0]
    for w in (fast, slow):  # a hit on the likeliest all-accepted outcome, then the next speculation
        k, t = max(w.cache.keys(0))
        x = got[0][0]
        [res] = w.resolve([(0, k, [*x[:k], t], K)], neural_backup=True)
        nxt = res.draft.tokens
        w.speculate([SpecRequest(seq_id=0, round_id=2, tokens=nxt, fanout=[0] * K + [budget],
                                 next_fanout=[0] * K + [budget], k_next=K)])
    assert sorted(fast.cache.keys(0)) == sorted(slow.cache.keys(0))


def test_ranked_rows_calibrate_on_resolve(models):
    w = DraftWorker(models[1], dtype="float32", max_slots=1, max_len=128, ranked=True)
    x, _, keys, _ = _speculate_once(w, [2, 7, 1, 8], 4)
    conf = list(w.dseqs[0].confidence)
    assert len(conf) == len(x) == 3
    k, t = keys[0]
    w.resolve([(0, k, [*x[:k], t], 3)], neural_backup=True)
    assert sum(w.acceptance.seen) == pytest.approx(min(k + 1, len(x))) and w.dseqs[0].confidence == []


def test_sampled_rows_keep_the_quotas(models):
    w = DraftWorker(models[1], dtype="float32", max_slots=1, max_len=128, ranked=True)
    w.add(0, [2, 7, 1, 8], SamplingSpec(temperature=0.8, seed=3))
    x = w.propose([(0, 3)])[0][0].tokens
    fanout = [1, 0, 2, 1]
    info = w.speculate([SpecRequest(seq_id=0, round_id=1, tokens=x, fanout=fanout, next_fanout=fanout, k_next=3)])
    per_k = [sum(k == j for k, _ in w.cache.keys(0)) for j in range(4)]
    assert per_k == fanout and info["fanout"] == []


def test_every_outcome_set_is_reachable():
    """With a budget covering every outcome, ranking takes them all (nothing is lost to ties)."""
    tops = [([0, 1], [0.5, 0.5]), ([0, 1], [0.5, 0.5]), ([0, 1], [0.5, 0.5])]
    got = ranked_outcomes([0, 0], tops, 100, lambda c: 0.5)
    assert got == [(0, 1), (1, 1), (2, 0), (2, 1)]
    # P: (0, 1) 0.5, (1, 1) 0.25, (2, *) 0.125 each: smaller budgets take the likeliest first
    assert [ranked_outcomes([0, 0], tops, b, lambda c: 0.5) for b in (1, 2)] == [[(0, 1)], [(0, 1), (1, 1)]]


def test_a_certain_token_leaves_its_runner_up_unlikely():
    """fp32 rounds q(x) = 1 - 1e-8 to 1.0: the runner-up's renormalised share stays at most 1, so the
    all-accepted outcome, not a rejection of a certain token, comes first."""
    tops = [([5, 6], [1.0, 1e-8]), ([7, 8], [0.9, 0.1])]
    assert ranked_outcomes([5], tops, 1, lambda c: 0.99) == [(1, 7)]
