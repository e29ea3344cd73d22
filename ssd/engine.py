"""Engine: admits requests, runs one decoding round per step over the running batch, retires them."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from typing import Any

from ssd.handles import WorkerDied, WorkerHandle
from ssd.modes.base import Mode, spec_of
from ssd.sampling_params import SamplingParams
from ssd.scheduler import Scheduler
from ssd.sequence import Sequence, Status

log = logging.getLogger("ssd")


class TargetLost(RuntimeError):
    """The target worker died or stopped answering, and this engine cannot replace it."""


class Engine:
    def __init__(
        self,
        target: WorkerHandle,
        mode: Mode,
        *,
        tokenizer: Any | None,
        vocab_size: int,
        eos_token_ids: list[int],
        max_len: int,
        max_batch: int,
    ) -> None:
        self.target = target
        self.mode = mode
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_len = max_len
        self.scheduler = Scheduler(max_batch)
        self._ids = itertools.count()
        self.lock = threading.Lock()  # the server steps the engine from one thread, adds from another
        self.totals = {"requests": 0, "drafted_tokens": 0, "accepted_tokens": 0, "emitted_tokens": 0}
        self.busy_s = 0.0  # wall time spent inside step()
        # A target that died or stopped answering (its requests failed with the error): replaced (a Ray actor's
        # handle restarts it) before the next round; where it cannot be, the engine refuses work with TargetLost.
        self.target_down: WorkerDied | None = None
        self.target_restarts = 0
        self.lost: TargetLost | None = None

    # -- requests ----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer files; pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return ids

    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        if self.lost is not None:
            raise self.lost
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        # Prompt and output fit the target's cache: every draft stops one token short of max_tokens (a round
        # emits at most its draft + 1), so no verification writes past it, whatever K is (the tuner moves it).
        if len(ids) + params.max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_len} of this engine"
            )
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        if params.stop and decode is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        return Sequence(next(self._ids), ids, params, self.eos_token_ids, decode,
                        prompt if isinstance(prompt, str) else None)

    def add(self, seq: Sequence) -> None:
        with self.lock:
            self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        with self.lock:
            held = seq in self.scheduler.running  # admitted: the workers hold its state (finished or not)
            self.scheduler.remove(seq)
            if not seq.finished:
                seq.status = Status.FINISHED
                seq.finish_reason = "abort"
            if held:
                self._release(seq)

    # -- the loop ----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One round: admit, speculate + verify, append tokens, retire finished. Returns new tokens."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.busy_s += time.perf_counter() - t0

    def _step(self) -> list[tuple[Sequence, list[int]]]:
        with self.lock:
            if self.target_down is not None:
                self._replace_target()
            newcomers = self.scheduler.admit()
            for i, seq in enumerate(newcomers):
                try:
                    self._admit(seq)
                except Exception as e:  # fail this request only; the other newcomers go on
                    log.exception("admitting request %d failed", seq.seq_id)
                    if isinstance(e, WorkerDied):  # the target's (a draft's stays in the mode): the rest wait
                        self.scheduler.requeue(newcomers[i + 1:])
                        self._note_target_loss(e)
                        break
                    self.scheduler.remove(seq)
                    seq.fail(f"{type(e).__name__}: {e}")
                    self._forget_on_target(seq)
                    self.mode.remove(seq)
            if self.target_down is not None:  # lost while admitting
                raise self.target_down
            running = list(self.scheduler.running)
            if not running:
                return []
            try:
                outcomes = self.mode.round(running)
            except WorkerDied as e:
                lost_draft = getattr(self.mode, "_draft_lost", None)
                if e.name == self.target.name or lost_draft is None:
                    self._note_target_loss(e)
                    raise
                # A draft's output lost on its way to the target (its node died): the target never scored
                # anything, so the round runs again without the draft, as after any draft loss.
                lost_draft(e)
                outcomes = self.mode.round(running)
            emitted = []
            for seq, o in zip(running, outcomes):
                kept = seq.append(o.tokens)
                if len(kept) < len(o.tokens):
                    self.mode.tokens_cut(seq, len(o.tokens) - len(kept))
                seq.metrics.emitted_tokens += len(kept)
                self.totals["emitted_tokens"] += len(kept)
                emitted.append((seq, kept))
            for seq in self.scheduler.retire():
                self._release(seq)
            return emitted

    def _admit(self, seq: Sequence) -> None:
        """Prefill on the target and (through the mode) on the draft at once: each on its own device.
        Where the target may borrow the draft's cores, it prefills the rest of the prompt on both once
        the draft's prefill is done."""
        ids = seq.prompt_ids
        cut = self.mode.prefill_cut(len(ids))
        added = self.target.call("add", seq.seq_id, ids if cut is None else ids[:cut], spec_of(seq))
        t0 = time.perf_counter()
        try:
            self.mode.add(seq)
            draft_s = time.perf_counter() - t0
        finally:
            self.mode.target_result(added)  # the target's error, if any, wins: it fails the request either way
        if cut is not None:
            t0 = time.perf_counter()
            self.mode.target_result(self.target.call("extend", seq.seq_id, ids[cut:], True))
            self.mode.observe_prefill(len(ids), cut, draft_s, time.perf_counter() - t0)

    # -- a lost target -----------------------------------------------------------------------
    max_target_restarts = 3

    def _note_target_loss(self, e: WorkerDied) -> None:
        """The target's WorkerDied (a draft's loss stays inside the mode): every running request fails with it,
        whoever added it (its KV went with the target)."""
        if self.target_down is None:
            log.error("target worker lost (%s); its running requests fail", e)
            self.target_down = e
        for seq in list(self.scheduler.running):
            self.scheduler.remove(seq)
            seq.fail(f"{type(e).__name__}: {e}")
            self._release(seq)
        restart = getattr(self.target, "restart", None)
        if restart is None or self.target_restarts >= self.max_target_restarts:
            self._give_up("cannot be replaced" if restart is None else "was replaced too often", e)

    def _give_up(self, how: str, err: BaseException) -> None:
        """No fresh target: every waiting request fails, and the engine refuses new ones (server: 503)."""
        self.lost = TargetLost(f"the target worker is lost and {how} ({err}); start a new engine")
        for seq in list(self.scheduler.waiting):
            self.scheduler.remove(seq)
            seq.fail(str(self.lost))

    def _replace_target(self) -> None:
        """Before a round after the target was lost: a fresh target (empty: its requests already failed); where
        that fails, the engine gives up (`_give_up`). A loss with no restart left gave up already."""
        if self.lost is not None:
            raise self.lost
        self.target_restarts += 1
        log.warning("starting a fresh target worker (restart %d of %d)", self.target_restarts,
                    self.max_target_restarts)
        try:
            self.target.restart()  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - reported as the reason the engine stops serving
            self._give_up("could not be replaced", WorkerDied(self.target.name, e))
            raise self.lost from e  # type: ignore[misc]
        self.target_down = None

    def _forget_on_target(self, seq: Sequence) -> None:
        if self.target_down is None:  # a lost target's state is gone with it
            self.target.call("remove", seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        self._forget_on_target(seq)
        self.mode.remove(seq)
        self.totals["requests"] += 1
        self.totals["drafted_tokens"] += seq.metrics.drafted_tokens
        self.totals["accepted_tokens"] += seq.metrics.accepted_tokens

    def stats_dict(self) -> dict:
        """Aggregated over finished requests (tokens) and all rounds (mode statistics)."""
        st = self.mode.stats
        t = self.totals
        hits, misses = sum(st.hits_per_k.values()), sum(st.misses_per_k.values())
        return {
            "mode": self.mode.name,
            "k": self.mode.k,
            **t,
            "rounds": st.rounds,
            "sequence_rounds": st.sequence_rounds,
            "acceptance_rate": t["accepted_tokens"] / t["drafted_tokens"] if t["drafted_tokens"] else 0.0,
            # tokens per round of one sequence (RequestMetrics' tau), not per batch round
            "tau": t["emitted_tokens"] / st.sequence_rounds if st.sequence_rounds else 0.0,
            "tokens_per_s": t["emitted_tokens"] / self.busy_s if self.busy_s else 0.0,
            "draft_s": st.draft_s,
            "ssd_wait_s": dict(st.ssd_wait),  # SSD rounds' part of draft_s, split (RoundStats.ssd_wait)
            "verify_s": st.verify_s,
            "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
            "cache_hits_per_k": dict(sorted(st.hits_per_k.items())),
            "cache_misses_per_k": dict(sorted(st.misses_per_k.items())),
            "cache_by_source": _hits_and_misses(st.by_source),
            "cache_by_budget": _hits_and_misses(st.by_budget),
            "policy": dict(st.policy),
            "verify_price_error": {w: st.price_error[w] / n for w, n in st.priced.items()},
        }


def _hits_and_misses(counts: Counter) -> dict:
    """(key, hit) -> rounds as {key: {"hits": ..., "misses": ...}}, keys sorted."""
    keys = sorted({key for key, _ in counts})
    return {key: {"hits": counts[key, True], "misses": counts[key, False]} for key in keys}
