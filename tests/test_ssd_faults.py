"""SSD keeps serving exactly when the draft worker dies at any point of a round (in-process); a lost target
fails its requests with its error, and the engine serves the next ones on a fresh target."""

from concurrent.futures import Future

import pytest
from tiny_models import random_model

from ssd import LLM, SamplingParams
from ssd.engine import TargetLost
from ssd.handles import LocalHandle, WorkerDied
from ssd.workers.draft_worker import DraftWorker

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 7, 7], [3, 1, 4, 1, 5]]
COMMON = dict(dtype="float32", max_batch=3, max_len=128)


class FailingHandle(LocalHandle):
    """A worker handle that fails from the n-th call of `method` on, until restarted (like RayHandle): it dies
    (WorkerDied), hangs (its calls never answer) or raises an ordinary error. `restartable=False` behaves like
    an in-process worker: nothing can replace it."""

    def __init__(self, make, method: str, fail_at: int, how: str = "dies", name: str = "draft",
                 restartable: bool = True) -> None:
        super().__init__(make(), name)
        self.make, self.method, self.fail_at, self.calls, self.dead, self.how = make, method, fail_at, 0, False, how
        if restartable:
            self.restart = self._restart

    def call(self, method, *args, **kwargs):
        if method == self.method:
            self.calls += 1
            self.dead = self.dead or self.calls == self.fail_at
        if self.dead:
            f = Future()
            if self.how == "dies":
                f.set_exception(WorkerDied(self.name, RuntimeError("killed")))
            elif self.how == "raises":
                f.set_exception(ValueError(f"a bug in the {self.name}"))
            return f  # "hangs": never answered
        return super().call(method, *args, **kwargs)

    def _restart(self):
        self.worker, self.dead = self.make(), False
        return self


def dying_draft(draft, method: str, fail_at: int, how: str = "dies") -> FailingHandle:
    return FailingHandle(lambda: DraftWorker(draft, dtype="float32", max_slots=4, max_len=512), method, fail_at, how)


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
    with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, backup="neural", **COMMON) as llm:
        mode = llm.engine.mode
        dying = dying_draft(draft, method, die_at)
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
    with LLM(target=target, draft=draft, mode=mode_name, k=3, fanout=8, draft_timeout_s=0.3, **kw, **COMMON) as llm:
        mode = llm.engine.mode
        assert mode.draft_timeout_s == 0.3
        mode.draft = dying_draft(draft, method, die_at, how)
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


def _with_failing_target(llm, target_model, **kw) -> FailingHandle:
    from ssd.workers.target_worker import TargetWorker

    h = FailingHandle(lambda: TargetWorker(target_model, dtype="float32", max_slots=3, max_len=128), name="target",
                      **kw)
    llm.engine.target = llm.engine.mode.target = h
    return h


@pytest.mark.parametrize("mode_name,method,fail_at,how", [
    ("ar", "decode", 3, "hangs"), ("sd", "verify", 2, "dies"), ("ssd", "verify", 3, "hangs"),
    ("ssd", "add", 2, "dies"), ("ssd", "add", 1, "hangs"),
])
def test_a_lost_target_fails_its_requests_and_a_fresh_one_serves_the_next(models, ar_outputs, mode_name, method,
                                                                          fail_at, how):
    """A target that dies or leaves a call unanswered past target_timeout_s fails the running requests with
    that error; the next round runs on a fresh target (RayHandle.restart), exactly as before."""
    target, draft = models
    kw = {"draft": draft, "k": 3, "fanout": 8} if mode_name != "ar" else {}
    with LLM(target=target, mode=mode_name, target_timeout_s=0.5, **kw, **COMMON) as llm:
        assert llm.engine.mode.target_timeout_s == 0.5
        h = _with_failing_target(llm, target, method=method, fail_at=fail_at, how=how)
        with pytest.raises(RuntimeError, match="no answer within 0.5 s .target_timeout_s." if how == "hangs"
                           else "killed"):
            llm.generate(PROMPTS, GREEDY)
        assert not llm.engine.has_work and llm.engine.target_down is not None
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        h.shutdown()
    assert outs == ar_outputs  # the fresh target, and a draft that forgot the failed requests
    assert llm.engine.target_restarts == 1 and llm.engine.target_down is None


def test_an_in_process_target_that_hangs_fails_every_request_and_refuses_new_ones(models):
    target, draft = models
    with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, target_timeout_s=0.3, **COMMON) as llm:
        _with_failing_target(llm, target, method="verify", fail_at=2, how="hangs", restartable=False)
        done = llm.engine.make_sequence([1, 2, 3], GREEDY)
        waiting = [llm.engine.make_sequence(p, GREEDY) for p in PROMPTS]  # 3 run, 1 waits for a slot
        for s in [done, *waiting]:
            llm.engine.add(s)
        with pytest.raises(WorkerDied, match="no answer within 0.3 s"):
            while llm.engine.has_work:
                llm.engine.step()
        queued = [s for s in [done, *waiting] if s.error.startswith("the target worker is lost")]
        ran = [s for s in [done, *waiting] if s not in queued]
        assert all("stopped answering: no answer within 0.3 s" in s.error for s in ran)
        assert len(ran) == 3 and len(queued) == 1  # the one still waiting fails at once, not left queued forever
        assert "target worker is lost and cannot be replaced" in queued[0].error
        assert all(s.finish_reason == "error" for s in [done, *waiting]) and not llm.engine.has_work
        assert llm.engine.lost is not None  # refused from now on (the server's /health says so at once)
        with pytest.raises(TargetLost, match="cannot be replaced.*no answer within 0.3 s"):
            llm.engine.step()
        with pytest.raises(TargetLost):
            llm.generate(PROMPTS, GREEDY)  # refused at once, nothing queued
        assert not llm.engine.scheduler.waiting


def test_shutdown_does_not_wait_for_a_target_call_that_never_answered(models):
    import time

    target, _ = models
    llm = LLM(target=target, mode="ar", ar_steps=1, target_timeout_s=0.3, **COMMON)
    worker, calls = llm.engine.target.worker, []
    verify = worker.verify

    def stuck(*args, **kwargs):  # the second call hangs (5 s here; forever in the case this guards)
        calls.append(1)
        if len(calls) == 2:
            time.sleep(5)
        return verify(*args, **kwargs)

    worker.verify = stuck
    with pytest.raises(WorkerDied, match="stopped answering"):
        llm.generate(PROMPTS[:1], GREEDY)
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < 2.0


def test_target_timeout_option_is_checked():
    from ssd.config import Config
    from ssd.launch.cli import config_kwargs, serve_parser

    assert Config(target="t").target_timeout_s is None  # waits forever unless asked
    assert Config(target="t", target_timeout_s=float("inf")).target_timeout_s is None
    for bad in (0, -1, "10", True):
        with pytest.raises(ValueError, match="target_timeout_s must be"):
            Config(target="t", target_timeout_s=bad)
    def kw(*argv):
        return config_kwargs(serve_parser().parse_args(["--target", "qwen-coder-0.5b", *argv]))

    assert kw("--target-timeout", "30")["target_timeout_s"] == 30.0
    assert kw("--target-timeout", "none")["target_timeout_s"] == float("inf")  # Config: None
    assert "target_timeout_s" not in kw()


@pytest.mark.parametrize("mode_name", ["sd", "ssd"])
def test_a_drafts_output_lost_on_its_way_to_the_target_is_a_draft_loss(models, ar_outputs, mode_name):
    """Over Ray, q travels from the draft to the target's verify: if the draft's node dies, the target's call fails
    with the draft's WorkerDied. That is the draft's loss (rounds go on without it, exactly), not the target's."""
    target, draft = models
    kw = {"backup": "neural"} if mode_name == "ssd" else {}
    with LLM(target=target, draft=draft, mode=mode_name, k=3, fanout=8, **kw, **COMMON) as llm:
        h = _with_failing_target(llm, target, method="verify", fail_at=0, how="dies")  # the target never fails
        h.call = _draft_lost_once(h.call)
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        mode = llm.engine.mode
        h.shutdown()
    assert outs == ar_outputs
    assert llm.engine.target_down is None and llm.engine.target_restarts == 0
    assert mode.stats.policy.get("ar_fallback", 0) >= 1 or mode.draft_restarts == 1


def _draft_lost_once(call):
    state = {"n": 0}

    def wrapped(method, *args, **kwargs):
        if method == "verify":
            state["n"] += 1
            if state["n"] == 3:
                f = Future()
                f.set_exception(WorkerDied("draft", RuntimeError("the draft's node died")))
                return f
        return call(method, *args, **kwargs)
    return wrapped


def test_generate_without_raising_lets_waiting_requests_outlive_a_lost_target(models, ar_outputs):
    """generate(raise_errors=False): a target that dies fails the requests it held; those still waiting run on
    the fresh target, and every output comes back."""
    target, _ = models
    params = dict(COMMON, max_batch=1)
    with LLM(target=target, mode="ar", target_timeout_s=5, **params) as llm:
        h = _with_failing_target(llm, target, method="decode", fail_at=2, how="dies")
        outs = llm.generate(PROMPTS, GREEDY, raise_errors=False)
        h.shutdown()
    assert outs[0].finish_reason == "error" and "killed" in outs[0].error  # the one running when it died
    assert [o.token_ids for o in outs[1:]] == ar_outputs[1:] and all(o.error is None for o in outs[1:])
    assert llm.engine.target_restarts == 1


def test_newcomers_behind_a_lost_admission_wait_for_the_fresh_target(models, ar_outputs):
    """The target dies admitting the second of three newcomers: the first (admitted) and the second fail with its
    error; the third never reached it and runs on the fresh target."""
    target, draft = models
    with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, backup="neural", **COMMON) as llm:
        h = _with_failing_target(llm, target, method="add", fail_at=2, how="dies")
        outs = llm.generate(PROMPTS, GREEDY, raise_errors=False)
        h.shutdown()
    assert [o.finish_reason for o in outs[:2]] == ["error", "error"]
    assert outs[2].error is None and outs[2].token_ids == ar_outputs[2]


def test_a_target_lost_once_too_often_is_given_up_at_once(models):
    """Every restart used up: the loss after them makes the engine refuse work right away (health 503), not a
    round later."""
    target, _ = models
    with LLM(target=target, mode="ar", ar_steps=1, **COMMON) as llm:
        h = _with_failing_target(llm, target, method="verify", fail_at=1, how="dies")
        restart = h.restart

        def restart_dead():  # each fresh target dies on its first verify too
            restart()
            h.calls, h.dead = 0, False
            return h

        h.restart = restart_dead
        for loss in range(1, 5):
            with pytest.raises(WorkerDied):
                llm.generate(PROMPTS[:1], GREEDY)
            assert llm.engine.target_restarts == min(loss - 1, 3)
            assert (llm.engine.lost is not None) == (loss == 4), loss
        h.shutdown()
