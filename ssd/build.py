"""Build workers, handles, the decoding mode and the engine from a Config."""

from __future__ import annotations

import logging
from typing import Any

from ssd.config import Config
from ssd.engine import Engine
from ssd.handles import LocalHandle, WorkerHandle
from ssd.modes.base import ARMode, Mode
from ssd.modes.sd import NgramMode, SDMode

log = logging.getLogger("ssd")

DEFAULT_K = 4


def make_mode(cfg: Config, target: WorkerHandle, draft: WorkerHandle | None) -> Mode:
    k = cfg.k or DEFAULT_K
    if cfg.mode == "ar":
        return ARMode(target, k=k)
    if cfg.mode == "ngram":
        return NgramMode(target, k=k, max_n=cfg.ngram_max)
    if cfg.mode == "sd" or (cfg.mode == "auto" and draft is not None):
        assert draft is not None
        return SDMode(target, draft, k=k)
    if cfg.mode == "auto":
        return ARMode(target, k=k)
    raise ValueError(f"mode {cfg.mode!r} is not available")


def build_engine(cfg: Config) -> tuple[Engine, list[WorkerHandle], Any]:
    from ssd.workers.draft_worker import DraftWorker
    from ssd.workers.target_worker import TargetWorker

    max_slots = cfg.max_batch
    target_w = TargetWorker(
        cfg.target, dtype=cfg.dtype, device=cfg.device, max_slots=max_slots, max_len=cfg.max_len,
        num_threads=cfg.target_threads, cpu_cores=cfg.target_cores,
    )
    target: WorkerHandle = LocalHandle(target_w, "target")
    handles: list[WorkerHandle] = [target]
    info = target_w.info()
    draft: WorkerHandle | None = None
    if cfg.draft is not None and cfg.mode not in ("ar", "ngram"):
        draft_w = DraftWorker(
            cfg.draft, dtype=cfg.dtype, device=cfg.draft_device or cfg.device, max_slots=max_slots,
            max_len=cfg.max_len, num_threads=cfg.draft_threads, cpu_cores=cfg.draft_cores,
        )
        dinfo = draft_w.info()
        if dinfo["vocab_size"] != info["vocab_size"]:
            raise ValueError(
                f"draft vocabulary ({dinfo['vocab_size']}) differs from the target's ({info['vocab_size']}); "
                "speculative decoding needs a draft with the target's tokenizer"
            )
        draft = LocalHandle(draft_w, "draft")
        handles.append(draft)
    mode = make_mode(cfg, target, draft)
    tokenizer = target_w.tokenizer
    eos = list(info["eos_token_ids"])
    if tokenizer is not None:
        eos = sorted(set(eos) | set(tokenizer.eos_token_ids))
    engine = Engine(
        target, mode, tokenizer=tokenizer, vocab_size=info["vocab_size"], eos_token_ids=eos,
        max_len=cfg.max_len, max_batch=cfg.max_batch,
    )
    return engine, handles, tokenizer
