"""Draft lookahead: greedy drafts feed prompt-lookup guesses after the token they feed, and keep those the
draft agrees with. On batch-invariant layers every draft (tokens, ranking tops, the caches behind later drafts)
equals drafting one token per forward; the guesses must also have saved forwards (else nothing was tested)."""

import random

import pytest
import torch
from tiny_models import greedy_tokens, random_model

from ssd.workers.draft_worker import LOOKAHEAD_EXTEND, DraftWorker
from ssd.workers.messages import SamplingSpec
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.dense import use_dense_kernels
from ssd.workers.ngram import NgramIndex, ngram_match


@pytest.fixture(scope="module")
def draft_model():
    # Batch invariant (the dense C kernel); a small vocabulary so greedy text repeats and guesses hit.
    return use_dense_kernels(random_model(vocab=24, layers=1, seed=11, scale=2.0))


def run_rounds(model, lookahead: int, spec: SamplingSpec, ranked: bool, seed: int):
    """Propose / verify-like commit rounds; returns every draft (tokens, tops) and the worker."""
    w = DraftWorker(model, dtype="float32", max_slots=2, max_len=512, lookahead=lookahead, ranked=ranked)
    rng = random.Random(seed)
    w.add(0, [1, 2, 3, 4, 1, 2, 3], spec)
    out = []
    for _ in range(25):
        k = rng.randrange(1, 7)
        drafts, qs = w.propose([(0, k)])
        x = drafts[0].tokens
        st = w.dseqs[0]
        out.append((list(x), [list(t) for t in st.tops], None if qs[0] is None else qs[0].clone()))
        a = rng.randrange(0, k + 1)  # accepted, then a correction the draft did not propose
        w.commit(0, [*x[:a], (x[a] + 1) % 24 if a < k else rng.randrange(24)])
    return out, w


@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookahead_drafts_what_one_by_one_drafts(draft_model, ranked, seed):
    spec = SamplingSpec(temperature=0)
    got, w = run_rounds(draft_model, 3, spec, ranked, seed)
    want, w0 = run_rounds(draft_model, 0, spec, ranked, seed)
    assert [g[:2] for g in got] == [x[:2] for x in want]
    assert w.lookahead_stats["accepted"] > 0  # guesses were taken: drafts came with fewer forwards
    assert w.lookahead_stats["forwards"] < w0.lookahead_stats["forwards"]
    assert w0.lookahead_stats["guessed"] == 0


def test_sampled_rows_take_no_guesses(draft_model):
    spec = SamplingSpec(temperature=0.8, seed=5)
    got, w = run_rounds(draft_model, 3, spec, False, 0)
    want, _ = run_rounds(draft_model, 0, spec, False, 0)
    assert w.lookahead_stats["guessed"] == 0
    for (gx, _, gq), (wx, _, wq) in zip(got, want):
        assert gx == wx and torch.equal(gq, wq)


def test_lookahead_is_validated(draft_model):
    with pytest.raises(ValueError, match="lookahead"):
        DraftWorker(draft_model, dtype="float32", max_slots=1, max_len=64, lookahead=-1)


def test_logits_at_gives_the_rows_of_a_full_forward(draft_model):
    runs = []
    for at in (None, [[0, 2], [1]]):
        r = ModelRunner(draft_model, max_slots=2, max_len=64)
        s0, s1 = r.allocate(), r.allocate()
        r.forward([s0, s1], [[5, 6, 7], [8, 9]], last_only=True)
        runs.append(r.forward([s0, s1], [[1, 2, 3], [4, 5]], logits_at=at))
    full, picked = runs
    assert torch.equal(picked, torch.stack([full[0, 0], full[0, 2], full[1, 1]]))
    with pytest.raises(ValueError, match="logits_at"):
        r.forward([s0], [[1]], logits_at=[[1]])


@pytest.mark.parametrize("seed", range(20))
def test_ngram_index_equals_ngram_match(seed):
    rng = random.Random(seed)
    history = [rng.randrange(1 + seed % 5) for _ in range(rng.randrange(0, 50))]
    idx = NgramIndex(4)
    for cut in sorted({rng.randrange(len(history) + 1) for _ in range(6)}):
        for k in (1, 3):
            assert idx.match(history[:cut], [], k) == ngram_match(history[:cut], k, max_n=4)
    # With a tail of uncommitted tokens: the longest suffix n-gram of history + tail seen in the history.
    h = [1, 2, 3, 9, 2, 3, 4]
    assert NgramIndex(4).match(h, [2, 3], 2) == ([4], 2)  # (2, 3)'s latest occurrence is followed by 4
    assert NgramIndex(4).match(h, [3, 9], 3) == ([2, 3, 4], 2)  # the tail (3, 9) occurred at 2..3, followed by 2
    assert NgramIndex(4).match(h, [7], 2) == ([], 0)


def speculate_rounds(model, lookahead: int, rounds: int = 12, K: int = 3, budget: int = 4):
    """propose, then rounds of speculate / resolve on the hit with the most accepted tokens, taking K tokens
    (so both workers see the same drafts); returns the cache entries of every round, the committed tokens
    before each round, and the worker."""
    from ssd.workers.draft_worker import SpecRequest

    w = DraftWorker(model, dtype="float32", max_slots=1, max_len=512, lookahead=lookahead, ranked=True)
    prompt = [1, 2, 3, 4, 1, 2, 3]
    w.add(0, prompt, SamplingSpec(temperature=0))
    committed = list(prompt)
    x = w.propose([(0, K)])[0][0].tokens
    rounds_out = []
    fanout = [0] * K + [budget]
    for round_id in range(rounds):
        w.speculate([SpecRequest(seq_id=0, round_id=round_id, tokens=x, fanout=fanout, next_fanout=fanout,
                                 k_next=K)])
        entries = {key: list(e.tokens) for key, e in w.cache._entries[0][1].items()}
        rounds_out.append((entries, list(committed), list(x)))
        k, t = max(entries)  # the outcome with the most accepted tokens, its first candidate
        [res] = w.resolve([(0, k, [*x[:k], t], K, K)], neural_backup=True)
        committed += [*x[:k], t]
        x = res.draft.tokens
    return rounds_out, w


def test_speculation_lookahead_extends_branches_with_the_drafts_own_tokens(draft_model):
    got, w = speculate_rounds(draft_model, 3)
    want, w0 = speculate_rounds(draft_model, 0)
    extended = 0
    for (g_entries, committed, x), (w_entries, _, _) in zip(got, want):
        assert g_entries.keys() == w_entries.keys()
        for (k, t), y in g_entries.items():
            assert y[: len(w_entries[(k, t)])] == w_entries[(k, t)]  # the first K as drafting one by one
            if len(y) > 3:  # lookahead went past K: still the draft's own greedy continuation
                extended += 1
                assert y == greedy_tokens(draft_model, committed + x[:k] + [t], len(y))
            assert len(y) <= 3 + LOOKAHEAD_EXTEND * w.lookahead
    assert extended > 0 and w.lookahead_stats["accepted"] > 0
    assert w0.lookahead_stats["guessed"] == 0


def test_resolve_takes_up_to_k_max_tokens_of_an_extended_branch(draft_model):
    from ssd.workers.draft_worker import SpecRequest

    rounds_out, _ = speculate_rounds(draft_model, 3, rounds=12)
    # the first round whose top outcome was extended: replay it and take everything
    i = next(i for i, (e, _, _) in enumerate(rounds_out) if len(e[max(e)]) > 3)
    w = DraftWorker(draft_model, dtype="float32", max_slots=1, max_len=512, lookahead=3, ranked=True)
    _, committed, x = rounds_out[i]
    w.add(0, committed, SamplingSpec(temperature=0))
    w.speculate([SpecRequest(seq_id=0, round_id=0, tokens=x, fanout=[0, 0, 0, 4], next_fanout=[0, 0, 0, 4],
                             k_next=3)])
    entries = {key: list(e.tokens) for key, e in w.cache._entries[0][1].items()}
    k, t = max(entries)
    [res] = w.resolve([(0, k, [*x[:k], t], 3, 5)], neural_backup=True)
    assert res.hit and res.draft.tokens == entries[(k, t)][:5] and len(res.draft.tokens) > 3
    # all of it accepted, then a bonus token: the next draft continues from the extended branch's cache
    w.commit(0, [*res.draft.tokens, 5])
    nxt = w.propose([(0, 4)])[0][0].tokens
    assert nxt == greedy_tokens(draft_model, committed + x[:k] + [t] + res.draft.tokens + [5], 4)
