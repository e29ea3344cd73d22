"""benchmarks/candidates.py: the replayed rounds are the rounds a live greedy SD run would have."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from candidates import Replay, known_k_candidates, quota_candidates, replay_set  # noqa: E402

from ssd.workers.draft_worker import DraftWorker  # noqa: E402
from ssd.workers.messages import SamplingSpec  # noqa: E402

PROMPT = [3, 1, 4, 1, 5, 9]


def own_greedy(draft, prompt, n):
    w = DraftWorker(draft, dtype="float32", max_slots=1, max_len=256)
    w.add(0, prompt, SamplingSpec(temperature=0))
    return w.propose([(0, n)])[0][0].tokens


def test_quota_candidates_follow_the_worker_rule():
    tops = [([1, 2, 3], [0.5, 0.3, 0.2]), ([4, 5, 6], [0.6, 0.3, 0.1]), ([7, 8, 9], [0.7, 0.2, 0.1])]
    # F = (2, 0, 1): q_0's top two without x_1 = 1, none for k = 1, q_2's top one (k = K keeps x-free)
    assert quota_candidates([1, 4], tops, [2, 0, 1]) == {(0, 2), (0, 3), (2, 7)}


def test_known_k_candidates_spend_the_budget_on_the_true_k():
    tops = [([1, 2, 3], [0.5, 0.3, 0.2]), ([4, 5, 6], [0.6, 0.3, 0.1]), ([7, 8, 9], [0.7, 0.2, 0.1])]
    assert known_k_candidates([1, 4], tops, 0, 2) == {(0, 2), (0, 3)}  # x_1 = 1 was rejected: not a candidate
    assert known_k_candidates([1, 4], tops, 1, 1) == {(1, 5)}
    assert known_k_candidates([1, 4], tops, 2, 2) == {(2, 7), (2, 8)}  # k = K: the bonus may be q_K's top


def test_rounds_match_a_live_draft(models):
    draft = models[1]
    out = own_greedy(draft, PROMPT, 12)
    w = DraftWorker(draft, dtype="float32", max_slots=2, max_len=256)
    rp = Replay(w, PROMPT, out)
    x, tops, drafting, k = rp.round(0, 4)  # the draft's own output: everything accepted
    assert (x, k, len(tops), len(drafting)) == (out[:4], 4, 5, 5)
    assert drafting == tops  # an unrestricted draft drafts from the whole vocabulary
    bad = list(out)
    bad[6] = (out[6] + 1) % 40  # the "target" disagrees at position 6
    rp2 = Replay(w, PROMPT, bad)
    x, tops, _, k = rp2.round(4, 4)
    assert k == 2 and x[:3] == out[4:7]
    # after the rejected x_3 the draft continued on its own tokens, as a live draft would
    assert x == own_greedy(draft, PROMPT + bad[:4], 4) and len(tops) == 5
    assert rp2.round(7, 2)[0] == own_greedy(draft, PROMPT + bad[:7], 2)  # the cache was restored
    rp.close()
    rp2.close()


def test_replay_of_the_drafts_own_output_hits_with_either_selection(models):
    draft = models[1]
    out = own_greedy(draft, PROMPT, 20)
    w = DraftWorker(draft, dtype="float32", max_slots=1, max_len=256)
    r = replay_set(w, [(PROMPT, out)], 3, [1, 4])
    assert r["rounds"] >= 4
    assert r["4"]["quota"] == 1.0  # F_K > 0 at B = 4: the bonus is the draft's top token
    assert 0.0 <= r["1"]["ranked"] <= 1.0 and r["4"]["ranked"] > 0.0
    # the draft's own output: every round accepts all K, and the bonus is q_K's top token
    assert r["1"]["known_k"] == 1.0 and r["top"] == 1.0


def test_a_restricted_replay_drafts_from_kept_ids_and_context(models):
    """draft_vocab: the replayed draft proposes kept ids and the prompt's (or emitted) ids, as DraftWorker."""
    draft = models[1]
    prompt = [3, 30, 4, 33, 5]
    out = own_greedy(draft, prompt, 10)
    w = DraftWorker(draft, dtype="float32", max_slots=2, max_len=256, draft_vocab=20)
    for context in (True, False):
        rp = Replay(w, prompt, out, context)
        cols = set(rp.columns(2).tolist())
        assert cols == set(range(20)) | ({30, 33} | {t for t in out[:2] if t >= 20} if context else set())
        x, tops, drafting, k = rp.round(0, 3)
        assert all(t in set(rp.columns(0).tolist()) for ids, _ in drafting for t in ids)
        assert all(t in set(rp.columns(0).tolist()) for t in x)
        rp.close()
