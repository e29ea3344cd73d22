"""Where the target and draft actors run, and starting them: `place_workers(cfg)`.

CPU machine: each actor gets its own cores. Ray reserves `num_cpus` per actor and the worker pins
itself (`os.sched_setaffinity`) and sizes torch's thread pool to its cores. Default split of the
N cores this process may use: the draft gets the last core, the target the rest (both share the
only core when N == 1). Config.target_cores / draft_cores / *_threads override it.

GPU (cfg.device "cuda..." or cfg.extra["gpu_ids"]): one placement-group bundle {"GPU": 1, "CPU": 1}
per actor, STRICT_PACK unless cfg.extra["placement_strategy"] says otherwise; bundle 0 (the first
GPU) is the target's, the last is the draft's. Inside an actor the device is "cuda": Ray sets
CUDA_VISIBLE_DEVICES to the GPU it was given.

cfg.extra["draft_resource"] (e.g. {"draft_node": 1}) puts the draft wherever that custom Ray
resource is (another node), outside the placement group, unpinned.

OpenMP in CPU actors: libgomp's idle threads spin GOMP_SPINCOUNT times (300,000 by default, ~5 ms here)
after each parallel region before they sleep. Where two actors share cores (SD's draft and target on the
same cores, core loans) that spin ran on the cores the other actor had just started computing on: SD over
Ray ran 1.27-1.40x slower than the same workers in one process. Paired on raw HumanEval (session 21), SD
over Ray at spins of 300,000 / 10,000 / 1,000: 42.9 / 47.7 / 49.8 tok/s; 1,000 / 100 / 0: 54.3 / 53.4 /
50.6; `auto` at 300,000 / 1,000: 43.3 / 54.7. CPU actors get WORKER_SPINCOUNT unless the driver's
environment sets GOMP_SPINCOUNT (passed on as it is) or OMP_WAIT_POLICY.

mode="auto" on CPU (Config.core_loans): the target may also compute on the draft's cores
(`spare_cores`) in rounds where the draft has nothing to do, and the draft on the target's while the
target waits for a just-in-time draft; the coordinator asks per call.

Tensor-parallel target (cfg.extra["target_tp"] = T > 1): T target actors (TPTargetWorker ranks,
launch/tp.py), one placement-group bundle each: {"GPU": 1, "CPU": 1} per rank on GPUs (bundles
0..T-1; the draft's, if any, is bundle T), {"CPU": c} per rank on CPU (the draft stays outside the
group). On CPU the target's cores are split evenly between the ranks (each the same number of
cores and threads, so they round alike); with fewer cores than ranks, the ranks share them, one
thread each.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ssd.config import Config

WORKER_SPINCOUNT = 1_000  # libgomp spins of an idle CPU actor thread before it sleeps (~20 us; see above)


def openmp_env() -> dict[str, str]:
    """Environment variables for a CPU actor's OpenMP runtime (the driver's own settings win)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", str(WORKER_SPINCOUNT))}


@dataclass
class ActorPlan:
    name: str
    num_cpus: float
    num_gpus: float = 0
    resources: dict[str, float] = field(default_factory=dict)
    bundle: int | None = None  # placement-group bundle index
    device: str = "cpu"
    num_threads: int | None = None
    cpu_cores: list[int] | None = None
    spare_cores: list[int] | None = None  # cores it may borrow while their owner idles (the other worker's)


@dataclass
class Plan:
    target: ActorPlan  # the target, or rank 0 of a tensor-parallel target
    draft: ActorPlan | None
    bundles: list[dict[str, float]] = field(default_factory=list)  # empty: no placement group
    strategy: str = "STRICT_PACK"
    targets: list[ActorPlan] = field(default_factory=list)  # one per tensor-parallel rank ([target] if none)

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = [self.target]


def target_tp(cfg: Config) -> int:
    """The target's tensor-parallel degree (cfg.extra["target_tp"], default 1)."""
    tp = cfg.extra.get("target_tp")
    tp = 1 if tp is None else tp
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"target_tp must be an integer >= 1, got {tp!r}")
    return tp


def uses_gpu(cfg: Config) -> bool:
    return str(cfg.device).startswith("cuda") or bool(cfg.extra.get("gpu_ids"))


def wants_draft(cfg: Config) -> bool:
    return cfg.draft is not None and cfg.mode not in ("ar", "ngram")


def plan_placement(cfg: Config, cores: list[int], pin: bool = True) -> Plan:
    """Pure: the actor layout for `cfg` on a driver that may use `cores`.

    pin=False (an existing cluster whose nodes we cannot see) reserves CPUs without pinning unless
    Config names the cores explicitly.
    """
    has_draft = wants_draft(cfg)
    draft_res = dict(cfg.extra.get("draft_resource") or {})
    tp = target_tp(cfg)
    if uses_gpu(cfg):
        # `--gpus 0` with a draft: both on the one GPU, half of it reserved each (two processes share it)
        draft_gpu = cfg.extra.get("draft_gpu")
        gpu = 0.5 if has_draft and tp == 1 and draft_gpu is not None and [draft_gpu] == cfg.extra.get(
            "target_gpus") else 1
        targets = [
            ActorPlan("target" if tp == 1 else f"target{r}", num_cpus=1, num_gpus=gpu, bundle=r, device="cuda",
                      num_threads=cfg.target_threads, cpu_cores=cfg.target_cores)
            for r in range(tp)
        ]
        bundles: list[dict[str, float]] = [{"GPU": gpu, "CPU": 1} for _ in range(tp)]
        draft = None
        if has_draft:
            draft_dev = cfg.draft_device or "cuda"
            draft = ActorPlan(
                "draft", num_cpus=1, num_threads=cfg.draft_threads, cpu_cores=cfg.draft_cores,
                device="cuda" if draft_dev.startswith("cuda") else draft_dev, resources=draft_res,
            )
            if draft.device == "cuda":
                draft.num_gpus = gpu
                if not draft_res:
                    bundles.append({"GPU": gpu, "CPU": 1})
                    draft.bundle = len(bundles) - 1
        return Plan(targets[0], draft, bundles, cfg.extra.get("placement_strategy", "STRICT_PACK"), targets)

    cores = list(cores) or [0]
    if pin:
        cfg.check_cores_exist(cores)
    remote_draft = has_draft and bool(draft_res)
    if has_draft and not remote_draft:
        t_cores = cfg.target_cores or (cores[:-1] if len(cores) > 1 else cores)
        d_cores = cfg.draft_cores or cores[-1:]
        # One side's cores given: the other takes the rest (or shares them when none are left).
        if cfg.target_cores and not cfg.draft_cores:
            d_cores = [c for c in cores if c not in cfg.target_cores] or list(cfg.target_cores)
        elif cfg.draft_cores and not cfg.target_cores:
            t_cores = [c for c in cores if c not in cfg.draft_cores] or list(cfg.draft_cores)
    else:
        t_cores, d_cores = cfg.target_cores or cores, cfg.draft_cores
    # Two actors on one core: reserve half a CPU each so both fit.
    share = has_draft and not remote_draft and len(cores) == 1 and not (cfg.target_cores or cfg.draft_cores)
    # Explicitly overlapping cores (e.g. SD with both actors on all cores; they take turns): split the
    # reservation so the pair never asks Ray for more CPUs than the cores they share.
    overlap = has_draft and not remote_draft and d_cores is not None and bool(set(t_cores) & set(d_cores))

    def reserve(n_cores: int) -> float:
        if share:
            return 0.5
        if overlap:
            return n_cores / 2 if n_cores < 2 else float(n_cores // 2)
        return n_cores

    target = ActorPlan(
        "target", num_cpus=reserve(len(t_cores)),
        num_threads=cfg.target_threads or len(t_cores),
        cpu_cores=t_cores if (pin or cfg.target_cores) else None,
    )
    draft = None
    if has_draft:
        if remote_draft:
            n = cfg.extra.get("draft_cpus", len(cfg.draft_cores or []) or 1)
            draft = ActorPlan("draft", num_cpus=n, resources=draft_res, num_threads=cfg.draft_threads or n,
                              cpu_cores=cfg.draft_cores)
        else:
            assert d_cores is not None
            draft = ActorPlan(
                "draft", num_cpus=reserve(len(d_cores)),
                num_threads=cfg.draft_threads or len(d_cores),
                cpu_cores=d_cores if (pin or cfg.draft_cores) else None,
            )
        if cfg.draft_device and cfg.draft_device.startswith("cuda"):
            draft.device, draft.num_gpus = "cuda", 1
        elif (cfg.core_loans and cfg.mode == "auto" and tp == 1 and target.cpu_cores and draft.cpu_cores
              and not remote_draft and not share and not overlap):
            target.spare_cores, draft.spare_cores = list(draft.cpu_cores), list(target.cpu_cores)
    if tp == 1:
        return Plan(target, draft)
    per = len(t_cores) // tp
    if per:  # an equal share of the target's cores per rank (a remainder stays idle)
        chunks, cpus = [t_cores[r * per : (r + 1) * per] for r in range(tp)], float(reserve(per))
    else:  # fewer cores than ranks: every rank on all of them, one thread each
        chunks, cpus = [list(t_cores)] * tp, target.num_cpus / tp
    targets = [
        ActorPlan(f"target{r}", num_cpus=cpus, bundle=r, num_threads=cfg.target_threads or max(1, per),
                  cpu_cores=chunk if (pin or cfg.target_cores) else None)
        for r, chunk in enumerate(chunks)
    ]
    bundles = [{"CPU": cpus} for _ in range(tp)]
    return Plan(targets[0], draft, bundles, cfg.extra.get("placement_strategy", "STRICT_PACK"), targets)


def init_ray(cfg: Config) -> bool:
    """Connect to cfg.ray_address, or start a local Ray sized to this machine. True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
                                  logging_level="warning")
    if cfg.ray_address:
        check_reachable(cfg.ray_address)
        ray.init(address=cfg.ray_address, **kwargs)
        return True
    gpu_ids = cfg.extra.get("gpu_ids")
    if gpu_ids:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        kwargs["num_gpus"] = len(gpu_ids)
    ray.init(num_cpus=os.cpu_count(), **kwargs)
    return True


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A HOST:PORT cluster address must answer a TCP connect: ray.init would retry an unreachable one for
    minutes without a word. ("auto", "local" and ray:// client addresses are left to Ray.)"""
    if address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):  # [::1]:6379 too
            pass
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot reach the Ray cluster at {address}: {e}") from None


class RayCPUsBusy(RuntimeError):
    """The local Ray has too few free CPUs for this engine's actors: another engine holds them, or it was started
    with fewer CPUs than the actors need."""


def wait_for_cpus(need: float, wait_s: float) -> tuple[float, float]:
    """(free, total) CPUs of the Ray this process is connected to, waiting up to wait_s for `need` of them
    free: a just-closed engine's killed actors give theirs back asynchronously."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= need or time.monotonic() >= deadline:
            return free, ray.cluster_resources().get("CPU", 0.0)
        time.sleep(0.05)


def check_feasible(plan: Plan, cluster: dict[str, float]) -> None:
    """Fail at once where the cluster has not, in all, the resources an actor asks for (Ray would wait for
    them forever): e.g. a draft_resource no node offers, or more GPUs than the cluster has."""
    need: dict[str, float] = {}
    for ap in (*plan.targets, plan.draft):
        if ap is None:
            continue
        for key, amount in (("CPU", ap.num_cpus), ("GPU", ap.num_gpus), *(ap.resources or {}).items()):
            if amount:
                need[key] = need.get(key, 0.0) + float(amount)
    short = {k: v for k, v in need.items() if cluster.get(k, 0.0) + 1e-9 < v}
    if short:
        have = {k: cluster.get(k, 0.0) for k in short}
        raise ValueError(f"the Ray cluster cannot ever hold these actors: they need {short}, it has {have} in all")


def local_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def place_workers(
    cfg: Config, target_kwargs: dict[str, Any] | None = None, draft_kwargs: dict[str, Any] | None = None
) -> tuple[Any, Any | None, dict, Any]:
    """Start the target (and draft) actors; *_kwargs override/extend each worker's constructor kwargs.

    Returns (target_handle, draft_handle | None, target_info, tokenizer); tokenizer is None for a
    model without tokenizer files (tests pass DecoderModel objects).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ssd.launch.actors import RayHandle, actor_class, register_serializers
    from ssd.workers.draft_worker import DraftWorker
    from ssd.workers.target_worker import TargetWorker

    init_ray(cfg)
    register_serializers()
    plan = plan_placement(cfg, local_cores(), pin=not cfg.ray_address)
    if not cfg.ray_address:  # this machine's Ray: its actors would wait forever for CPUs another engine holds
        need = sum(ap.num_cpus for ap in (*plan.targets, plan.draft) if ap is not None)
        total = ray.cluster_resources().get("CPU", 0.0)
        if total + 1e-9 < need:  # not another engine's doing: this Ray was started smaller than the cores
            raise RayCPUsBusy(
                f"this process's Ray has {total:g} CPUs in all and this engine's actors need {need:g} (one per "
                "core they run on): start Ray with more CPUs, or run this engine with use_ray=False")
        free, total = wait_for_cpus(need, cfg.extra.get("ray_cpu_wait_s", 5.0))
        if free < need:
            raise RayCPUsBusy(
                f"Ray has {free:g} of its {total:g} CPUs free and this engine's actors need {need:g}: another "
                "engine in this process holds them; close it first, or run this one with use_ray=False"
            )
    check_feasible(plan, ray.cluster_resources())
    pg = None
    if plan.bundles:
        pg = placement_group(plan.bundles, strategy=plan.strategy)
        timeout = cfg.extra.get("placement_timeout_s", 120)
        if not pg.wait(timeout):
            remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not place {plan.bundles} ({plan.strategy}) within {timeout} s; "
                f"cluster resources: {ray.cluster_resources()}"
            )

    def spawn_fn(cls: type, ap: ActorPlan, model: Any, extra: dict[str, Any] | None) -> Any:
        opts: dict[str, Any] = {"num_cpus": ap.num_cpus, "num_gpus": ap.num_gpus}
        if ap.resources:
            opts["resources"] = ap.resources
        env = openmp_env() if ap.device == "cpu" else {}
        if env:
            opts["runtime_env"] = {"env_vars": env}
        if pg is not None and ap.bundle is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=ap.bundle
            )
        actor_cls = actor_class(cls).options(**opts)
        kwargs = dict(dtype=cfg.dtype, device=ap.device, max_slots=cfg.max_batch, max_len=cfg.max_len,
                      num_threads=ap.num_threads, cpu_cores=ap.cpu_cores, quantization=cfg.quantization,
                      linear_kernel=cfg.linear_kernel, cuda_graphs=cfg.cuda_graphs)
        if ap.spare_cores:
            kwargs["spare_cores"] = ap.spare_cores
        kwargs.update(extra or {})
        return lambda: actor_cls.remote(model, **kwargs)

    handles: list[Any] = []
    try:
        if len(plan.targets) == 1:
            spawn_t = spawn_fn(TargetWorker, plan.target, cfg.target, target_kwargs)
            target = RayHandle(spawn_t(), "target", spawn_t, placement_group=pg, channel=cfg.ray_channel)
        else:  # tensor-parallel ranks (launch/tp.py)
            from ssd.launch.tp import RayTPTargetWorker, start_tp_target

            tp = len(plan.targets)
            tp_kwargs = dict(target_kwargs or {}, tp_size=tp, dist_backend=cfg.extra.get("tp_backend"))
            spawns = [
                spawn_fn(RayTPTargetWorker, ap, cfg.target, dict(tp_kwargs, tp_rank=r))
                for r, ap in enumerate(plan.targets)
            ]
            target = start_tp_target(spawns, "target", placement_group=pg)
        handles.append(target)
        draft = None
        if plan.draft is not None:
            spawn_d = spawn_fn(DraftWorker, plan.draft, cfg.draft, draft_kwargs)
            draft = RayHandle(spawn_d(), "draft", spawn_d, channel=cfg.ray_channel)
            handles.append(draft)
        infos = [f.result() for f in [h.call("info") for h in handles]]
        info = infos[0]
        if draft is not None and infos[1]["vocab_size"] != info["vocab_size"]:
            raise ValueError(
                f"draft vocabulary ({infos[1]['vocab_size']}) differs from the target's "
                f"({info['vocab_size']}); speculative decoding needs a draft with the target's tokenizer"
            )
        tokenizer = target.call("tokenizer_obj").result()
    except BaseException:
        for h in reversed(handles):
            h.shutdown()
        if pg is not None:
            try:
                remove_placement_group(pg)  # a no-op error if the target's handle already removed it
            except Exception:  # noqa: BLE001
                pass
        raise
    return target, draft, info, tokenizer
