"""SD under sampling reproduces the target's distribution exactly (chi-square on a tiny vocabulary)."""

import pytest
import torch
from exactness import chi_square_pvalue, exact_continuation_probs, sample_continuations
from tiny_models import random_model

import ssd.workers.target_worker as target_worker
from ssd import LLM, SamplingParams
from ssd.kernels.verify import VerifyResult

V = 16
N_SAMPLES = 3000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so the n-gram drafter has matches


@pytest.fixture(scope="module")
def target():
    return random_model(vocab=V, layers=2, seed=11, scale=1.5)


def run_case(target, draft, mode, params, seed, k=3, n=3, prompt=PROMPT):
    # n = 3 tokens: drafts of up to 2 (a round never drafts past max_tokens - 1), so chains and the bonus
    # token after them are verified, not only single-token drafts.
    exact = exact_continuation_probs(target, prompt, n, params)
    with LLM(target=target, draft=draft, mode=mode, k=k, fanout=2 * (k + 1), dtype="float32", max_batch=64,
             max_len=64) as llm:
        samples = sample_continuations(llm, prompt, n, params, N_SAMPLES, seed)
        st = llm.stats()
    return chi_square_pvalue(samples, exact), st


CASES = {
    "draft_model_t1": ("sd", dict(seed=12, scale=1.5), SamplingParams(temperature=1.0)),
    "draft_model_t07": ("sd", dict(seed=13, scale=1.0), SamplingParams(temperature=0.7)),
    "top_k_top_p": ("sd", dict(seed=14, scale=1.5), SamplingParams(temperature=1.2, top_k=6, top_p=0.8)),
    "bad_draft": ("sd", dict(seed=15, scale=-4.0), SamplingParams(temperature=1.0)),
    "ngram_point_mass": ("ngram", None, SamplingParams(temperature=1.0)),
    "ngram_top_p": ("ngram", None, SamplingParams(temperature=0.8, top_p=0.9)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sd_sampling_is_exact(target, case):
    mode, draft_kw, params = CASES[case]
    draft = random_model(vocab=V, layers=1, **draft_kw) if draft_kw else None
    # n-gram: a prompt whose proposal is the target's likeliest token, so drafts are often accepted (on PROMPT
    # the proposal held ~1.5 % of p, 0 under top-p, and a wrong point-mass q went unseen)
    prompt = ngram_prompt_hitting_argmax(target) if mode == "ngram" else PROMPT
    p, st = run_case(target, draft, mode, params, seed=len(case), prompt=prompt)
    assert st["drafted_tokens"] > 0
    assert p > 1e-3, f"{case}: chi-square p-value {p:.2e}"
    if mode == "ngram" or case != "bad_draft":
        assert st["acceptance_rate"] > 0.1, st["acceptance_rate"]  # the verifier's accept path is exercised


def test_draft_equal_to_target_is_exact_and_accepts_everything(target):
    p, st = run_case(target, target, "sd", SamplingParams(temperature=1.0), seed=3)
    assert p > 1e-3
    assert st["acceptance_rate"] > 0.999  # p / q == 1 for every draft token


def test_draft_restricted_to_half_the_vocabulary_is_exact(target):
    """The target itself as the draft, but proposing only tokens 0..7: p / q is no longer 1 everywhere
    (acceptance drops below 1), and the output distribution is still the target's."""
    exact = exact_continuation_probs(target, PROMPT, 2, SamplingParams(temperature=1.0))
    with LLM(target=target, draft=target, mode="sd", k=3, draft_vocab=8, dtype="float32", max_batch=64,
             max_len=64) as llm:
        samples = sample_continuations(llm, PROMPT, 2, SamplingParams(temperature=1.0), N_SAMPLES, 21)
        st = llm.stats()
    assert chi_square_pvalue(samples, exact) > 1e-3
    assert 0.2 < st["acceptance_rate"] < 0.95


def test_restricted_draft_with_its_context_is_exact(target, monkeypatch):
    """Restricted to ids 0..7, the draft also proposes the ids of its prompt (9 and 12 here) and outputs
    (draft_vocab_context): q is still the distribution it sampled from, so the output stays the target's."""
    from ssd.workers.draft_worker import DraftWorker

    proposed: list[int] = []
    propose = DraftWorker._propose

    def spy(self, requests, fanout, stop_below=0.0):
        drafts, qs = propose(self, requests, fanout, stop_below)
        proposed.extend(t for d in drafts for t in d.tokens)
        return drafts, qs

    monkeypatch.setattr(DraftWorker, "_propose", spy)
    prompt = [1, 9, 2, 12, 1, 9, 2]
    params = SamplingParams(temperature=1.0)
    exact = exact_continuation_probs(target, prompt, 2, params)
    with LLM(target=target, draft=target, mode="sd", k=3, draft_vocab=8, dtype="float32", max_batch=64,
             max_len=64, use_ray=False) as llm:
        samples = sample_continuations(llm, prompt, 2, params, N_SAMPLES, 23)
    assert chi_square_pvalue(samples, exact) > 1e-3
    assert sum(t in (9, 12) for t in proposed) > 50  # the context was drafted


def wrong_verify_greedy_match(draft_tokens, num_draft, p_target, q_draft, u_accept, u_sample):
    """NOT lossless: accept a draft token iff it is the target's argmax; sample the correction from p."""
    B, K1, _ = p_target.shape
    num_acc = torch.zeros(B, dtype=torch.long)
    tokens = torch.full((B, K1), -1, dtype=torch.long)
    for b in range(B):
        k = 0
        while k < int(num_draft[b]) and int(draft_tokens[b, k]) == int(torch.argmax(p_target[b, k])):
            tokens[b, k] = draft_tokens[b, k]
            k += 1
        cdf = torch.cumsum(p_target[b, k], 0)
        tokens[b, k] = int(torch.searchsorted(cdf, u_sample[b].reshape(1) * cdf[-1]).clamp(max=cdf.numel() - 1))
        num_acc[b] = k
    return VerifyResult(num_accepted=num_acc, tokens=tokens)


def ngram_prompt_hitting_argmax(target) -> list[int]:
    """A prompt [a, 2, x, a, 2] whose n-gram proposal x is the target's argmax there.

    Greedy matching only distorts the distribution when the proposal is the argmax, so the
    negative control needs such a prompt (found by search, deterministic).
    """
    from ssd.workers.model_runner import ModelRunner

    runner = ModelRunner(target, max_slots=1, max_len=32)
    best, best_p = None, -1.0
    for a in range(V):
        for x in range(V):
            prompt = [a, 2, x, a, 2]
            s = runner.allocate()
            probs = torch.softmax(runner.forward([s], [prompt], last_only=True)[0], -1)
            runner.free(s)
            if int(torch.argmax(probs)) == x and float(probs[x]) > best_p:
                best, best_p = prompt, float(probs[x])
    assert best is not None and best_p < 0.9
    return best


@pytest.mark.parametrize("mode", ["sd", "ngram"])
def test_negative_control_greedy_matching_is_caught(target, monkeypatch, mode):
    monkeypatch.setattr(target_worker, "verify_rejection", wrong_verify_greedy_match)
    draft = random_model(vocab=V, layers=1, seed=12, scale=1.5) if mode == "sd" else None
    prompt = ngram_prompt_hitting_argmax(target) if mode == "ngram" else PROMPT
    p, _ = run_case(target, draft, mode, SamplingParams(temperature=1.0), seed=5, prompt=prompt)
    assert p < 1e-6, f"the test failed to catch a non-lossless verifier (p={p:.2e})"
