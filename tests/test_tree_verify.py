"""Tree verification through the TargetWorker: greedy equals AR; sampling is exact (point-mass siblings)."""

from exactness import chi_square_pvalue, exact_continuation_probs
from tiny_models import random_model

from ssd import SamplingParams
from ssd.workers.messages import Draft, SamplingSpec
from ssd.workers.target_worker import TargetWorker

V = 16
PROMPT = [1, 2, 3, 4, 5]


def ar_tokens(model, n: int) -> list[int]:
    w = TargetWorker(model, dtype="float32", max_slots=1, max_len=64)
    w.add(0, PROMPT, SamplingSpec(temperature=0))
    out = []
    while len(out) < n:
        out += w.verify([Draft(seq_id=0)])[0].tokens
    return out[:n]


def first_two(w: TargetWorker, outs: list) -> list[tuple]:
    """Each verified sequence's first two tokens (one more plain step where its round emitted one); then the
    sequences are removed."""
    short = [o.seq_id for o in outs if len(o.tokens) < 2]
    more = {o.seq_id: o.tokens for o in w.verify([Draft(seq_id=i) for i in short])} if short else {}
    for o in outs:
        w.remove(o.seq_id)
    return [tuple((o.tokens + more.get(o.seq_id, []))[:2]) for o in outs]


def test_greedy_tree_accepts_the_argmax_path_and_continues_exactly():
    model = random_model(vocab=V, layers=2, seed=21, scale=2.0)
    ref = ar_tokens(model, 8)
    wrong = [(t + 1) % V for t in ref]
    # root children: a wrong token and the right one; under the right one a wrong and a right child
    tokens = [wrong[0], ref[0], wrong[1], ref[1], ref[2]]
    parents = [-1, -1, 1, 1, 3]
    w = TargetWorker(model, dtype="float32", max_slots=1, max_len=64)
    w.add(0, PROMPT, SamplingSpec(temperature=0))
    o = w.verify([Draft(seq_id=0, tokens=tokens, q_kind="point", parents=parents)])[0]
    assert o.accepted_nodes == [1, 3, 4]
    assert o.tokens == ref[:4]
    # the cache now holds exactly the accepted path: plain decoding continues like AR
    rest = []
    while len(rest) < 4:
        rest += w.verify([Draft(seq_id=0)])[0].tokens
    assert o.tokens + rest[:4] == ref


def test_sampled_tree_with_point_mass_siblings_is_exact():
    model = random_model(vocab=V, layers=2, seed=22, scale=1.5)
    params = SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(model, PROMPT, 2, params)
    top = sorted(exact, key=lambda k: -exact[k])
    firsts = list(dict.fromkeys(t[0] for t in top))[:3]
    # a 3-sibling root level, each with two children (the likeliest continuations)
    tokens, parents = [], []
    for f in firsts:
        tokens.append(f)
        parents.append(-1)
        node = len(tokens) - 1
        for second in [t[1] for t in top if t[0] == f][:2]:
            tokens.append(second)
            parents.append(node)
    n = 2000
    w = TargetWorker(model, dtype="float32", max_slots=64, max_len=64)
    samples, accepted = [], []
    for start in range(0, n, 64):
        ids = list(range(start, min(n, start + 64)))
        for i in ids:
            w.add(i, PROMPT, SamplingSpec(temperature=1.0, seed=i))
        outs = w.verify([Draft(seq_id=i, tokens=tokens, q_kind="point", parents=parents) for i in ids])
        accepted += [o.num_accepted for o in outs]
        samples += first_two(w, outs)
    p = chi_square_pvalue(samples, exact)
    assert p > 1e-3, p
    # The tree was really verified (plain sampling from p would pass the chi-square too): the first level's
    # point masses hold ~0.85 of p, so most rows accept a root sibling, and many a child after it.
    assert sum(a >= 1 for a in accepted) > n * 0.6 and sum(a == 2 for a in accepted) > n * 0.2


def test_a_misshaped_q_is_refused_before_the_forward():
    """A "dist" draft's q is [K, V] for a chain and [N + 1, V] for a tree (row 0: the root's children's):
    anything else is a clear error before the target scores anything, and the sequence goes on intact."""
    import pytest
    import torch

    model = random_model(vocab=V, layers=2, seed=23, scale=2.0)
    w = TargetWorker(model, dtype="float32", max_slots=1, max_len=64)
    w.add(0, PROMPT, SamplingSpec(temperature=1.0, seed=3))
    q = torch.full((2, V), 1.0 / V)
    with pytest.raises(ValueError, match=r"q_draft must be \[3, 16\], got \(2, 16\)"):
        w.verify([Draft(seq_id=0, tokens=[1, 2], q_kind="dist", parents=[-1, 0])], [q])  # a chain's shape
    with pytest.raises(ValueError, match=r"q_draft must be \[2, 16\], got None"):
        w.verify([Draft(seq_id=0, tokens=[1, 2], q_kind="dist")], [None])
    before = w.seqs[0].committed
    o = w.verify([Draft(seq_id=0, tokens=[1, 2], q_kind="dist", parents=[-1, 0])], [torch.full((3, V), 1.0 / V)])[0]
    assert w.seqs[0].committed == before + len(o.tokens) and 1 <= len(o.tokens) <= 3


def _iid_tree_samples(target, draft, n: int, shift_q: bool = False) -> tuple[list[tuple], list[int]]:
    """n trials: a tree whose two root children are i.i.d. draws from the draft's q at the prompt, each with one
    child drawn from q after it; verified with q_kind "dist" (row 0: the root's children's q, row 1 + i: node
    i's children's). shift_q sends row i + 1 in place of row i (a verifier reading the wrong rows)."""
    import torch

    from ssd.kernels.sampling import filter_logits
    from ssd.workers.model_runner import ModelRunner

    runner = ModelRunner(draft, max_slots=1, max_len=64)

    def dist(ids: list[int]) -> torch.Tensor:
        s = runner.allocate()
        logits = runner.forward([s], [ids], last_only=True)
        runner.free(s)
        return filter_logits(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))[0]

    q_root = dist(PROMPT)
    q_after = {t: dist(PROMPT + [t]) for t in range(V)}
    flat = torch.full((V,), 1.0 / V)
    w = TargetWorker(target, dtype="float32", max_slots=64, max_len=64)
    samples, accepted = [], []
    for start in range(0, n, 64):
        ids = list(range(start, min(n, start + 64)))
        drafts, qs = [], []
        for i in ids:
            w.add(i, PROMPT, SamplingSpec(temperature=1.0, seed=i))
            g = torch.Generator().manual_seed(10_000 + i)
            c1, c2 = (int(torch.multinomial(q_root, 1, generator=g)) for _ in range(2))
            g1, g2 = (int(torch.multinomial(q_after[c], 1, generator=g)) for c in (c1, c2))
            q = torch.stack([q_root, q_after[c1], flat, q_after[c2], flat])  # [N + 1, V]
            if shift_q:
                q = torch.cat([q[1:], flat[None]])
            drafts.append(Draft(seq_id=i, tokens=[c1, g1, c2, g2], q_kind="dist", parents=[-1, 0, -1, 2]))
            qs.append(q)
        outs = w.verify(drafts, qs)
        accepted += [o.num_accepted for o in outs]
        samples += first_two(w, outs)
    return samples, accepted


def test_sampled_tree_with_iid_siblings_is_exact():
    """Siblings drawn i.i.d. (with replacement) from the draft's q, verified with their q rows: the emitted
    tokens follow the target's distribution; a verifier reading each node's q from the wrong row is caught."""
    target = random_model(vocab=V, layers=2, seed=22, scale=1.5)
    draft = random_model(vocab=V, layers=1, seed=24, scale=1.5)
    exact = exact_continuation_probs(target, PROMPT, 2, SamplingParams(temperature=1.0))
    samples, accepted = _iid_tree_samples(target, draft, 3000)
    assert chi_square_pvalue(samples, exact) > 1e-3
    assert sum(a >= 1 for a in accepted) > 3000 * 0.2  # the tree is really used (~0.26 accept a root child)
    shifted, _ = _iid_tree_samples(target, draft, 3000, shift_q=True)
    assert chi_square_pvalue(shifted, exact) < 1e-6
