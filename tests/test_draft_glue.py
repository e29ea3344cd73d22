"""SSD speculation's glue: after drafting x_1..x_K, the draft keeps them cached and feeds only from the
first outcome with candidates (one row when F_K alone is non-zero); the outcome cache it fills, and
every later draft, match a draft that re-feeds [x_0, x_1..x_K] as before."""

import pytest

from ssd.workers.draft_worker import DraftWorker, SpecRequest
from ssd.workers.messages import SamplingSpec

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
K = 3


def full_glue(w: DraftWorker):
    """The reference: roll back to the committed tokens and re-feed the last one and x_1..x_K."""
    def glue(st, r, first_needed):
        feeds = w._sync(st)
        return feeds + r.tokens, len(feeds), len(feeds) - 1
    return glue


def rows_fed(w: DraftWorker) -> list[int]:
    fed: list[int] = []
    forward = w.runner.forward
    w.runner.forward = lambda slots, tokens, *a, **kw: (fed.append(len(tokens[0])), forward(slots, tokens, *a, **kw))[1]
    return fed


@pytest.mark.parametrize("spec", [SamplingSpec(temperature=0), SamplingSpec(temperature=0.9, seed=7)])
@pytest.mark.parametrize("fanout,first_rows", [([0, 0, 0, 2], 1), ([0, 2, 0, 1], 3), ([0, 0, 2, 0], 2),
                                               ([1, 0, 0, 1], 4), ([2, 1, 1, 1], 4)])
def test_short_glue_fills_the_same_cache(models, spec, fanout, first_rows):
    draft = models[1]
    workers = [DraftWorker(draft, dtype="float32", max_slots=1, max_len=128) for _ in range(2)]
    workers[1]._glue = full_glue(workers[1])
    fed = [rows_fed(w) for w in workers]
    results = []
    for w, f in zip(workers, fed):
        w.add(0, PROMPT, spec)
        drafts, _ = w.propose([(0, K)])
        x = drafts[0].tokens
        entries, first = [], []
        for round_id in range(3):  # speculate, hit on (K, top candidate), speculate again from the hit
            f.clear()
            w.speculate([SpecRequest(seq_id=0, round_id=round_id, tokens=x, fanout=fanout, next_fanout=fanout,
                                     k_next=K)])
            entries.append({key: (e.tokens, e.path, None if e.q is None else e.q.clone())
                            for key, e in w.cache._entries[0][1].items()})
            first.append(f[0])
            k, t = max(entries[-1])  # the outcome with the most accepted tokens
            [res] = w.resolve([(0, k, [*x[:k], t], K)], neural_backup=True)
            x = res.draft.tokens
        results.append((entries, first, x))
    (got, got_rows, got_x), (want, want_rows, want_x) = results
    assert got_x == want_x
    for g, e in zip(got, want):
        assert g.keys() == e.keys()
        for key in g:
            assert g[key][:2] == e[key][:2]
            assert (g[key][2] is None) == (e[key][2] is None)
            if g[key][2] is not None:
                assert g[key][2].equal(e[key][2])
    assert want_rows == [K + 1] * 3 and got_rows == [first_rows] * 3


def test_feed_ahead_commits_draft_what_lazy_ones_do(models):
    """Commits that feed ahead (SSD's AR rounds) leave at most FEED_AHEAD_LAG tokens for the next call to
    feed, and the greedy drafts after them equal those after lazy commits. (Sampled drafts may differ at
    rounding level: this eager float32 model is not batch-invariant. Either way verification uses the q
    the draft sampled from; the chi-square tests cover auto switching through AR rounds.)"""
    from ssd.workers.draft_worker import FEED_AHEAD_LAG

    emitted = [[7], [2], [9, 4], [1], [5], [3], [8], [6]]
    for model in models:  # the 2-layer one's drafts depend on more of the context
        results, feeds = [], []
        for feed_ahead in (True, False):  # no lookahead guesses: the rows counted are the committed ones fed
            w = DraftWorker(model, dtype="float32", max_slots=1, max_len=128, lookahead=0)
            w.add(0, PROMPT, SamplingSpec(temperature=0))
            w.propose([(0, K)])
            committed = len(PROMPT)
            for toks in emitted:
                w.commit(0, toks, feed_ahead)
                committed += len(toks)
                st = w.dseqs[0]
                if feed_ahead:  # every committed token is cached or waits to be fed: none is dropped
                    assert w.runner.kv.lengths[st.slot] == st.base and st.base + len(st.todo) == committed
            fed = rows_fed(w)
            drafts, _ = w.propose([(0, K)])
            feeds.append(fed[0])
            results.append(drafts[0].tokens)
        assert results[0] == results[1]
        assert 1 <= feeds[0] <= FEED_AHEAD_LAG and feeds[1] == 9  # the lazy draft catches up on all 9 at once


def test_a_hit_on_an_entry_that_drafted_nothing_leaves_a_consistent_state(models):
    """An entry prepared with k_next = 0 never fed t*: its hit must leave t* to feed, so the next draft is the
    one a fresh worker fed the same tokens makes."""
    w = DraftWorker(models[1], dtype="float32", max_slots=1, max_len=128)
    w.add(0, PROMPT, SamplingSpec(temperature=0))
    x = w.propose([(0, K)])[0][0].tokens
    w.speculate([SpecRequest(0, 1, x, [0, 0, 0, 2], [1], k_next=0)])
    k, t = w.cache.keys(0)[0]
    [res] = w.resolve([(0, k, [*x[:k], t], 0)], neural_backup=False)
    assert res.hit
    w.commit(0, [7])
    got = w.propose([(0, K)])[0][0].tokens
    fresh = DraftWorker(models[1], dtype="float32", max_slots=1, max_len=128)
    fresh.add(0, [*PROMPT, *x[:k], t, 7], SamplingSpec(temperature=0))
    assert got == fresh.propose([(0, K)])[0][0].tokens


def test_resolve_without_a_speculation_sees_the_tokens_once(models):
    """The lookahead's history holds each committed token once (a doubled run would skew its guesses)."""
    w = DraftWorker(models[1], dtype="float32", max_slots=1, max_len=128)
    w.add(0, PROMPT, SamplingSpec(temperature=0))
    x = w.propose([(0, K)])[0][0].tokens
    w.resolve([(0, 1, [x[0], 11], K)], neural_backup=False)
    assert w.dseqs[0].history == [*PROMPT, x[0], 11]


def test_a_hit_ships_each_token_with_the_q_it_was_drawn_from(models):
    """On a cache hit, token j of the prepared draft travels with the distribution it was sampled from: the draft's
    own, given the context, the round's outcome and y_<j (not the previous round's q, nor another depth's or
    branch's). Checked against a plain forward of the draft on that prefix, round after round."""
    import torch

    from ssd.kernels.sampling import filter_logits
    from ssd.workers.model_runner import ModelRunner
    from ssd.workers.subset_q import dense_q

    draft, temp = models[1], 0.9
    ref = ModelRunner(draft, max_slots=1, max_len=128)

    def q_ref(ids: list[int]) -> torch.Tensor:
        s = ref.allocate()
        logits = ref.forward([s], [ids], last_only=True)  # [1, V]
        ref.free(s)
        return filter_logits(logits, torch.tensor([temp]), torch.tensor([0]), torch.tensor([1.0]))[0]

    w = DraftWorker(draft, dtype="float32", max_slots=1, max_len=128)
    w.add(0, PROMPT, SamplingSpec(temperature=temp, seed=11))
    drafts, qs = w.propose([(0, K)])
    x, context = drafts[0].tokens, list(PROMPT)
    for j in range(K):
        assert torch.allclose(dense_q(qs[0])[j], q_ref(context + x[:j]), atol=1e-5)
    for round_id in range(4):
        fanout = [1, 1, 1, 2]
        w.speculate([SpecRequest(seq_id=0, round_id=round_id, tokens=x, fanout=fanout, next_fanout=fanout,
                                 k_next=K)])
        k, t = sorted(w.cache._entries[0][1])[round_id % 2]  # a different branch from round to round
        [res] = w.resolve([(0, k, [*x[:k], t], K)], neural_backup=True)
        assert res.hit and len(res.draft.tokens) == K
        context += [*x[:k], t]
        x, q = res.draft.tokens, dense_q(res.q)
        for j in range(K):
            assert torch.allclose(q[j], q_ref(context + x[:j]), atol=1e-5), (round_id, k, t, j)
