"""Losslessness: the tokens emitted by one speculative round are distributed exactly as the target's.

A small Markov "language model" over V tokens: the target emits t1 ~ p1, t2 ~ P2[t1], t3 ~ P3[t2];
the drafter uses q1, Q2, Q3 (far from p, equal to p, point masses, Saguaro-modified). Thousands of
independent rounds are simulated at once (rows of one batch) with uniforms from fixed-seed
generators, and the first emitted token and the pair of the first two emitted tokens are compared
with the exact distribution by a chi-square test (tiny-expected bins merged). Rows whose round emits
only one token take their second token from an ordinary target sample (any later lossless round).

A deliberately wrong verifier (greedy match at temperature 1, the paper code's cache-miss rule) must
fail the same test, which shows the test has power.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy.stats import chisquare

from ssd.kernels import (
    VerifyResult,
    filter_logits,
    saguaro_probs,
    sample_from_probs,
    verify_rejection,
    verify_tree_rejection,
)

V = 20
K = 2
N_LINEAR = 40_000
N_TREE = 3_000
PASS = 1e-3
FAIL = 1e-6

# (temperature, top_k, top_p) applied to both target and draft tables
PARAMS = [(1.0, 0, 1.0), (0.7, 8, 1.0), (1.3, 6, 0.85)]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Small tensors: one intra-op thread is faster and behaves on a shared, loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of integer samples against exact probabilities (merged small bins).

    Any sample in a zero-probability bin fails outright."""
    probs = probs.reshape(-1).double()
    M = probs.numel()
    n = samples.numel()
    obs = torch.bincount(samples.reshape(-1), minlength=M).double()
    exp = probs / probs.sum() * n
    assert obs[exp == 0].sum() == 0, "sampled an outcome of probability zero"
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    order = torch.argsort(exp)
    obs, exp = obs[order].tolist(), exp[order].tolist()
    m_obs, m_exp = 0.0, 0.0  # all bins with expected count < 5 go into one merged bin ...
    while exp and (exp[0] < 5.0 or 0.0 < m_exp < 5.0):  # ... topped up until it reaches 5 itself
        m_obs += obs.pop(0)
        m_exp += exp.pop(0)
    if m_exp > 0:
        obs.append(m_obs)
        exp.append(m_exp)
    if len(exp) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def tables(seed: int, temperature: float, top_k: int, top_p: float, scale: float = 1.5):
    """Filtered Markov tables: first [V], then [V, V] conditionals (row = previous token)."""
    g = gen(seed)
    lg1 = torch.randn(V, generator=g) * scale
    lg2 = torch.randn(V, V, generator=g) * scale
    lg3 = torch.randn(V, V, generator=g) * scale

    def filt(lg: torch.Tensor) -> torch.Tensor:
        rows = lg.reshape(-1, V)
        n = rows.shape[0]
        out = filter_logits(rows, torch.full((n,), temperature), torch.full((n,), top_k),
                            torch.full((n,), top_p))
        return out.reshape(lg.shape)

    return (lg1, lg2, lg3), (filt(lg1), filt(lg2), filt(lg3))


Verifier = Callable[..., VerifyResult]


def simulate_linear(q_mode: str, params, seed: int, verifier: Verifier = verify_rejection, C: float = 1.0):
    """N_LINEAR independent rounds; returns (t1 [n], pair index t1 * V + t2 [n], exact p1, exact joint)."""
    temperature, top_k, top_p = params
    _, (p1, P2, P3) = tables(seed, *params)
    (ql1, QL2, _), (q1, Q2, _) = tables(seed + 1000, *params, scale=2.5)  # a different, sharper drafter
    if q_mode == "equal":
        q1, Q2 = p1, P2
    elif q_mode == "close":  # the target's logits slightly perturbed
        (pl1, PL2, _), _ = tables(seed, *params)
        (nl1, NL2, _), _ = tables(seed + 2000, *params, scale=0.5)
        q1 = filter_logits((pl1 + nl1)[None], torch.tensor([temperature]), torch.tensor([top_k]),
                           torch.tensor([top_p]))[0]
        Q2 = filter_logits(PL2 + NL2, torch.full((V,), temperature), torch.full((V,), top_k),
                           torch.full((V,), top_p))
    elif q_mode == "saguaro":
        n1 = 1
        q1 = saguaro_probs(ql1[None], torch.full((n1,), temperature), torch.full((n1,), top_k),
                           torch.full((n1,), top_p), torch.tensor([3]), C)[0]
        Q2 = saguaro_probs(QL2, torch.full((V,), temperature), torch.full((V,), top_k),
                           torch.full((V,), top_p), torch.full((V,), 2), C)
    g = gen(seed + 7)
    B = N_LINEAR
    if q_mode in ("point", "onehot"):
        # a drafter without probabilities: mostly the draft argmax, sometimes a random token
        x1 = torch.where(torch.rand(B, generator=g) < 0.7, q1.argmax(),
                         torch.randint(0, V, (B,), generator=g))
        x2 = torch.where(torch.rand(B, generator=g) < 0.7, Q2[x1].argmax(-1),
                         torch.randint(0, V, (B,), generator=g))
    else:
        x1 = sample_from_probs(q1.expand(B, V), torch.rand(B, generator=g))  # [B]
        x2 = sample_from_probs(Q2[x1], torch.rand(B, generator=g))  # [B]
    draft = torch.stack([x1, x2], dim=1)  # [B, K]
    num_draft = torch.randint(0, K + 1, (B,), generator=g)  # ragged
    pos = torch.arange(K)[None, :]
    draft = torch.where(pos < num_draft[:, None], draft, -1)
    p_target = torch.stack([p1.expand(B, V), P2[x1], P3[x2]], dim=1)  # [B, K+1, V]
    # rows beyond K_b must never be used: fill them with garbage
    garbage = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 3, -1)
    p_target = torch.where(torch.arange(K + 1)[None, :, None] <= num_draft[:, None, None], p_target, garbage)
    if q_mode == "point":
        q_draft = None
    elif q_mode == "onehot":
        q_draft = torch.nn.functional.one_hot(draft.clamp(min=0), V).float()  # [B, K, V]
    else:
        q_draft = torch.stack([q1.expand(B, V), Q2[x1]], dim=1)  # [B, K, V]
    u_accept, u_sample = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    res = verifier(draft, num_draft, p_target, q_draft, u_accept, u_sample)
    t1 = res.tokens[:, 0]
    fresh = sample_from_probs(P2[t1], torch.rand(B, generator=g))  # next round's first token if needed
    t2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], fresh)
    return t1, t1 * V + t2, p1, p1[:, None] * P2


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
@pytest.mark.parametrize("q_mode", ["far", "close", "equal", "point", "onehot"])
def test_linear_rejection_is_exact(q_mode, params):
    seed = 100 + PARAMS.index(params)
    t1, pair, p1, joint = simulate_linear(q_mode, params, seed)
    assert chi2_pvalue(t1, p1) > PASS
    assert chi2_pvalue(pair, joint) > PASS


@pytest.mark.parametrize("C", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("params", PARAMS[::2], ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
def test_saguaro_draft_is_exact(C, params):
    seed = 200 + PARAMS.index(params)
    t1, pair, p1, joint = simulate_linear("saguaro", params, seed, C=C)
    assert chi2_pvalue(t1, p1) > PASS
    assert chi2_pvalue(pair, joint) > PASS


def test_linear_greedy_temperature_zero():
    t1, pair, p1, joint = simulate_linear("far", (0.0, 0, 1.0), 300)
    assert (t1 == p1.argmax()).all()
    assert (pair == torch.argmax(joint.reshape(-1))).all()


def wrong_verify_greedy_match(draft, num_draft, p_target, q_draft, u_accept, u_sample) -> VerifyResult:
    """NOT lossless: accept iff x_i == argmax p_i, correction/bonus sampled from p (no residual)."""
    B, Kd = draft.shape
    am = p_target.argmax(-1)  # [B, K+1]
    valid = torch.arange(Kd)[None, :] < num_draft[:, None]
    n = torch.cumprod((valid & (draft == am[:, :Kd])).long(), dim=1).sum(1)  # [B]
    last = sample_from_probs(p_target[torch.arange(B), n], u_sample)
    tokens = torch.cat([draft, torch.full((B, 1), -1)], dim=1)
    tokens = torch.where(torch.arange(Kd + 1)[None, :] < n[:, None], tokens, -1)
    tokens.scatter_(1, n[:, None], last[:, None])
    return VerifyResult(n, tokens)


@pytest.mark.parametrize("q_mode", ["close", "equal"])
def test_negative_control_greedy_match_fails(q_mode):
    t1, pair, p1, joint = simulate_linear(q_mode, PARAMS[0], 100, verifier=wrong_verify_greedy_match)
    assert chi2_pvalue(t1, p1) < FAIL
    assert chi2_pvalue(pair, joint) < FAIL


# ----------------------------------------------------------------------------------------------
# trees
# ----------------------------------------------------------------------------------------------

PARENTS = [-1, -1, -1, 0, 0, 1, 3]  # root -> {0, 1, 2}; 0 -> {3, 4}; 1 -> {5}; 3 -> {6}


def depths(parents: list[int]) -> list[int]:
    d: list[int] = []
    for par in parents:
        d.append(1 if par < 0 else d[par] + 1)
    return d


def simulate_tree(mode: str, params, seed: int, n: int = N_TREE, use_q_for_topk: bool = False):
    """Returns (t1, pair index, p1, joint) over n trees.

    mode "iid": siblings drawn i.i.d. from the parent's q (verified with q);
    mode "topk": siblings are the parent's top-m draft tokens (distinct), verified as point masses
    (or, with use_q_for_topk, wrongly with the i.i.d. rule)."""
    _, (p1, P2, P3) = tables(seed, *params)
    _, (q1, Q2, Q3) = tables(seed + 1000, *params, scale=2.5)
    Nn = len(PARENTS)
    dep = depths(PARENTS)
    g = gen(seed + 7)
    # Build all n trees at once (node order: parents before children). toks [n, N]
    toks = torch.zeros(n, Nn, dtype=torch.int64)
    q_nodes = torch.zeros(n, Nn, V)  # draft distribution after each node (for its children)
    p_nodes = torch.zeros(n, Nn, V)  # target distribution after each node
    sibling_rank: dict[int, int] = {}
    for i, par in enumerate(PARENTS):
        q_par = q1.expand(n, V) if par < 0 else q_nodes[:, par]  # [n, V]
        if mode == "iid":
            toks[:, i] = sample_from_probs(q_par, torch.rand(n, generator=g))
        else:  # the (rank)-th most likely draft token: distinct among siblings
            rank = sibling_rank.get(par, 0)
            sibling_rank[par] = rank + 1
            toks[:, i] = torch.sort(q_par, dim=-1, descending=True, stable=True).indices[:, rank]
        q_nodes[:, i] = (Q2 if dep[i] == 1 else Q3)[toks[:, i]]
        p_nodes[:, i] = (P2 if dep[i] == 1 else P3)[toks[:, i]]
    uniforms = torch.rand(n, Nn + 1, generator=g, dtype=torch.float64)
    fresh_u = torch.rand(n, generator=g)
    use_q = mode == "iid" or use_q_for_topk
    t1 = torch.zeros(n, dtype=torch.int64)
    t2 = torch.full((n,), -1, dtype=torch.int64)
    tok_lists = toks.tolist()
    for s in range(n):
        path, nxt = verify_tree_rejection(tok_lists[s], PARENTS, p1, p_nodes[s], q1 if use_q else None,
                                          q_nodes[s] if use_q else None, uniforms[s])
        emitted = [tok_lists[s][i] for i in path] + [nxt]
        t1[s] = emitted[0]
        if len(emitted) >= 2:
            t2[s] = emitted[1]
    fresh = sample_from_probs(P2[t1], fresh_u)  # rows that emitted one token: the next round's token
    t2 = torch.where(t2 < 0, fresh, t2)
    return t1, t1 * V + t2, p1, p1[:, None] * P2


@pytest.mark.parametrize("mode", ["iid", "topk"])
@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[2]], ids=lambda p: f"T{p[0]}-k{p[1]}-p{p[2]}")
def test_tree_rejection_is_exact(mode, params):
    seed = 400 + PARAMS.index(params)
    t1, pair, p1, joint = simulate_tree(mode, params, seed)
    assert chi2_pvalue(t1, p1) > PASS
    assert chi2_pvalue(pair, joint) > PASS


def test_tree_negative_control_iid_rule_on_topk_siblings_fails():
    """Deterministic distinct siblings verified with the i.i.d. rule (the documented misuse) is biased."""
    t1, _, p1, _ = simulate_tree("topk", PARAMS[0], 400, n=1_500, use_q_for_topk=True)
    assert chi2_pvalue(t1, p1) < FAIL


def test_request_uniforms_are_float64():
    """float32 uniforms lie on a 2^-24 grid: inverse-CDF sampling with them rounds every probability to a
    multiple of 2^-24 (in a 152k vocabulary ~3.6e-4 of the mass could never be drawn), and the draft would
    sample from a rounded q rather than the q it ships. Every worker draw goes through `uniforms`."""
    from pathlib import Path

    from ssd.workers.seq_state import make_generator, uniforms

    u = uniforms(make_generator(7, 0), 4096)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert bool((u * 2**24 != torch.floor(u * 2**24)).any())  # not on the float32 grid
    workers = Path(__file__).resolve().parents[1] / "workers"
    drawing = sorted(p.name for p in workers.rglob("*.py") if "torch.rand(" in p.read_text())
    assert drawing == ["seq_state.py"]
