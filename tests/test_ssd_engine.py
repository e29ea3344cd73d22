"""SSD (Saguaro): greedy equality with AR for every backup, hits, tau, fan-out, outcome cache."""

import pytest
from tiny_models import GREEDY, PROMPTS

from ssd import LLM, SamplingParams


@pytest.mark.parametrize("backup", ["neural", "ngram", "random", "auto"])
@pytest.mark.parametrize("k", [1, 4])
def test_ssd_greedy_equals_ar(models, ar_outputs, backup, k):
    with LLM(
        target=models[0], draft=models[1], mode="ssd", k=k, backup=backup, dtype="float32", max_batch=3, max_len=128
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        st = llm.stats()
        assert st["cache_hits_per_k"] or st["cache_misses_per_k"]


def test_ssd_auto_mode_greedy_equals_ar(models, ar_outputs):
    with LLM(target=models[0], draft=models[1], dtype="float32", max_batch=4, max_len=128) as llm:
        assert llm.config.mode == "auto"
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        assert sum(llm.stats()["policy"].values()) == llm.stats()["rounds"]


def cycle_policy(monkeypatch, order):
    """Force mode="auto"'s per-round choice through `order`, round after round."""
    import itertools

    import ssd.modes.ssd as ssd_mode

    it = itertools.cycle(order)
    monkeypatch.setattr(ssd_mode, "choose", lambda cost, batch, k, allowed: (next(it), dict.fromkeys(allowed, 1.0)))


def test_auto_switching_through_every_option_greedy_equals_ar(models, ar_outputs, monkeypatch):
    """Every option of the policy, n-gram SD included, and every switch between them keeps greedy == AR."""
    cycle_policy(monkeypatch, ["ssd_neural", "ngram", "ssd_fast", "sd", "ngram", "ar", "ssd_neural", "sd"])
    with LLM(target=models[0], draft=models[1], mode="auto", k=3, dtype="float32", max_batch=4, max_len=128) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        policy = llm.stats()["policy"]
    assert all(policy.get(o, 0) > 0 for o in ("ssd_neural", "ssd_fast", "sd", "ngram", "ar")), policy


def test_draft_equal_to_target_hits_every_round(models):
    k = 4
    with LLM(
        target=models[0], draft=models[0], mode="ssd", k=k, backup="neural", dtype="float32", max_batch=2,
        max_len=160,
    ) as llm:
        n_rounds = 6
        sp = SamplingParams(temperature=0, max_tokens=n_rounds * (k + 1), ignore_eos=True)
        out = llm.generate([[5, 6, 7]], sp)[0]
        m = out.metrics
        assert m["rounds"] == n_rounds
        assert m["tau"] == k + 1
        # every outcome was predicted (k = K, t* = bonus): rounds 2.. came from the outcome cache
        assert m["cache_misses"] == 0 and m["cache_hits"] == n_rounds
        assert set(llm.stats()["cache_hits_per_k"]) == {k}


def test_ssd_seeded_sampling_reproducible_in_any_batch(models):
    sp = SamplingParams(temperature=0.9, max_tokens=12, seed=99, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=9, seed=5, ignore_eos=True)
    with LLM(
        target=models[0], draft=models[1], mode="ssd", k=3, backup="neural", dtype="float32", max_batch=4,
        max_len=128,
    ) as llm:
        alone = llm.generate([[1, 2]], sp)[0].token_ids
        batch = llm.generate([[4], [1, 2], [9, 9, 9]], [other, sp, other])
        assert batch[1].token_ids == alone


@pytest.mark.parametrize("fanout", [[1, 1, 1, 1, 1], 12])
def test_ssd_explicit_and_budget_fanout(models, ar_outputs, fanout):
    with LLM(
        target=models[0], draft=models[1], mode="ssd", k=4, fanout=fanout, backup="ngram", dtype="float32",
        max_batch=4, max_len=160,
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
