"""Speculative decoding engine: greedy equality with AR, tau, n-gram, stops, max_tokens, metrics."""

import pytest
from tiny_models import GREEDY, PROMPTS

from ssd import LLM, SamplingParams


@pytest.mark.parametrize("k", [1, 3, 5])
def test_sd_greedy_equals_ar(models, ar_outputs, k):
    with LLM(target=models[0], draft=models[1], mode="sd", k=k, dtype="float32", max_batch=3, max_len=128) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs
        st = llm.stats()
        assert st["rounds"] > 0 and st["drafted_tokens"] > 0


def test_ngram_greedy_equals_ar(models, ar_outputs):
    with LLM(target=models[0], mode="ngram", k=4, dtype="float32", max_batch=4, max_len=128) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_outputs


def test_draft_equal_to_target_accepts_everything(models):
    k = 4
    with LLM(target=models[0], draft=models[0], mode="sd", k=k, dtype="float32", max_batch=2, max_len=128) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5 * (k + 1), ignore_eos=True))[0]
        m = out.metrics
        assert m["rounds"] == 5
        assert m["tau"] == k + 1
        assert m["acceptance_rate"] == 1.0


def test_max_tokens_never_exceeded_and_stop_inside_accepted_run(models, ar_outputs):
    with LLM(target=models[0], draft=models[0], mode="sd", k=6, dtype="float32", max_batch=4, max_len=128) as llm:
        for n in (1, 2, 5, 7, 13):
            out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            assert out.token_ids == ar_outputs[0][:n]
        # a stop id that shows up in the middle of a fully accepted run of k + 1 tokens
        stop = ar_outputs[0][3]
        first = ar_outputs[0].index(stop)
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]))[0]
        assert out.token_ids == ar_outputs[0][: first + 1]
        assert out.finish_reason == "stop"


def test_sd_seeded_sampling_reproducible_in_any_batch(models):
    sp = SamplingParams(temperature=0.9, max_tokens=12, seed=99, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=9, seed=5, ignore_eos=True)
    with LLM(target=models[0], draft=models[1], mode="sd", k=3, dtype="float32", max_batch=4, max_len=128) as llm:
        alone = llm.generate([[1, 2]], sp)[0].token_ids
        batch = llm.generate([[4], [1, 2], [9, 9, 9]], [other, sp, other])
        assert batch[1].token_ids == alone


def test_quantised_draft_under_unquantised_target_is_still_exact(models, ar_outputs):
    """draft_quantization: the draft runs w8a8 (its own weights change), the target stays fp32; greedy
    output is still the target's AR output."""
    with LLM(target=models[0], draft=models[1], mode="sd", k=3, dtype="float32", max_batch=3, max_len=128,
             draft_quantization="w8a8") as llm:
        assert llm.config.quantization is None and llm.config.draft_quantization == "w8a8"
        draft_info = next(h for h in llm._handles if h.name == "draft").call("info").result()
        assert draft_info["linear_kernel"] == "w8a8"
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs
    with pytest.raises(ValueError, match="draft_quantization"):
        LLM(target=models[0], draft=models[1], draft_quantization="int3")
