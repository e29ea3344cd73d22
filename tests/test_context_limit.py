"""The context length is max_len in every mode, whatever K is: a request with prompt + max_tokens == max_len
runs to the end exactly, one token more is refused with a clear error."""

import pytest
from tiny_models import random_model

from ssd import LLM, SamplingParams

MAX_LEN = 48


@pytest.fixture(scope="module")
def models():
    return random_model(vocab=40, layers=2, seed=3, scale=2.0), random_model(vocab=40, layers=1, seed=4, scale=2.0)


@pytest.mark.parametrize("mode,kw", [("ar", {}), ("sd", {"k": 6}), ("ngram", {"k": 6}), ("ssd", {"k": 6, "fanout": 14}),
                                     ("ssd", {}), ("auto", {})])
def test_prompt_plus_max_tokens_up_to_max_len(models, mode, kw):
    prompts = [[5, 6, 7] * 10, [1], [9, 9]]
    params = [SamplingParams(temperature=0, max_tokens=MAX_LEN - len(p), ignore_eos=True) for p in prompts]
    with LLM(target=models[0], mode="ar", dtype="float32", max_batch=1, max_len=MAX_LEN + 40) as ar:
        want = [ar.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    draft = None if mode in ("ar", "ngram") else models[1]
    with LLM(target=models[0], draft=draft, mode=mode, dtype="float32", max_batch=3, max_len=MAX_LEN,
             use_ray=False, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert all(len(w) == sp.max_tokens for w, sp in zip(want, params))
        with pytest.raises(ValueError, match=f"exceeds the context length {MAX_LEN} "):
            llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=MAX_LEN - 1))
