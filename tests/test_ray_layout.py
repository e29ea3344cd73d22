"""Workers as Ray actors: same tokens as in-process, placement, draft death, multi-node draft."""

import logging
import os
import time
from concurrent.futures import Future

import pytest
from local_ray import start_ray
from tiny_models import random_model

from ssd import LLM, SamplingParams
from ssd.config import Config
from ssd.handles import LocalHandle, WorkerDied
from ssd.launch.actors import RayHandle, actor_class, register_serializers
from ssd.launch.placement import WORKER_SPINCOUNT, check_feasible, openmp_env, plan_placement

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, max_tokens=16, seed=7, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6], [20]]
COMMON = dict(dtype="float32", max_batch=4, max_len=256)


@pytest.fixture(scope="module")
def models():
    target = random_model(vocab=40, layers=2, seed=3, scale=2.0)
    return target, random_model(vocab=40, layers=1, seed=4, scale=2.0)


@pytest.fixture(scope="module")
def local_outputs(models):
    """In-process (LocalHandle) reference outputs."""
    target, draft = models
    with LLM(target=target, mode="ar", **COMMON) as llm:
        ar = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(target=target, draft=draft, mode="sd", k=3, **COMMON) as llm:
        sampled = [o.token_ids for o in llm.generate(PROMPTS, SAMPLED)]
    return {"ar": ar, "sd_sampled": sampled}


# -- placement plans (no Ray) --------------------------------------------------------------------


def test_cpu_plan_draft_gets_one_core():
    cfg = Config(target="t", draft="d", mode="sd")
    p = plan_placement(cfg, [0, 1, 2, 3, 4, 5, 6, 7])
    assert (p.target.cpu_cores, p.target.num_threads, p.target.num_cpus) == ([0, 1, 2, 3, 4, 5, 6], 7, 7)
    assert (p.draft.cpu_cores, p.draft.num_threads, p.draft.num_cpus) == ([7], 1, 1)
    assert not p.bundles
    one = plan_placement(cfg, [3])
    assert one.target.cpu_cores == one.draft.cpu_cores == [3] and one.target.num_cpus == 0.5
    ar = plan_placement(Config(target="t", mode="ar"), [0, 1])
    assert ar.draft is None and ar.target.cpu_cores == [0, 1]
    cfg = Config(target="t", draft="d", mode="sd", target_cores=[0], draft_cores=[2, 3], draft_threads=1)
    p = plan_placement(cfg, [0, 1, 2, 3], pin=False)
    assert (p.target.cpu_cores, p.draft.cpu_cores) == ([0], [2, 3])
    assert (p.draft.num_threads, p.draft.num_cpus) == (1, 2)
    on_node = {"draft_resource": {"draft_node": 1}}
    remote = plan_placement(Config(target="t", draft="d", mode="sd", extra=on_node), [0, 1])
    assert remote.target.cpu_cores == [0, 1] and remote.draft.resources == {"draft_node": 1}
    assert remote.draft.cpu_cores is None
    check_feasible(remote, {"CPU": 3.0, "draft_node": 1.0})  # the draft's node brings its own CPU
    with pytest.raises(ValueError, match=r"cannot ever hold.*draft_node"):  # Ray would wait forever
        check_feasible(remote, {"CPU": 3.0})


def test_cpu_plan_one_side_named_the_other_takes_the_rest():
    sd = dict(target="t", draft="d", mode="sd")
    p = plan_placement(Config(**sd, draft_cores=[0]), [0, 1, 2, 3])
    assert (p.target.cpu_cores, p.draft.cpu_cores) == ([1, 2, 3], [0])
    p = plan_placement(Config(**sd, target_cores=[3]), [0, 1, 2, 3])
    assert (p.target.cpu_cores, p.draft.cpu_cores) == ([3], [0, 1, 2])
    p = plan_placement(Config(**sd, target_cores=[0, 1]), [0, 1])  # none left: they share, half each
    assert p.target.cpu_cores == p.draft.cpu_cores == [0, 1] and p.target.num_cpus + p.draft.num_cpus == 2
    with pytest.raises(ValueError, match=r"target_cores: cores \[4, 5\] are not among"):
        plan_placement(Config(**sd, target_cores=[0, 4, 5]), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="draft_cores must be a non-empty list"):
        Config(**sd, draft_cores=[])


def test_an_unreachable_cluster_address_fails_fast():
    import socket

    from ssd.launch.placement import check_reachable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=5)
    check_reachable("auto")  # left to Ray


def test_gpu_plan_one_bundle_per_actor():
    p = plan_placement(Config(target="t", draft="d", mode="sd", device="cuda"), [0, 1])
    assert p.bundles == [{"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}] and p.strategy == "STRICT_PACK"
    assert (p.target.bundle, p.draft.bundle, p.target.device, p.draft.device) == (0, 1, "cuda", "cuda")
    spread = Config(target="t", draft="d", mode="sd", device="cuda", extra={"placement_strategy": "PACK"})
    assert plan_placement(spread, [0]).strategy == "PACK"
    one_gpu = {"gpu_ids": [0], "target_tp": 1, "target_gpus": [0], "draft_gpu": 0}  # the CLI's `--gpus 0`
    shared = plan_placement(Config(target="t", draft="d", mode="sd", device="cuda:0", draft_device="cuda:0",
                                   extra=one_gpu), [0, 1])
    assert shared.bundles == [{"GPU": 0.5, "CPU": 1}, {"GPU": 0.5, "CPU": 1}]  # fits the one GPU Ray is given
    assert shared.target.num_gpus == shared.draft.num_gpus == 0.5
    on_node = {"draft_resource": {"draft_node": 1}}
    remote = plan_placement(Config(target="t", draft="d", mode="sd", device="cuda", extra=on_node), [0])
    assert len(remote.bundles) == 1 and remote.draft.bundle is None and remote.draft.num_gpus == 1


# -- handles and the draft-failure fallback, in process (no Ray) --------------------------------


def test_local_handle_split_and_future_args():
    class W:
        def pair(self, x):
            return x, x * 10

        def add(self, a, b=0):
            return a + b

        def boom(self):
            raise KeyError("boom")

    h1, h2 = LocalHandle(W(), "a"), LocalHandle(W(), "b")
    try:
        f1, f2 = h1.call_split("pair", 2, 3)
        assert h2.call("add", f1, b=f2).result() == 33
        bad = h1.call_split("boom", 2)
        with pytest.raises(KeyError):
            bad[1].result()
        with pytest.raises(KeyError):  # a failed input fails the call that consumes it
            h2.call("add", bad[0]).result()
    finally:
        h1.shutdown()
        h2.shutdown()


class FlakyDraft(LocalHandle):
    """A draft handle that 'dies' on its n-th propose and can be restarted (like RayHandle)."""

    def __init__(self, make, die_at: int) -> None:
        super().__init__(make(), "draft")
        self.make, self.die_at, self.proposes, self.dead = make, die_at, 0, False

    def _dead_future(self):
        f = Future()
        f.set_exception(WorkerDied("draft", RuntimeError("killed")))
        return f

    def call(self, method, *args, **kwargs):
        return self._dead_future() if self.dead else super().call(method, *args, **kwargs)

    def call_split(self, method, n, *args, **kwargs):
        if method == "propose":
            self.proposes += 1
            self.dead = self.dead or self.proposes == self.die_at
        if self.dead:
            return [self._dead_future() for _ in range(n)]
        return super().call_split(method, n, *args, **kwargs)

    def restart(self):
        self.worker, self.dead = self.make(), False
        return self


def test_sd_survives_draft_death_in_process(models, local_outputs):
    from ssd.workers.draft_worker import DraftWorker

    target, draft = models
    with LLM(target=target, draft=draft, mode="sd", k=3, **COMMON) as llm:
        mode = llm.engine.mode
        flaky = FlakyDraft(lambda: DraftWorker(draft, dtype="float32", max_slots=4, max_len=512), die_at=3)
        mode.draft = flaky
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        policy = dict(mode.stats.policy)
    assert outs == local_outputs["ar"]
    assert mode.draft_restarts == 1 and policy["ar_fallback"] >= 1
    assert policy["sd"] > 2  # two rounds before the death, and more after the restart
    assert flaky.proposes > 3


# -- local Ray -----------------------------------------------------------------------------------


def test_openmp_env_keeps_the_drivers_settings(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert openmp_env() == {"GOMP_SPINCOUNT": str(WORKER_SPINCOUNT)}
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert openmp_env() == {"GOMP_SPINCOUNT": "300000"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user's policy decides the spin itself
    assert openmp_env() == {}


@pytest.fixture(scope="class")
def ray_local():
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
class TestLocalRay:
    def test_outputs_equal_in_process(self, models, local_outputs):
        target, draft = models
        with LLM(target=target, mode="ar", use_ray=True, **COMMON) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == local_outputs["ar"]
        with LLM(target=target, draft=draft, mode="sd", k=3, use_ray=True, ray_channel=False, **COMMON) as llm:
            assert not any(h.via_channel for h in llm._handles)
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == local_outputs["ar"]
            # seeded sampling: the q tensors cross the object store bit-exactly
            assert [o.token_ids for o in llm.generate(PROMPTS, SAMPLED)] == local_outputs["sd_sampled"]
        with LLM(target=target, draft=draft, mode="sd", k=3, use_ray=True, **COMMON) as llm:
            assert all(h.via_channel for h in llm._handles)  # the default on one node
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == local_outputs["ar"]
            # seeded sampling: the q tensors cross the channel bit-exactly
            assert [o.token_ids for o in llm.generate(PROMPTS, SAMPLED)] == local_outputs["sd_sampled"]
            assert llm.stats()["policy"] == {"sd": llm.stats()["rounds"]}
            infos = [h.call("info").result() for h in llm._handles]
        expected = plan_placement(llm.config, sorted(os.sched_getaffinity(0)))
        for info, ap in zip(infos, (expected.target, expected.draft), strict=True):
            assert info["pid"] != os.getpid()
            assert info["num_threads"] == ap.num_threads
            assert info["cpu_affinity"] == ap.cpu_cores
            # idle OpenMP threads sleep soon instead of spinning on cores the other actor computes on
            assert info["gomp_spincount"] == os.environ.get("GOMP_SPINCOUNT", str(WORKER_SPINCOUNT))
        assert infos[0]["pid"] != infos[1]["pid"]

    def test_default_layout_for_auto_and_ssd(self, models, local_outputs):
        """Without use_ray, ssd/auto with a draft on CPU run as Ray actors over the channel, and give the
        in-process engine's greedy tokens and seeded samples (mode ssd: its rounds do not depend on timing)."""
        target, draft = models
        with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, use_ray=False, **COMMON) as llm:
            want = [o.token_ids for o in llm.generate(PROMPTS, SAMPLED)]
        with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, **COMMON) as llm:
            assert llm.config.use_ray and all(h.via_channel for h in llm._handles)
            assert [o.token_ids for o in llm.generate(PROMPTS, SAMPLED)] == want
        with LLM(target=target, draft=draft, **COMMON) as llm:  # mode auto
            assert llm.config.use_ray and all(h.via_channel for h in llm._handles)
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == local_outputs["ar"]

    def test_an_engine_beside_one_that_holds_rays_cpus(self, models, local_outputs, caplog):
        """A first engine holds Ray's CPUs: a second one whose layout was the default's choice runs in this
        process (a warning, the same tokens); one that asked for Ray gets a clear error, not an endless wait for
        CPUs. Once the first closes, the next engine gets Ray again."""
        target, draft = models
        quick = {"ray_cpu_wait_s": 0.5}
        with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, **COMMON) as first:
            assert first.config.use_ray
            with caplog.at_level(logging.WARNING, logger="ssd"):
                with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, extra=quick, **COMMON) as second:
                    assert not second.config.use_ray and not any(isinstance(h, RayHandle) for h in second._handles)
                    assert [o.token_ids for o in second.generate(PROMPTS, GREEDY)] == local_outputs["ar"]
            assert "another engine in this process holds them" in caplog.text
            with pytest.raises(RuntimeError, match="CPUs free"):
                LLM(target=target, draft=draft, mode="sd", k=3, use_ray=True, extra=quick, **COMMON)
            assert [o.token_ids for o in first.generate(PROMPTS, GREEDY)] == local_outputs["ar"]
        with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, **COMMON) as third:  # the CPUs come back
            assert third.config.use_ray and all(isinstance(h, RayHandle) for h in third._handles)

    def test_messages_cross_as_msgpack(self):
        """Typed messages travel as their msgpack bytes, not pickled: what msgpack refuses, the call refuses."""
        import numpy as np

        from ssd.workers.messages import Draft, Outcome

        class Echo:
            def info(self) -> dict:
                return {}

            def echo(self, x):
                return x

        register_serializers()
        unused = RayHandle(actor_class(Echo).remote(), "echo", channel=True)
        path = ray.get(unused._channel_path, timeout=60)
        assert os.path.exists(path)
        unused.shutdown()  # never called: its socket's directory goes with it
        assert not os.path.exists(os.path.dirname(path))
        for channel in (False, True):
            handle = RayHandle(actor_class(Echo).remote(), "echo", channel=channel)
            try:
                assert handle.via_channel == channel
                msgs = [Draft(seq_id=1, tokens=[5, 6], q_kind="dist"),
                        Outcome(seq_id=1, num_accepted=1, tokens=[5, 9])]
                assert handle.call("echo", msgs).result(timeout=60) == msgs
                with pytest.raises(TypeError, match="msgpack wire"):  # a pickle would have carried it
                    handle.call("echo", Draft(seq_id=2, tokens=[np.int64(3)])).result(timeout=60)
            finally:
                handle.shutdown()

    def test_channel_that_cannot_connect_leaves_rays_calls(self, monkeypatch, caplog):
        from ssd.launch import actors

        class Echo:
            def info(self) -> dict:
                return {}

            def echo(self, x):
                return x

        def refuse(path, name):
            raise FileNotFoundError(path)

        monkeypatch.setattr(actors, "ChannelClient", refuse)
        actors.register_serializers()
        handle = actors.RayHandle(actors.actor_class(Echo).remote(), "echo", channel=True)
        try:
            with caplog.at_level("WARNING", logger="ssd"):
                assert handle.call("echo", [1, 2]).result(timeout=60) == [1, 2]
            assert not handle.via_channel and "using Ray's calls" in caplog.text
        finally:
            handle.shutdown()

    def test_handle_errors_and_restart(self, models):
        from ssd.launch.placement import place_workers

        cfg = Config(target=models[1], mode="ar", dtype="float32", max_batch=2, max_len=64)
        target, draft, info, tok = place_workers(cfg)
        try:
            assert draft is None and tok is None and info["vocab_size"] == 40
            assert target.alive() and target.via_channel
            with pytest.raises(ValueError, match="empty prompt"):  # worker exceptions keep their type
                target.call("add", 0, [], None).result()
            ray.kill(target.actor)
            deadline = time.monotonic() + 60
            with pytest.raises(WorkerDied) as e:
                while time.monotonic() < deadline:  # the kill is asynchronous: a call may still be served
                    target.call("info").result(timeout=60)
            assert e.value.name == "target"
            assert not target.alive(timeout=2)
            target.restart()
            assert target.alive() and target.call("num_free_slots").result() == 2
            assert target.via_channel  # the fresh actor serves a fresh channel
        finally:
            target.shutdown()

    @pytest.mark.parametrize("mode_name", ["sd", "ssd"])
    def test_draft_killed_mid_generation(self, models, local_outputs, mode_name):
        target, draft = models
        with LLM(target=target, draft=draft, mode=mode_name, k=3, fanout=8, use_ray=True, **COMMON) as llm:
            eng, mode = llm.engine, llm.engine.mode
            params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            seqs = _started(eng, params, rounds=3)
            ray.kill(mode.draft.actor)
            for _ in range(5):  # the kill is asynchronous; the next draft call or the one after fails
                eng.step()
                if mode.draft_down is not None:
                    break
            assert mode.draft_down is not None and mode.stats.policy.get("ar_fallback", 0) <= 1
            deadline = time.monotonic() + 120
            while mode._restart is not None and not mode._restart.done() and time.monotonic() < deadline:
                time.sleep(0.2)
            def drafted_rounds() -> int:
                return sum(v for k, v in mode.stats.policy.items() if k != "ar_fallback")

            sd_before = drafted_rounds()
            while any(not s.finished for s in seqs):
                eng.step()
            assert mode.draft_down is None and mode.draft_restarts == 1
            assert drafted_rounds() > sd_before  # drafting resumed on the fresh actor
            assert mode.draft.alive()
            # a request added after the restart works too
            late = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
        with LLM(target=target, mode="ar", **COMMON) as ref:
            ar60 = [o.token_ids for o in ref.generate(PROMPTS, params)]
        assert [s.output_ids for s in seqs] == ar60
        assert all(s.finish_reason == "length" for s in seqs)
        assert late == local_outputs["ar"][0]

    def test_target_killed_mid_generation(self, models, local_outputs):
        """The target's actor dies: its running requests fail with that error (their KV went with it); the
        engine starts a fresh target actor and serves the next requests exactly."""
        target, draft = models
        with LLM(target=target, draft=draft, mode="ssd", k=3, fanout=8, use_ray=True, **COMMON) as llm:
            eng = llm.engine
            seqs = _started(eng, GREEDY, rounds=2)
            ray.kill(eng.target.actor)
            with pytest.raises(WorkerDied, match="target"):
                for _ in range(20):  # the kill is asynchronous: a call may still be served
                    eng.step()
            assert eng.target_down is not None
            llm._abort_unfinished(seqs)
            outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
            assert eng.target_restarts == 1 and eng.target_down is None and eng.target.alive()
        assert outs == local_outputs["ar"]


def _started(eng, params: SamplingParams, rounds: int) -> list:
    """PROMPTS added to the engine and `rounds` rounds run: the sequences, still running."""
    seqs = [eng.make_sequence(p, params) for p in PROMPTS]
    for s in seqs:
        eng.add(s)
    for _ in range(rounds):
        eng.step()
    return seqs


# -- two Ray nodes ---------------------------------------------------------------------------------


@pytest.mark.ray
def test_draft_on_second_node(models, local_outputs):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"draft_node": 1})
        start_ray(address=cluster.address, log_to_driver=False)
        target, draft = models
        with LLM(target=target, draft=draft, mode="sd", k=3, use_ray=True,
                 extra={"draft_resource": {"draft_node": 1}}, **COMMON) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == local_outputs["ar"]
            t_info, d_info = (h.call("info").result() for h in llm._handles)
            # the channel is a Unix socket: only the target on the driver's node uses it
            assert [h.via_channel for h in llm._handles] == [True, False]
        assert t_info["node_id"] != d_info["node_id"]
        draft_nodes = [n["NodeID"] for n in ray.nodes() if n["Resources"].get("draft_node")]
        assert d_info["node_id"] in draft_nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
