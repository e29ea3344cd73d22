"""Build workers, handles, the decoding mode and the engine from a Config."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ssd.autoconfig import (
    K_CHOICES,
    AutoConfig,
    KTuner,
    RankedHits,
    SSDTuner,
    autoconfigure,
    budgets,
    feed_time,
    spec_time,
)
from ssd.autoconfig_cache import autoconfig_key, cached_autoconfigure
from ssd.config import Config
from ssd.engine import Engine
from ssd.fanout import FanoutPlanner
from ssd.handles import LocalHandle, WorkerHandle
from ssd.modes.base import ARMode, Mode
from ssd.modes.sd import NgramMode, SDMode
from ssd.modes.ssd import SSDMode, policy_options
from ssd.workers.draft_worker import LOOKAHEAD_BRANCHES

log = logging.getLogger("ssd")

DEFAULT_K = 4


def make_fanout_planner(cfg: Config, k: int) -> FanoutPlanner:
    """The user's fan-out, or the budget make_mode's auto-configuration chose (SSD never runs without one)."""
    if isinstance(cfg.fanout, list):
        return FanoutPlanner(K=k, B=sum(cfg.fanout), explicit=list(cfg.fanout))
    assert isinstance(cfg.fanout, int), "make_mode auto-configures the budget the user left open"
    return FanoutPlanner(K=k, B=cfg.fanout, kind=cfg.fanout_kind)


def ranked_candidates(cfg: Config) -> bool:
    """Whether greedy rows rank SSD's outcomes (Config.candidates); an explicit fan-out list is a quota."""
    return cfg.candidates == "ranked" and not isinstance(cfg.fanout, list)


def draft_headroom(cfg: Config) -> int:
    """Extra draft KV positions for SSD's tree region: K chain nodes plus B branches of K nodes."""
    k = max(K_CHOICES) if cfg.k is None else cfg.k  # auto-configured later: room for the largest choice
    if isinstance(cfg.fanout, list):
        budget = sum(cfg.fanout)
    elif isinstance(cfg.fanout, int):
        budget = cfg.fanout
    else:  # auto-configured later (whether K is or not): room for the largest budget tried
        budget = max(budgets(k))
    # + lookahead guesses: up to LOOKAHEAD_BRANCHES branches a step (speculate skips them when out of room)
    return (k + 1) * (budget + 1) + k * LOOKAHEAD_BRANCHES * cfg.draft_lookahead


def make_mode(
    cfg: Config, target: WorkerHandle, draft: WorkerHandle | None, vocab_size: int, borrow: bool = False,
    draft_borrow: bool = False,
) -> Mode:
    """The decoding mode for `cfg`; `borrow`: the target can borrow the draft's cores, `draft_borrow`: the
    draft the target's (auto only)."""
    borrow = borrow and cfg.mode == "auto"
    draft_borrow = draft_borrow and cfg.mode == "auto"
    tuner: KTuner | None = None
    ssd_tuner: SSDTuner | None = None
    ac: AutoConfig | None = None
    k_auto = cfg.k is None
    # Measured at start-up unless the user fixed everything there is to choose: K (plain SD), K and the
    # budget (SSD, auto). A user's K alone still gets a budget that fits the speculation inside a verification.
    speculates = cfg.mode in ("ssd", "auto")
    if draft is not None and (k_auto and cfg.mode == "sd" or speculates and (k_auto or cfg.fanout is None)):
        k_choices = K_CHOICES if k_auto else (cfg.k,)
        flags: dict[str, Any] = dict(ssd=cfg.mode != "sd", borrow=borrow, draft_borrow=draft_borrow, busy=borrow)
        if not k_auto:
            flags["k_choices"] = k_choices
        ac = cached_autoconfigure(autoconfig_key(cfg, target, draft, flags), target, draft,
                                  lambda: autoconfigure(target, draft, **flags))
        cfg.k = ac.k
        if cfg.mode == "sd":
            tuner = KTuner(t_verify=ac.t_verify, t_draft1=ac.t_draft1, gated=cfg.draft_gate)
        elif cfg.fanout is None:  # B (and K unless the user's) re-chosen every round; a user's fan-out stays
            ssd_tuner = SSDTuner(t_verify=ac.t_verify, t_chain=ac.t_chain, t_branch=ac.t_draft,
                                 ranked=RankedHits() if ranked_candidates(cfg) else None, k_choices=k_choices)
        if cfg.fanout is None and ac.budget:
            cfg.fanout = ac.budget
    k = cfg.k or DEFAULT_K
    if cfg.mode == "ar" or (cfg.mode == "auto" and draft is None):
        return ARMode(target, k=k, steps=cfg.ar_steps)
    if cfg.mode == "ngram":
        return NgramMode(target, k=k, max_n=cfg.ngram_max)
    assert draft is not None
    if cfg.mode == "sd":
        sd = SDMode(target, draft, k=k, tuner=tuner)
        sd.draft_timeout_s = cfg.draft_timeout_s
        return sd
    mode = SSDMode(
        target, draft, k, make_fanout_planner(cfg, k), backup=cfg.backup,
        allowed=policy_options(cfg.mode, cfg.backup), vocab_size=vocab_size, ngram_max=cfg.ngram_max,
        tuner=ssd_tuner, borrow=borrow, draft_borrow=draft_borrow, gate=cfg.draft_gate and k_auto,
    )
    mode.draft_timeout_s = cfg.draft_timeout_s
    if ac is not None:  # the policy starts from this machine's latencies
        # the speculation of the K and B the mode starts with (a user's K or fan-out, or the tuner's)
        spec = spec_time(ac.t_chain, ac.t_draft, k, mode.planner.B)
        draft_lend = ac.draft_borrow_share or 1.0  # just-in-time drafts run on borrowed cores where they can
        # Where AR, SD and n-gram verify on borrowed cores, the own line prices SSD rounds only, which verify
        # while the draft speculates: seeded from forwards timed alone, it priced them low (session 40, Zen 5).
        mode.cost.seed(ac.t_verify_busy or ac.t_verify, draft_step=ac.t_draft[1] * draft_lend, speculate=spec,
                       feed=feed_time(ac.t_chain))
        mode.cost.draft_lend = draft_lend

        def spec_batch_factor(batch: int, mode: SSDMode = mode, ac: AutoConfig = ac) -> float:
            """A batch's speculation over one sequence's, at the mode's current K and B (start-up timings)."""
            k, b = mode.k, mode.planner.B
            return spec_time(ac.t_chain, ac.t_draft, k, b, batch) / spec_time(ac.t_chain, ac.t_draft, k, b)

        mode.cost.spec_batch_factor = spec_batch_factor
        if ac.t_borrowed is not None:
            mode.cost.enable_borrow(t_borrowed=ac.t_borrowed)
    return mode


def build_engine(cfg: Config) -> tuple[Engine, list[WorkerHandle], Any]:
    from ssd.launch.placement import target_tp

    tp = target_tp(cfg)
    if tp != 1 and cfg.use_ray is False:
        raise ValueError(f"target_tp={tp} runs the target's ranks as Ray actors; it needs use_ray (not False)")
    if cfg.use_ray or tp != 1:  # workers as Ray actors (launch/placement.py); a tensor-parallel target implies Ray
        from ssd.launch.placement import RayCPUsBusy, place_workers

        # Worker kwargs beyond dtype/device/slots/len/threads/cores: keep in step with the local path below.
        common = dict(quantization=cfg.quantization, linear_kernel=cfg.linear_kernel, cuda_graphs=cfg.cuda_graphs)
        draft_kwargs = dict(common, max_len=cfg.max_len + draft_headroom(cfg), saguaro_c=cfg.saguaro_c,
                            quantization=cfg.draft_quantization, draft_vocab=cfg.draft_vocab,
                            ranked=ranked_candidates(cfg), context_vocab=cfg.draft_vocab_context,
                            candidate_vocab=cfg.candidate_vocab, lookahead=cfg.draft_lookahead)
        try:
            rtarget, rdraft, rinfo, rtok = place_workers(cfg, target_kwargs=common, draft_kwargs=draft_kwargs)
        except RayCPUsBusy as e:
            if not (cfg.ray_by_default and tp == 1):
                raise
            # The layout was only the default's choice: the same outputs in this process, without core loans.
            log.warning("%s. Running this engine's workers in this process instead.", e)
            cfg.use_ray = False
        else:
            return _assemble(cfg, rtarget, rdraft, rinfo, rtok, [h for h in (rtarget, rdraft) if h is not None])

    # Each worker's constructor pins the thread that builds it (this one) to its cores; its calls run on its
    # LocalHandle's thread (ModelWorker.own_threads), and this thread gets its own cores back.
    caller_cores, caller_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        target, draft, info, tokenizer, handles = _local_workers(cfg)
    finally:
        os.sched_setaffinity(0, caller_cores)
        torch.set_num_threads(caller_threads)
    return _assemble(cfg, target, draft, info, tokenizer, handles)


def _local_workers(cfg: Config) -> tuple[WorkerHandle, WorkerHandle | None, dict, Any, list[WorkerHandle]]:
    """The workers in this process, each behind a LocalHandle: (target, draft or None, target info, tokenizer,
    handles)."""
    from ssd.launch.placement import local_cores
    from ssd.workers.draft_worker import DraftWorker
    from ssd.workers.target_worker import TargetWorker

    cfg.check_cores_exist(local_cores())
    max_slots = cfg.max_batch
    target_w = TargetWorker(
        cfg.target, dtype=cfg.dtype, device=cfg.device, max_slots=max_slots, max_len=cfg.max_len,
        num_threads=cfg.target_threads, cpu_cores=cfg.target_cores, quantization=cfg.quantization,
        linear_kernel=cfg.linear_kernel, cuda_graphs=cfg.cuda_graphs,
    )
    target: WorkerHandle = LocalHandle(target_w, "target")
    handles: list[WorkerHandle] = [target]
    info = target_w.info()
    draft: WorkerHandle | None = None
    if cfg.draft is not None and cfg.mode not in ("ar", "ngram"):
        draft_w = DraftWorker(
            cfg.draft, dtype=cfg.dtype, device=cfg.draft_device or cfg.device, max_slots=max_slots,
            max_len=cfg.max_len + draft_headroom(cfg), num_threads=cfg.draft_threads, cpu_cores=cfg.draft_cores,
            saguaro_c=cfg.saguaro_c, quantization=cfg.draft_quantization, linear_kernel=cfg.linear_kernel,
            cuda_graphs=cfg.cuda_graphs, draft_vocab=cfg.draft_vocab, ranked=ranked_candidates(cfg),
            context_vocab=cfg.draft_vocab_context, candidate_vocab=cfg.candidate_vocab, lookahead=cfg.draft_lookahead,
        )
        dinfo = draft_w.info()
        if dinfo["vocab_size"] != info["vocab_size"]:
            raise ValueError(
                f"draft vocabulary ({dinfo['vocab_size']}) differs from the target's ({info['vocab_size']}); "
                "speculative decoding needs a draft with the target's tokenizer"
            )
        draft = LocalHandle(draft_w, "draft")
        handles.append(draft)
    return target, draft, info, target_w.tokenizer, handles


def _assemble(
    cfg: Config, target: WorkerHandle, draft: WorkerHandle | None, info: dict, tokenizer: Any,
    handles: list[WorkerHandle],
) -> tuple[Engine, list[WorkerHandle], Any]:
    draft_borrow = draft is not None and bool(draft.call("info").result().get("borrow_threads"))
    mode = make_mode(cfg, target, draft, info["vocab_size"], borrow=bool(info.get("borrow_threads")),
                     draft_borrow=draft_borrow)
    trained = info.get("max_position_embeddings")
    if trained is not None and cfg.max_len > trained:
        log.warning("max_len %d exceeds the target's max_position_embeddings %d: requests may run to positions "
                    "the model was not trained for", cfg.max_len, trained)
    eos = list(info["eos_token_ids"])
    if tokenizer is not None:
        eos = sorted(set(eos) | set(tokenizer.eos_token_ids))
    mode.target_timeout_s = cfg.target_timeout_s
    engine = Engine(
        target, mode, tokenizer=tokenizer, vocab_size=info["vocab_size"], eos_token_ids=eos,
        max_len=cfg.max_len, max_batch=cfg.max_batch,
    )
    return engine, handles, tokenizer
