"""Admission: the draft prefills a new request's prompt when it is admitted, beside the target's prefill,
instead of in the first round (where it sat on the critical path)."""

import threading

import pytest
from tiny_models import random_model

from ssd import LLM, SamplingParams
from ssd.workers.draft_worker import DraftWorker
from ssd.workers.messages import SamplingSpec

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
COMMON = dict(dtype="float32", max_batch=2, max_len=128)


@pytest.fixture(scope="module")
def models():
    return random_model(vocab=40, layers=2, seed=3, scale=2.0), random_model(vocab=40, layers=1, seed=4, scale=2.0)


def test_draft_prefills_at_add_and_drafts_its_greedy_continuation(models):
    draft = models[1]
    w = DraftWorker(draft, dtype="float32", max_slots=2, max_len=64)
    w.add(0, PROMPT, SamplingSpec(temperature=0))
    st = w.dseqs[0]
    assert w.runner.kv.lengths[st.slot] == len(PROMPT) - 1 and st.base == len(PROMPT) - 1 and st.todo == [PROMPT[-1]]
    drafts, qs = w.propose([(0, 5)])
    with LLM(target=draft, mode="ar", **COMMON) as llm:
        want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    assert drafts[0].tokens == want and qs == [None]
    with pytest.raises(ValueError, match="empty prompt"):
        w.add(1, [], SamplingSpec(temperature=0))
    assert w.runner.kv.num_free == 1  # the rejected request took no slot


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_target_and_draft_prefill_at_once(models, mode):
    """Each worker's add waits for the other's to start: admission one after the other would time out."""
    target, draft = models
    with LLM(target=target, mode="ar", **COMMON) as llm:
        want = llm.generate([PROMPT], GREEDY)[0].token_ids
    with LLM(target=target, draft=draft, mode=mode, k=3, fanout=8, **COMMON, use_ray=False) as llm:
        both = threading.Barrier(2, timeout=20)
        for worker in (llm.engine.target.worker, llm.engine.mode.draft.worker):
            add = worker.add
            worker.add = lambda *a, add=add: (both.wait(), add(*a))[1]
        got = llm.generate([PROMPT], GREEDY)[0].token_ids
    assert got == want
