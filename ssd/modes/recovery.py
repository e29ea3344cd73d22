"""Modes that use a draft worker, and what they do when it dies.

If the draft worker dies, stops answering (a call past `draft_timeout_s`) or fails a call, rounds
fall back to plain decoding (still exact, no request lost) while the handle's `restart()`
(RayHandle: a fresh actor in place of the old one, which it kills) runs once in the background;
the fresh draft gets every running sequence re-added with prompt + output so far, then drafting
resumes. A draft's output never decides a token by itself, so no failure of it can make one wrong.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from ssd.handles import WorkerDied, WorkerFuture, WorkerHandle
from ssd.modes.base import Mode, spec_of
from ssd.sequence import Sequence
from ssd.workers.messages import Draft, Outcome

log = logging.getLogger("ssd")


class DraftBackedMode(Mode):
    max_draft_restarts = 3
    draft_timeout_s: float | None = 60.0  # a draft call still running after this counts as a hung draft

    def draft_result(self, fut: WorkerFuture) -> Any:
        """The result of a draft call. Any failure, or no result within draft_timeout_s, is the draft's loss
        (WorkerDied): the target's rounds go on without it."""
        try:
            return fut.result(timeout=self.draft_timeout_s)
        except WorkerDied:
            raise
        except TimeoutError as e:
            raise WorkerDied(self.draft.name, TimeoutError(f"no answer within {self.draft_timeout_s} s")) from e
        except Exception as e:  # noqa: BLE001 - a draft's error must not fail the requests
            raise WorkerDied(self.draft.name, e) from e

    def __init__(self, target: WorkerHandle, draft: WorkerHandle, k: int = 4) -> None:
        super().__init__(target, k)
        self.draft = draft
        self.seqs: dict[int, Sequence] = {}  # the sequences the draft must know
        self.draft_down: WorkerDied | None = None  # set while the draft is lost
        self.draft_restarts = 0
        self._restart: Future | None = None

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        if self.draft_down is None:
            try:
                self.draft_result(self.draft.call("add", seq.seq_id, seq.prompt_ids, spec_of(seq)))
            except WorkerDied as e:
                self._draft_lost(e)

    def remove(self, seq: Sequence) -> None:
        self.seqs.pop(seq.seq_id, None)
        if self.draft_down is None:
            self.draft.call("remove", seq.seq_id)

    # -- draft failure ----------------------------------------------------------------------------
    def _ar_round(self, seqs: list[Sequence]) -> list[Outcome]:
        drafts = [Draft(seq_id=s.seq_id) for s in seqs]
        outcomes = self._verify(drafts)
        self._record(seqs, drafts, outcomes, "ar_fallback")
        return outcomes

    def _draft_lost(self, err: WorkerDied) -> None:
        log.warning("draft worker lost (%s); decoding without a draft", err)
        self.draft_down = err
        restart = getattr(self.draft, "restart", None)
        if restart is None or self._restart is not None or self.draft_restarts >= self.max_draft_restarts:
            return
        self.draft_restarts += 1
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(restart())
            except BaseException as e:  # noqa: BLE001 - reported by _draft_back
                fut.set_exception(e)

        self._restart = fut
        threading.Thread(target=run, name="draft-restart", daemon=True).start()

    def _draft_back(self) -> bool:
        """True once a restarted draft is up and knows every running sequence."""
        fut = self._restart
        if fut is None or not fut.done():
            return False
        self._restart = None
        if fut.exception() is not None:
            log.warning("draft restart failed (%s); staying without a draft", fut.exception())
            return False
        try:
            pending = [
                self.draft.call("add", s.seq_id, s.prompt_ids + s.output_ids, spec_of(s))
                for s in self.seqs.values()
            ]
            for f in pending:
                self.draft_result(f)
        except WorkerDied as e:
            self._draft_lost(e)
            return False
        log.warning("draft worker restarted; speculative decoding resumed")
        self.draft_down = None
        return True
