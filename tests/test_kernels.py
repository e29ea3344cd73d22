"""ssd.kernels: fast vectorised ops == plain reference loops, edge cases, CUDA kernel build / parity."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from ssd.kernels import cuda as kcuda
from ssd.kernels import (
    filter_logits,
    ref_filter_logits,
    ref_saguaro_probs,
    ref_sample_from_probs,
    ref_verify_greedy,
    ref_verify_rejection,
    saguaro_probs,
    sample_from_probs,
    verify_greedy,
    verify_rejection,
    verify_tree_greedy,
    verify_tree_rejection,
)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Small tensors: one intra-op thread is faster and behaves on a shared, loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_params(B: int, V: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature (some greedy), top_k (some off / >= V) and top_p (some off)."""
    temperature = torch.rand(B, generator=g) * 1.8 + 0.1  # [B]
    temperature[torch.rand(B, generator=g) < 0.15] = 0.0
    top_k = torch.randint(-1, V + 3, (B,), generator=g)  # [B] includes off values
    top_k[torch.rand(B, generator=g) < 0.3] = 0
    top_p = torch.rand(B, generator=g) * 0.9 + 0.1  # [B]
    top_p[torch.rand(B, generator=g) < 0.3] = 1.0
    return temperature, top_k, top_p


def draft_batch(B: int, K: int, V: int, g: torch.Generator, q_draft: torch.Tensor | None):
    """Ragged drafts: x ~ q (or uniform tokens for a point-mass drafter), padding -1 beyond num_draft."""
    num_draft = torch.randint(0, K + 1, (B,), generator=g)  # [B]
    if q_draft is None:
        x = torch.randint(0, V, (B, K), generator=g)
    else:
        x = sample_from_probs(q_draft, torch.rand(B, K, generator=g))  # [B, K]
    x = torch.where(torch.arange(K)[None, :] < num_draft[:, None], x, -1)
    return x, num_draft


# ----------------------------------------------------------------------------------------------
# sampling.py
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(40, 29), (12, 4, 33)])
def test_filter_logits_matches_ref(shape):
    g = gen(1)
    V = shape[-1]
    logits = torch.randn(*shape, generator=g) * 3  # [B, ..., V]
    logits[..., 3] = float("-inf")  # a masked vocab entry
    logits[0, ..., 5] = logits[0, ..., 7]  # ties
    temperature, top_k, top_p = random_params(shape[0], V, g)
    fast = filter_logits(logits, temperature, top_k, top_p)
    ref = ref_filter_logits(logits, temperature, top_k, top_p)
    assert fast.shape == logits.shape and fast.dtype == torch.float32
    assert torch.equal(fast, ref)  # the same bits: each row normalised by its float64 sequential mass
    torch.testing.assert_close(fast.sum(-1), torch.ones(shape[:-1]), atol=1e-5, rtol=0)


def test_filter_logits_semantics():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]] * 6)  # [6, 5] tie between tokens 1 and 2
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 1.0])
    top_k = torch.tensor([0, 0, 1, 2, 0, 7])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    out = filter_logits(logits, temperature, top_k, top_p)
    assert out[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # greedy: tie -> lowest index
    torch.testing.assert_close(out[1], torch.softmax(logits[1], -1))  # all filters off
    assert out[2].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # top-1 with a tie keeps exactly 1: lowest index
    # top-p keeps a token while the mass before it is below p: 4 equal tokens at p = 0.5 keep 2, not 3
    half = filter_logits(torch.zeros(1, 4), torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.5]))
    assert (half > 0).sum() == 2
    torch.testing.assert_close(out[3], torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))
    torch.testing.assert_close(out[4], torch.softmax(logits[4] / 0.5, -1))
    torch.testing.assert_close(out[5], torch.softmax(logits[5], -1))  # top_k >= V is off

    probs = torch.tensor([0.5, 0.3, 0.2])
    lg = probs.log().expand(4, 3)
    no_k = torch.zeros(4, dtype=torch.long)
    out = filter_logits(lg, torch.ones(4), no_k, torch.tensor([0.45, 0.7, 0.9, 0.0]))
    assert (out > 0).sum(-1).tolist() == [1, 2, 3, 1]  # smallest prefix with mass >= top_p; top-1 always
    torch.testing.assert_close(out[1], torch.tensor([0.625, 0.375, 0.0]))
    # top-p applies to the top-k-renormalised distribution: top-2 -> [0.625, 0.375]; 0.6 keeps 1
    out = filter_logits(lg[:1], torch.ones(1), torch.tensor([2]), torch.tensor([0.6]))
    assert out[0].tolist() == [1.0, 0.0, 0.0]
    # per-row params broadcast over the middle dim
    lg3 = torch.randn(2, 3, 6, generator=gen(0))
    out = filter_logits(lg3, torch.tensor([0.0, 1.0]), torch.tensor([0, 2]), torch.tensor([1.0, 1.0]))
    assert ((out[0] > 0).sum(-1) == 1).all() and ((out[1] > 0).sum(-1) == 2).all()


def test_sample_from_probs_matches_ref_and_never_zero():
    g = gen(2)
    B, V = 300, 23
    probs = torch.rand(B, V, generator=g) * 3  # unnormalised masses are allowed
    probs[torch.rand(B, V, generator=g) < 0.5] = 0.0
    probs[:, 0] = torch.where(torch.arange(B) % 3 == 0, 0.0, probs[:, 0])
    probs[torch.arange(B), torch.randint(0, V, (B,), generator=g)] += 0.1  # every row has mass
    u = torch.rand(B, generator=g)
    u[:10] = 0.0
    u[10:20] = 1.0 - 2.0**-24  # largest float32 below 1
    fast = sample_from_probs(probs, u)
    ref = ref_sample_from_probs(probs, u)
    assert fast.dtype == torch.int64 and torch.equal(fast, ref)
    assert bool((probs.gather(1, fast[:, None]) > 0).all())
    # float64 uniforms just below 1 too
    u64 = torch.full((B,), 1.0 - 2.0**-53, dtype=torch.float64)
    fast = sample_from_probs(probs, u64)
    assert torch.equal(fast, ref_sample_from_probs(probs, u64))
    assert bool((probs.gather(1, fast[:, None]) > 0).all())


def test_sample_from_probs_all_zero_or_nan_row_gives_token_0_like_the_ref():
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.0], [float("nan")] * 4, [0.0, 0.5, 0.5, 0.0]])
    u = torch.tensor([0.3, 0.3, 0.999])
    assert sample_from_probs(probs, u).tolist() == ref_sample_from_probs(probs, u).tolist() == [0, 0, 2]


def test_sample_from_probs_boundaries():
    probs = torch.tensor([[0.25, 0.0, 0.25, 0.5, 0.0]] * 5)  # exact binary CDF 0.25, 0.25, 0.5, 1, 1
    u = torch.tensor([0.0, 0.2499, 0.25, 0.5, 0.9999999])
    assert sample_from_probs(probs, u).tolist() == [0, 0, 2, 3, 3]  # boundary -> next positive token
    assert ref_sample_from_probs(probs, u).tolist() == [0, 0, 2, 3, 3]
    lead_zeros = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    assert sample_from_probs(lead_zeros, torch.tensor([0.0])).tolist() == [2]
    # leading batch dims
    p3 = torch.rand(2, 3, 7, generator=gen(3))
    u3 = torch.rand(2, 3, generator=gen(4))
    assert sample_from_probs(p3, u3).shape == (2, 3)
    assert torch.equal(sample_from_probs(p3, u3), ref_sample_from_probs(p3, u3))


def test_filter_and_saguaro_ties_match_ref():
    """Heavily tied (quantised) logits, small k on a larger vocab (the topk-threshold fast path)."""
    g = gen(6)
    B, V = 48, 200
    logits = torch.randint(0, 5, (B, V), generator=g).float()  # [B, V] many exact ties
    temperature = torch.rand(B, generator=g) + 0.5
    top_k = torch.randint(1, 12, (B,), generator=g)
    top_k[::4] = 0
    top_p = torch.where(torch.rand(B, generator=g) < 0.5, torch.rand(B, generator=g), torch.ones(B))
    fast = filter_logits(logits, temperature, top_k, top_p)
    ref = ref_filter_logits(logits, temperature, top_k, top_p)
    assert torch.equal(fast, ref)
    k_rows = top_k > 0
    assert ((fast[k_rows] > 0).sum(-1) <= top_k[k_rows]).all()
    fanout = torch.randint(0, 15, (B,), generator=g)
    for C in (0.0, 0.5):
        fast = saguaro_probs(logits, temperature, top_k, top_p, fanout, C)
        ref = ref_saguaro_probs(logits, temperature, top_k, top_p, fanout, C)
        assert torch.equal(fast, ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_probabilities_do_not_depend_on_the_rows_beside_it(threads):
    """A seeded request samples the same token alone or in any batch: its row's filtered (and Saguaro) bits
    must not move with a filtering row beside it, nor with the thread split of a lone row's sum."""
    g = gen(11)
    V = 50_000
    logits = torch.randn(3, V, generator=g) * 4  # [3, V]
    temperature = torch.tensor([0.8, 0.8, 0.8])
    top_k, top_p = torch.tensor([0, 40, 0]), torch.tensor([1.0, 1.0, 0.95])  # none, top-k, top-p
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = filter_logits(logits, temperature, top_k, top_p)
        for i in range(3):
            alone = filter_logits(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
            assert torch.equal(alone[0], batch[i]), i
        fanout = torch.tensor([3, 2, 4])
        sag = saguaro_probs(logits, temperature, top_k, top_p, fanout, 0.5)
        for i in range(3):
            one = saguaro_probs(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1],
                                fanout[i:i + 1], 0.5)
            assert torch.equal(one[0], sag[i]), i
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("C", [0.0, 0.3, 0.7, 1.0])
def test_saguaro_matches_ref(C):
    g = gen(5)
    B, K1, V = 10, 3, 19
    logits = torch.randn(B, K1, V, generator=g) * 2
    temperature, top_k, top_p = random_params(B, V, g)
    for fanout in (torch.randint(0, 6, (B,), generator=g), torch.randint(0, V + 2, (B, K1), generator=g)):
        fast = saguaro_probs(logits, temperature, top_k, top_p, fanout, C)
        ref = ref_saguaro_probs(logits, temperature, top_k, top_p, fanout, C)
        assert torch.equal(fast, ref)
        torch.testing.assert_close(fast.sum(-1), torch.ones(B, K1), atol=1e-5, rtol=0)
    if C == 1.0:
        assert torch.equal(fast, filter_logits(logits, temperature, top_k, top_p))


def test_saguaro_semantics():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    lg = probs.log()[None]
    one, off_k, off_p = torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1)
    out = saguaro_probs(lg, one, off_k, off_p, torch.tensor([2]), 0.5)[0]  # top-2 = tokens 1, 3
    expect = torch.tensor([0.1, 0.2, 0.2, 0.15])
    torch.testing.assert_close(out, expect / expect.sum())
    out = saguaro_probs(lg, one, off_k, off_p, torch.tensor([2]), 0.0)[0]
    torch.testing.assert_close(out, torch.tensor([1 / 3, 0.0, 2 / 3, 0.0]))
    # C == 0 and F >= support: zero mass -> fall back to the unscaled filtered distribution
    out = saguaro_probs(lg, one, torch.tensor([2]), off_p, torch.tensor([3]), 0.0)[0]
    torch.testing.assert_close(out, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    out = saguaro_probs(lg, torch.zeros(1), off_k, off_p, torch.tensor([1]), 0.0)[0]  # greedy row
    assert out.tolist() == [0.0, 1.0, 0.0, 0.0]
    out = saguaro_probs(lg, one, off_k, off_p, torch.tensor([0]), 0.0)[0]  # F = 0: unchanged
    torch.testing.assert_close(out, probs)


# ----------------------------------------------------------------------------------------------
# linear verification
# ----------------------------------------------------------------------------------------------


def check_result_layout(res, num_draft):
    B, K1 = res.tokens.shape
    assert res.num_accepted.dtype == torch.int64 and res.tokens.dtype == torch.int64
    assert bool((res.num_accepted >= 0).all()) and bool((res.num_accepted <= num_draft).all())
    pos = torch.arange(K1)[None, :]
    n = res.num_accepted[:, None]
    assert bool((res.tokens[pos > n] == -1).all())
    assert bool((res.tokens[pos <= n] >= 0).all())


@pytest.mark.parametrize("K", [1, 4])
def test_verify_greedy_matches_ref(K):
    g = gen(10 + K)
    B, V = 64, 37
    logits = torch.randn(B, K + 1, V, generator=g)  # [B, K+1, V]
    logits[:4, :, 5] = logits[:4, :, 9] = 10.0  # argmax ties -> lowest index
    am = logits.argmax(-1)  # [B, K+1]
    x = torch.where(torch.rand(B, K, generator=g) < 0.8, am[:, :K], torch.randint(0, V, (B, K), generator=g))
    num_draft = torch.randint(0, K + 1, (B,), generator=g)
    pad = torch.arange(K)[None, :] >= num_draft[:, None]
    x = torch.where(pad & (torch.rand(B, K, generator=g) < 0.5), -1, x)  # padding: -1 or the argmax itself
    fast = verify_greedy(x, num_draft, logits)
    ref = ref_verify_greedy(x, num_draft, logits)
    assert torch.equal(fast.num_accepted, ref.num_accepted) and torch.equal(fast.tokens, ref.tokens)
    check_result_layout(fast, num_draft)
    assert fast.num_accepted.float().mean() > 0.25 * K  # the test exercises acceptance


def test_verify_greedy_edges():
    V = 11
    logits = torch.randn(3, 4, V, generator=gen(12))  # [3, K+1 = 4, V]
    am = logits.argmax(-1)
    # all accepted (K_b = 3, 2, 0) with padding equal to the argmax (must still not be accepted)
    x = am[:, :3].clone()
    nd = torch.tensor([3, 2, 0])
    res = verify_greedy(x, nd, logits)
    assert res.num_accepted.tolist() == [3, 2, 0]
    assert res.tokens[0].tolist() == am[0].tolist()
    assert res.tokens[1].tolist() == am[1, :3].tolist() + [-1]
    assert res.tokens[2].tolist() == [am[2, 0].item(), -1, -1, -1]
    # none accepted
    res = verify_greedy((am[:, :3] + 1) % V, torch.tensor([3, 3, 3]), logits)
    assert res.num_accepted.tolist() == [0, 0, 0] and res.tokens[:, 0].tolist() == am[:, 0].tolist()
    # K = 0
    res = verify_greedy(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), logits[:, :1])
    assert res.tokens.shape == (3, 1) and res.tokens[:, 0].tolist() == am[:, 0].tolist()


def make_pq(B: int, K: int, V: int, g: torch.Generator, q_mode: str):
    """Filtered p [B, K+1, V] and q [B, K, V] (or None) with varied sampling parameters."""
    temperature, top_k, top_p = random_params(B, V, g)
    p = filter_logits(torch.randn(B, K + 1, V, generator=g) * 2, temperature, top_k, top_p)
    if q_mode == "far":
        q = filter_logits(torch.randn(B, K, V, generator=g) * 2, *random_params(B, V, g))
    elif q_mode == "equal":
        q = p[:, :K].clone()
    elif q_mode == "onehot":
        q = torch.nn.functional.one_hot(torch.randint(0, V, (B, K), generator=g), V).float()
    elif q_mode == "close":
        q = filter_logits(torch.log(p[:, :K] + 1e-3) + 0.3 * torch.randn(B, K, V, generator=g),
                          torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B))
    else:
        q = None
    return p, q


@pytest.mark.parametrize("q_mode", ["far", "close", "equal", "onehot", "none"])
@pytest.mark.parametrize("K", [1, 5])
def test_verify_rejection_matches_ref(q_mode, K):
    g = gen(20 + K)
    B, V = 96, 29
    p, q = make_pq(B, K, V, g, q_mode)
    x, num_draft = draft_batch(B, K, V, g, q)
    x[0, :num_draft[0]] = V + 2  # an out-of-vocab id inside the valid range: never accepted
    u_accept = torch.rand(B, K, generator=g)
    u_sample = torch.rand(B, generator=g)
    fast = verify_rejection(x, num_draft, p, q, u_accept, u_sample)
    ref = ref_verify_rejection(x, num_draft, p, q, u_accept, u_sample)
    assert torch.equal(fast.num_accepted, ref.num_accepted) and torch.equal(fast.tokens, ref.tokens)
    check_result_layout(fast, num_draft)
    # the emitted token at num_accepted has positive target probability
    rows = torch.arange(B)
    last = fast.tokens[rows, fast.num_accepted]
    assert bool((p[rows, fast.num_accepted, last] > 0).all())
    if q_mode == "equal":
        assert torch.equal(fast.num_accepted[1:], num_draft[1:])  # q == p accepts every draft


def test_point_mass_equals_onehot_q():
    g = gen(30)
    B, K, V = 80, 3, 17
    p, _ = make_pq(B, K, V, g, "none")
    x, num_draft = draft_batch(B, K, V, g, None)
    q1 = torch.nn.functional.one_hot(x.clamp(min=0), V).float()  # [B, K, V]
    ua, us = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    a = verify_rejection(x, num_draft, p, None, ua, us)
    b = verify_rejection(x, num_draft, p, q1, ua, us)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


def test_verify_rejection_edges():
    V = 8
    p = torch.softmax(torch.randn(2, 4, V, generator=gen(31)), -1)  # [2, K+1 = 4, V]
    p[0, 2] = torch.nn.functional.one_hot(torch.tensor(6), V).float()  # bonus row for K_b = 2
    p[0, 3] = torch.nn.functional.one_hot(torch.tensor(1), V).float()  # garbage row beyond K_b
    q = p[:, :3].clone()
    x = torch.stack([p[0, :3].argmax(-1), p[1, :3].argmax(-1)])  # [2, 3]
    x[0, 2] = -1
    nd = torch.tensor([2, 3])
    u_accept = torch.full((2, 3), 0.999)
    u_sample = torch.tensor([0.3, 0.7])
    # all accepted (q == p): bonus from p_{K_b + 1} (row index K_b, not K)
    res = verify_rejection(x, nd, p, q, u_accept, u_sample)
    assert res.num_accepted.tolist() == [2, 3]
    assert res.tokens[0].tolist() == [x[0, 0].item(), x[0, 1].item(), 6, -1]
    assert res.tokens[1, 3].item() == sample_from_probs(p[1, 3][None], u_sample[1:]).item()
    # none accepted: drafts with zero target mass; correction from the residual
    p2 = p.clone()
    p2[:, 0, 0] = 0.0
    x0 = torch.zeros(2, 3, dtype=torch.long)
    res = verify_rejection(x0, nd, p2, None, u_accept, u_sample)
    assert res.num_accepted.tolist() == [0, 0] and (res.tokens[:, 0] != 0).all()
    assert res.tokens[:, 0].tolist() == sample_from_probs(p2[:, 0], u_sample).tolist()
    # empty draft (num_draft 0): sample from p_1
    res = verify_rejection(x, torch.tensor([0, 0]), p, q, u_accept, u_sample)
    assert res.num_accepted.tolist() == [0, 0]
    assert res.tokens[:, 0].tolist() == sample_from_probs(p[:, 0], u_sample).tolist()
    assert (res.tokens[:, 1:] == -1).all()
    # K = 0
    res = verify_rejection(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), p[:, :1],
                           p[:, :0], torch.zeros(2, 0), u_sample)
    assert res.tokens.shape == (2, 1)
    assert res.tokens[:, 0].tolist() == sample_from_probs(p[:, 0], u_sample).tolist()
    # zero-mass residual (q >= p everywhere, here q = 2p): rejection falls back to sampling p
    res = verify_rejection(x, nd, p, 2 * q, torch.full((2, 3), 0.9), u_sample)
    assert res.num_accepted.tolist() == [0, 0]
    assert res.tokens[:, 0].tolist() == sample_from_probs(p[:, 0], u_sample).tolist()
    ref = ref_verify_rejection(x, nd, p, 2 * q, torch.full((2, 3), 0.9), u_sample)
    assert torch.equal(ref.tokens, res.tokens)


# ----------------------------------------------------------------------------------------------
# tree verification
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_mode", ["far", "none", "onehot"])
def test_chain_tree_equals_linear(q_mode):
    g = gen(40)
    K, V = 4, 13
    for trial in range(40):
        p, q = make_pq(1, K, V, g, q_mode)
        x, _ = draft_batch(1, K, V, g, q)
        x = x.clamp(min=0)
        if trial % 2 == 0:
            x[0, :2] = p[0, :2].argmax(-1)  # make long acceptances likely
        u = torch.rand(K + 1, generator=g)
        lin = verify_rejection(x, torch.tensor([K]), p, q, u[None, :K], u[K:])
        path, nxt = verify_tree_rejection(
            x[0], [-1, 0, 1, 2], p[0, 0], p[0, 1:], None if q is None else q[0, 0],
            None if q is None else torch.cat([q[0, 1:], q[0, :1]]), u
        )
        n = int(lin.num_accepted[0])
        assert path == list(range(n)) and nxt == int(lin.tokens[0, n])
        glin = verify_greedy(x, torch.tensor([K]), p)
        gpath, gnxt = verify_tree_greedy(x[0], [-1, 0, 1, 2], p[0, 0], p[0, 1:])
        gn = int(glin.num_accepted[0])
        assert gpath == list(range(gn)) and gnxt == int(glin.tokens[0, gn])


def test_tree_small_cases():
    V = 6
    p_root = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    p_nodes = torch.eye(V)[[3, 4, 5]]  # [3, V]: after node i the target deterministically emits 3 + i
    # one node, accepted -> bonus from p_nodes[0]
    path, nxt = verify_tree_rejection([1], [-1], p_root, p_nodes[:1], None, None, torch.tensor([0.2, 0.5]))
    assert path == [0] and nxt == 3
    # one node, rejected (u >= p(x) = 0.5) -> residual p with token 1 zeroed -> token 2
    path, nxt = verify_tree_rejection([1], [-1], p_root, p_nodes[:1], None, None, torch.tensor([0.6, 0.5]))
    assert path == [] and nxt == 2
    # siblings [1, 2] as point masses: first rejected, second then has residual mass 1 -> accepted
    path, nxt = verify_tree_rejection([1, 2, 0], [-1, -1, 1], p_root, p_nodes, None, None,
                                      torch.tensor([0.9, 0.99, 0.1, 0.0]))
    assert path == [1] and nxt == 4  # node 2 (token 0) has zero mass under p_nodes[1] = delta(4)
    # greedy: ties -> lowest index (token 1), node 0 is a leaf -> bonus argmax p_nodes[0]
    assert verify_tree_greedy([2, 1], [-1, -1], p_root, p_nodes[:2]) == ([1], 4)
    assert verify_tree_greedy([5], [-1], p_root, p_nodes[:1]) == ([], 1)
    with pytest.raises(ValueError):
        verify_tree_greedy([1, 2], [-1, 1], p_root, p_nodes[:2])  # parents[i] must be < i


# ----------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_kernels_compile(tmp_path):
    # a full sm_80 object with the block size the loader uses, and PTX for the largest block size
    for mode, arch, block in (("-c", "sm_80", kcuda.BLOCK), ("--ptx", "compute_90", 1024)):
        cmd = ["nvcc", mode, f"-arch={arch}", "--std=c++17", f"-DSSD_BLOCK={block}", str(kcuda.cu_path()),
               "-o", str(tmp_path / f"verify_{arch}.out")]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert "warning" not in res.stderr.lower(), res.stderr


def test_cupy_that_cannot_compile_is_not_available(monkeypatch):
    """A cupy without a working compiler imports fine; the kernels must then count as unavailable (the torch
    path verifies) rather than fail every verification."""

    class BrokenModule:
        def __init__(self, **kw):
            pass

        def get_function(self, name):
            raise RuntimeError("nvrtc: library not found")

    class FakeCupy:
        RawModule = BrokenModule

    monkeypatch.setattr(kcuda.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kcuda, "_cupy", lambda: FakeCupy)
    for f in (kcuda._module, kcuda._compiles):
        f.cache_clear()
    try:
        assert not kcuda.available()
    finally:
        for f in (kcuda._module, kcuda._compiles):
            f.cache_clear()


@pytest.mark.skipif(not kcuda.available(), reason="needs torch.cuda and cupy")
@pytest.mark.parametrize("V", [50, 1000, 1003, 4099])
def test_cuda_matches_torch(V):
    g = gen(50)
    B, K = 64, 4
    for q_mode in ("far", "equal", "onehot", "none"):
        p, q = make_pq(B, K, V, g, q_mode)
        x, num_draft = draft_batch(B, K, V, g, q)
        ua, us = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
        cpu = verify_rejection(x, num_draft, p, q, ua, us)
        gpu = verify_rejection(x.cuda(), num_draft.cuda(), p.cuda(), None if q is None else q.cuda(),
                               ua.cuda(), us.cuda())
        assert torch.equal(cpu.num_accepted, gpu.num_accepted.cpu()), q_mode
        assert torch.equal(cpu.tokens, gpu.tokens.cpu()), q_mode
    logits = torch.randn(B, K + 1, V, generator=g)
    logits[:3, :, 7] = logits[:3, :, 2] = 50.0  # ties
    am = logits.argmax(-1)
    x = torch.where(torch.rand(B, K, generator=g) < 0.8, am[:, :K], -1)
    nd = torch.randint(0, K + 1, (B,), generator=g)
    cpu = verify_greedy(x, nd, logits)
    gpu = verify_greedy(x.cuda(), nd.cuda(), logits.cuda())
    assert torch.equal(cpu.tokens, gpu.tokens.cpu()) and torch.equal(cpu.num_accepted, gpu.num_accepted.cpu())
    half = logits.half()  # fp16 input is upcast for the kernel; compare against the same fp16 values
    cpu = verify_greedy(x, nd, half.float())
    gpu = verify_greedy(x.cuda(), nd.cuda(), half.cuda())
    assert torch.equal(cpu.tokens, gpu.tokens.cpu())
    # K = 0 and an empty draft
    z = torch.zeros(B, 0, dtype=torch.long)
    cpu = verify_rejection(z, torch.zeros(B, dtype=torch.long), p[:, :1], None, torch.zeros(B, 0), us)
    gpu = verify_rejection(z.cuda(), torch.zeros(B, dtype=torch.long).cuda(), p[:, :1].cuda(), None,
                           torch.zeros(B, 0).cuda(), us.cuda())
    assert torch.equal(cpu.tokens, gpu.tokens.cpu())


def test_cpu_kernels_build_where_the_cpu_and_compiler_allow():
    """The CPU-kernel test modules skip when the kernels are unavailable; on a machine that has AVX2,
    FMA, F16C and g++ (CI's), unavailability is a build failure and must fail here, not skip."""
    from ssd.kernels import cpu as cpu_kernels

    if {"avx2", "fma", "f16c"} - cpu_kernels._cpu_flags() or shutil.which("g++") is None:
        pytest.skip("no AVX2/FMA/F16C or no g++ here")
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
