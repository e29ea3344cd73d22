"""Exact-distribution check for a decoding engine on a tiny vocabulary.

The target's distribution over every n-token continuation is enumerated exactly, the engine
draws many seeded samples, and a chi-square test compares them. Seeds are fixed, so the test
is deterministic; a non-lossless verifier fails it (see the negative controls).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

from ssd import SamplingParams
from ssd.kernels.sampling import filter_logits
from ssd.workers.model_runner import ModelRunner


def exact_continuation_probs(model, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple, float]:
    """P(t_1..t_n | prompt) under the target with temperature/top-k/top-p applied at each step."""
    V = model.config.vocab_size
    runner = ModelRunner(model, max_slots=1, max_len=64)
    out: dict[tuple, float] = {}

    def dist(ids: list[int]) -> torch.Tensor:
        s = runner.allocate()
        logits = runner.forward([s], [ids], last_only=True)  # [1, V]
        runner.free(s)
        return filter_logits(
            logits, torch.tensor([params.temperature]), torch.tensor([params.top_k]), torch.tensor([params.top_p])
        )[0].double()

    def rec(prefix: tuple, prob: float) -> None:
        if len(prefix) == n:
            out[prefix] = prob
            return
        p = dist(prompt + list(prefix))
        for t in range(V):
            if p[t] > 0:
                rec(prefix + (t,), prob * float(p[t]))

    rec((), 1.0)
    assert abs(sum(out.values()) - 1) < 1e-6
    return out


def sample_continuations(llm, prompt: list[int], n: int, params: SamplingParams, num: int, seed: int) -> list[tuple]:
    plist = [
        SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, max_tokens=n,
            seed=seed * 100_000 + i, ignore_eos=True,
        )
        for i in range(num)
    ]
    outs = llm.generate([prompt] * num, plist)
    return [tuple(o.token_ids) for o in outs]


def chi_square_pvalue(samples: list[tuple], probs: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Pearson chi-square on whole continuations and on each shorter prefix (the first token's marginal, ...):
    a bias concentrated at one position (a wrong q for the first draft token, say) spreads thin over the
    joint's many cells but stands out in its prefix's few. Returns the smallest p-value times the number of
    tests (Bonferroni), so a threshold keeps its meaning."""
    if any(s not in probs for s in samples):
        return 0.0  # a continuation the target gives zero probability: certainly not lossless
    n = len(next(iter(probs)))
    pvalues = []
    for length in range(1, n + 1):
        prefix_probs: dict[tuple, float] = {}
        for key, p in probs.items():
            prefix_probs[key[:length]] = prefix_probs.get(key[:length], 0.0) + p
        pvalues.append(_pearson_pvalue([s[:length] for s in samples], prefix_probs, min_expected))
    return min(1.0, min(pvalues) * len(pvalues))


def _pearson_pvalue(samples: list[tuple], probs: dict[tuple, float], min_expected: float) -> float:
    """Pearson chi-square; cells with small expected counts are pooled into one."""
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    N = len(samples)
    obs, exp = [], []
    pool_o, pool_e = 0.0, 0.0
    for key, p in sorted(probs.items(), key=lambda kv: -kv[1]):
        e = p * N
        if e >= min_expected:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            pool_o += counts.get(key, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs_a, exp_a = np.array(obs, dtype=float), np.array(exp, dtype=float)
    exp_a *= obs_a.sum() / exp_a.sum()
    return float(stats.chisquare(obs_a, exp_a).pvalue)


def all_sequences(V: int, n: int) -> list[tuple]:
    return list(itertools.product(range(V), repeat=n))


def token_rank_pvalue(model, events: list[tuple[list[int], list[int]]], params: SamplingParams,
                      min_expected: float = 5.0) -> tuple[float, int]:
    """Tokens that must each follow the target's distribution given everything before them, where their
    continuations are too many to enumerate: each event (prefix, tokens) says tokens[j] ~ p(. | prefix +
    tokens[:j]). Each token is recorded by its rank under that p (most likely first); a Pearson chi-square
    compares the rank counts with the sum of the ranked probabilities. Returns (p-value, tokens tested)."""
    V = model.config.vocab_size
    runner = ModelRunner(model, max_slots=1, max_len=256)
    expected, observed, m = np.zeros(V), np.zeros(V), 0
    temp, top_k, top_p = (torch.tensor([x]) for x in (params.temperature, params.top_k, params.top_p))
    for prefix, toks in events:
        s = runner.allocate()
        logits = runner.forward([s], [prefix + toks])[0]  # [len(prefix) + len(toks), V]
        runner.free(s)
        for j, tok in enumerate(toks):
            p = filter_logits(logits[len(prefix) - 1 + j][None], temp, top_k, top_p)[0].double()  # [V]
            order = torch.sort(p, descending=True, stable=True).indices
            expected += p[order].numpy()
            observed[int((order == tok).nonzero())] += 1
            m += 1
    keep = expected >= min_expected
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue), m
