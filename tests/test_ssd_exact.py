"""SSD under sampling reproduces the target's distribution exactly: every backup, Saguaro C, fan-outs."""

import pytest
import torch
from exactness import chi_square_pvalue, exact_continuation_probs, sample_continuations
from test_sd_exact import ngram_prompt_hitting_argmax, wrong_verify_greedy_match
from tiny_models import random_model

import ssd.workers.target_worker as target_worker
from ssd import LLM, SamplingParams

V = 16
N_SAMPLES = 3000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def target():
    return random_model(vocab=V, layers=2, seed=11, scale=1.5)


@pytest.fixture(scope="module")
def draft():
    return random_model(vocab=V, layers=1, seed=12, scale=1.5)


def run_case(target, draft, params, seed, n=3, prompt=PROMPT, num=N_SAMPLES, mode="ssd", **kw):
    exact = exact_continuation_probs(target, prompt, n, params)
    with LLM(target=target, draft=draft, mode=mode,
             dtype="float32", max_batch=64, max_len=96, **kw, use_ray=False) as llm:
        samples = sample_continuations(llm, prompt, n, params, num, seed)
        st = llm.stats()
    return chi_square_pvalue(samples, exact, min_expected=10), st


CASES = {
    "neural_c1": (dict(k=2, fanout=6, backup="neural", saguaro_c=1.0), SamplingParams(temperature=1.0)),
    "neural_c05": (dict(k=2, fanout=6, backup="neural", saguaro_c=0.5), SamplingParams(temperature=1.0)),
    "neural_c0_t07": (dict(k=2, fanout=6, backup="neural", saguaro_c=0.0), SamplingParams(temperature=0.7)),
    "ngram_c03_topk_topp": (
        dict(k=2, fanout=6, backup="ngram", saguaro_c=0.3), SamplingParams(temperature=1.2, top_k=8, top_p=0.9)
    ),
    "random_backup": (dict(k=2, fanout=6, backup="random", saguaro_c=0.5), SamplingParams(temperature=1.0)),
    # the batch-size-aware choice between the neural and the fast backup, per round
    "auto_backup": (dict(k=2, fanout=6, backup="auto", saguaro_c=0.5), SamplingParams(temperature=1.0)),
    "uniform_fanout": (dict(k=2, backup="neural", fanout_kind="uniform", fanout=6), SamplingParams(temperature=1.0)),
    # The draft proposes only tokens 0..7 (q = 0 for the rest): verification uses that q, so still exact.
    "restricted_draft_vocab": (
        dict(k=2, fanout=6, backup="neural", saguaro_c=0.5, draft_vocab=8), SamplingParams(temperature=1.0)
    ),
    # the draft restricted to ids 0..7 but proposing the prompt's 9 and 12 too (draft_vocab_context)
    "restricted_draft_vocab_context": (
        dict(k=2, fanout=6, backup="neural", draft_vocab=8, prompt=[1, 9, 2, 12, 1, 9, 2]),
        SamplingParams(temperature=1.0),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ssd_sampling_is_exact(target, draft, case):
    kw, params = CASES[case]
    p, st = run_case(target, draft, params, seed=len(case), **kw)
    assert sum(st["cache_hits_per_k"].values()) > 100, st  # hits and misses both exercised
    assert sum(st["cache_misses_per_k"].values()) > 100, st
    if kw.get("backup") == "auto":  # rounds with each backup
        assert st["policy"].get("ssd_neural", 0) > 0 and st["policy"].get("ssd_fast", 0) > 0, st["policy"]
    assert p > 1e-3, f"{case}: chi-square p-value {p:.2e}"


def test_ssd_with_k_and_budget_retuned_every_round_is_exact(target, draft):
    """No K or fan-out given: SSDTuner re-chooses both every round (budgets down to one branch)."""
    params = SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, PROMPT, 3, params)
    with LLM(target=target, draft=draft, mode="ssd", backup="neural", saguaro_c=0.5, dtype="float32",
             max_batch=64, max_len=96) as llm:
        tuner = llm.engine.mode.tuner
        assert tuner is not None
        samples = sample_continuations(llm, PROMPT, 3, params, N_SAMPLES, 17)
        assert tuner.successes + tuner.failures > 0
        assert tuner.ranked is not None and tuner.ranked.exposure == 0  # sampled rows take quotas, never ranked
        assert not tuner.requests  # per-request estimates go with their requests
    p = chi_square_pvalue(samples, exact, min_expected=10)
    assert p > 1e-3, f"chi-square p-value {p:.2e}"


@pytest.mark.parametrize("ngram_speculates", [False, True])
def test_auto_switching_through_every_option_is_exact(target, draft, monkeypatch, ngram_speculates):
    """mode="auto" with the choice forced to change every round, n-gram SD included (as plain n-gram SD,
    and as SSD rounds where the draft speculates on the n-gram drafts): still exact."""
    from test_ssd_engine import cycle_policy, force_ngram_speculation

    cycle_policy(monkeypatch, ["ssd_neural", "ngram", "ssd_fast", "sd", "ar", "ngram"])
    asked = force_ngram_speculation(monkeypatch, ngram_speculates)
    p, st = run_case(target, draft, SamplingParams(temperature=1.0), seed=9, mode="auto", k=2, fanout=6, saguaro_c=0.5)
    assert all(st["policy"].get(o, 0) > 10 for o in ("ssd_neural", "ssd_fast", "sd", "ngram", "ar")), st["policy"]
    assert len(asked) >= st["policy"]["ngram"]
    assert p > 1e-3, f"chi-square p-value {p:.2e}"


def test_saguaro_sampling_raises_hit_rate(target, draft):
    """Lower C pushes the residual onto the cached candidates (paper 3b): hit rate goes up."""
    rates = []
    for c in (1.0, 0.0):
        _, st = run_case(
            target, draft, SamplingParams(temperature=1.0), seed=1, num=1000, k=2, fanout=6, backup="neural",
            saguaro_c=c,
        )
        rates.append(st["cache_hit_rate"])
    assert rates[1] > rates[0] + 0.02, rates


def greedy_match_on_point_mass_rows(draft_tokens, num_draft, p_target, q_draft, u_accept, u_sample):
    """The paper code's miss path: rows drafted by a fast backup (point-mass q) are accepted by greedy
    matching, which is NOT lossless at temperature > 0; other rows are verified correctly."""
    from ssd.kernels.verify import verify_rejection

    res = verify_rejection(draft_tokens, num_draft, p_target, q_draft, u_accept, u_sample)
    point = (q_draft.amax(-1) == 1.0).all(-1) & (num_draft > 0)  # [B]
    if bool(point.any()):
        wrong = wrong_verify_greedy_match(draft_tokens, num_draft, p_target, q_draft, u_accept, u_sample)
        res.num_accepted = torch.where(point, wrong.num_accepted, res.num_accepted)
        res.tokens = torch.where(point[:, None], wrong.tokens, res.tokens)
    return res


def test_negative_control_lossy_miss_path_is_caught(target, monkeypatch):
    monkeypatch.setattr(target_worker, "verify_rejection", greedy_match_on_point_mass_rows)
    # A bad draft and a tiny fan-out make misses common; the prompt makes the n-gram backup
    # propose the target's argmax, where greedy matching distorts the distribution.
    draft = random_model(vocab=V, layers=1, seed=15, scale=-4.0)
    prompt = ngram_prompt_hitting_argmax(target)
    p, st = run_case(
        target, draft, SamplingParams(temperature=1.0), seed=9, n=2, prompt=prompt, k=2, backup="ngram", fanout=3
    )
    assert sum(st["cache_misses_per_k"].values()) > 100
    assert p < 1e-6, f"the test failed to catch a lossy miss path (p={p:.2e})"


def test_negative_control_shipped_q_unlike_the_sampled_one_is_caught(target, draft, monkeypatch):
    """A subtler fault than greedy matching: the draft samples from its Saguaro q but ships a slightly
    different one (as a verifier fed q at another C would see). The prefix chi-squares must catch it."""
    from ssd.workers.draft_worker import DraftWorker

    sample = DraftWorker._sample

    def skewed(self, logits, states, fanout, cols=None):
        tokens, probs = sample(self, logits, states, fanout, cols)
        if probs is not None:
            probs = probs**1.3
            probs = probs / probs.sum(-1, keepdim=True)
        return tokens, probs

    monkeypatch.setattr(DraftWorker, "_sample", skewed)
    p, _ = run_case(target, draft, SamplingParams(temperature=1.0), seed=len("neural_c05"), k=2, fanout=6,
                    backup="neural", saguaro_c=0.5)
    assert p < 1e-3, f"the test failed to catch a q unlike the sampled one (p={p:.2e})"


def hit_round_events(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(context, tokens) of every SSD round that verified a draft from the outcome cache (not a request's
    first, just-in-time draft): the tokens it emitted, each of which must follow p given what precedes it."""
    import ssd.modes.ssd as ssd_mode

    events: list[tuple[list[int], list[int]]] = []
    ssd_round = ssd_mode.SSDMode._ssd_round

    def spy(self, seqs, drafts, q_draft, sources, neural):
        outcomes = ssd_round(self, seqs, drafts, q_draft, sources, neural)
        for s, d, src, o in zip(seqs, drafts, sources, outcomes):
            if src == "primary" and d.tokens and s.output_ids:
                events.append((s.prompt_ids + s.output_ids, list(o.tokens[: s.remaining])))
        return outcomes

    monkeypatch.setattr(ssd_mode.SSDMode, "_ssd_round", spy)
    return events


def run_hit_rounds(target, monkeypatch, saguaro_c: float) -> tuple[float, int, int]:
    """Long enough requests (8 tokens, K = 3) that cache hits carry drafts of up to 3 tokens, each sampled from
    its own branch's q; draft == target so most rounds hit. Returns (p-value, tokens tested, tokens after a
    hit draft's first)."""
    from exactness import token_rank_pvalue

    events = hit_round_events(monkeypatch)
    params = SamplingParams(temperature=1.0)
    with LLM(target=target, draft=target, mode="ssd", k=3, fanout=8, backup="neural", saguaro_c=saguaro_c,
             dtype="float32", max_batch=64, max_len=96, use_ray=False) as llm:
        sample_continuations(llm, PROMPT, 8, params, 1500, seed=7)
    p, m = token_rank_pvalue(target, events, params)
    return p, m, sum(max(0, len(t) - 1) for _, t in events)


@pytest.mark.parametrize("saguaro_c", [0.0, 0.5])
def test_multi_token_cache_hit_drafts_are_exact(target, monkeypatch, saguaro_c):
    """Every token of a cache hit's draft was sampled from its branch's q at its own depth: the tokens those
    rounds emit follow p token by token (the enumerated tests' 3-token requests leave hits 1 token at most)."""
    p, tested, later = run_hit_rounds(target, monkeypatch, saguaro_c)
    assert tested > 3000 and later > 1500, (tested, later)
    assert p > 1e-3, p


def test_negative_control_a_hit_draft_shipped_with_its_first_q_is_caught(target, monkeypatch):
    """The same check catches a speculation that ships every token of a branch with the first token's q."""
    import ssd.workers.draft_worker as draft_worker

    stack_q = draft_worker.stack_q
    monkeypatch.setattr(draft_worker, "stack_q", lambda rows, V: stack_q([rows[0]] * len(rows) if rows else rows, V))
    p, _, later = run_hit_rounds(target, monkeypatch, 0.0)  # C = 0: each depth's q far from the first's
    assert later > 1500 and p < 1e-6, (p, later)
