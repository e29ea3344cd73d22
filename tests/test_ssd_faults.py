"""SSD keeps serving exactly when the draft worker dies at any point of a round (in-process)."""

from concurrent.futures import Future

import pytest
from tiny_models import random_model

from ssd import LLM, SamplingParams
from ssd.handles import LocalHandle, WorkerDied
from ssd.workers.draft_worker import DraftWorker

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 7, 7], [3, 1, 4, 1, 5]]
COMMON = dict(dtype="float32", max_batch=3, max_len=128)


class DyingDraft(LocalHandle):
    """A draft handle that fails from the n-th call of `method` on, until restarted (like RayHandle): it dies
    (WorkerDied), hangs (its calls never answer) or raises an ordinary error."""

    def __init__(self, make, method: str, die_at: int, how: str = "dies") -> None:
        super().__init__(make(), "draft")
        self.make, self.method, self.die_at, self.calls, self.dead, self.how = make, method, die_at, 0, False, how

    def call(self, method, *args, **kwargs):
        if method == self.method:
            self.calls += 1
            self.dead = self.dead or self.calls == self.die_at
        if self.dead:
            f = Future()
            if self.how == "dies":
                f.set_exception(WorkerDied("draft", RuntimeError("killed")))
            elif self.how == "raises":
                f.set_exception(ValueError("a bug in the draft"))
            return f  # "hangs": never answered
        return super().call(method, *args, **kwargs)

    def restart(self):
        self.worker, self.dead = self.make(), False
        return self


@pytest.fixture(scope="module")
def models():
    return random_model(vocab=40, layers=2, seed=3, scale=2.0), random_model(vocab=40, layers=1, seed=4, scale=2.0)


@pytest.fixture(scope="module")
def ar_outputs(models):
    with LLM(target=models[0], mode="ar", **COMMON) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method,die_at", [("speculate", 2), ("resolve", 3), ("propose", 1)])
def test_ssd_survives_draft_death(models, ar_outputs, method, die_at):
    target, draft = models
    with LLM(target=target, draft=draft, mode="ssd", k=3, backup="neural", **COMMON) as llm:
        mode = llm.engine.mode
        dying = DyingDraft(lambda: DraftWorker(draft, dtype="float32", max_slots=4, max_len=512), method, die_at)
        mode.draft = dying
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        policy = dict(mode.stats.policy)
    assert outs == ar_outputs  # no request lost, no wrong token
    assert mode.draft_restarts == 1
    assert policy.get("ar_fallback", 0) >= 1 or method != "propose"
    assert policy.get("ssd_neural", 0) >= 2  # SSD rounds before the death and after the restart


@pytest.mark.parametrize("how", ["hangs", "raises"])
@pytest.mark.parametrize("mode_name,method,die_at", [("ssd", "speculate", 2), ("ssd", "resolve", 3),
                                                     ("sd", "propose", 2)])
def test_a_hung_or_failing_draft_is_replaced(models, ar_outputs, how, mode_name, method, die_at):
    """A draft that stops answering (past draft_timeout_s) or raises counts as lost: the rounds go on without
    it, exactly, and a fresh draft takes over."""
    target, draft = models
    kw = {"backup": "neural"} if mode_name == "ssd" else {}
    with LLM(target=target, draft=draft, mode=mode_name, k=3, draft_timeout_s=0.3, **kw, **COMMON) as llm:
        mode = llm.engine.mode
        assert mode.draft_timeout_s == 0.3
        mode.draft = DyingDraft(lambda: DraftWorker(draft, dtype="float32", max_slots=4, max_len=512), method,
                                die_at, how)
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        policy = dict(mode.stats.policy)
    assert outs == ar_outputs  # no request lost, no wrong token
    assert mode.draft_restarts == 1 and mode.draft_down is None
    assert sum(v for k, v in policy.items() if k != "ar_fallback") >= 2  # drafting before and after


def test_draft_timeout_option_is_checked():
    from ssd.config import Config

    for bad in (0, -1, float("nan"), "60", True):
        with pytest.raises(ValueError, match="draft_timeout_s"):
            Config(target="t", draft="d", draft_timeout_s=bad)
    assert Config(target="t", draft="d", draft_timeout_s=None).draft_timeout_s is None
    # infinity means no timeout: a future's wait cannot take it (every call would count as a lost draft)
    assert Config(target="t", draft="d", draft_timeout_s=float("inf")).draft_timeout_s is None
    with pytest.raises(ValueError, match="at most"):
        Config(target="t", draft="d", draft_timeout_s=1e12)
