"""Coordinator-side request state: tokens so far, stop handling, per-request metrics."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ssd.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    first_tokens: int = 0  # tokens delivered with the first (a round may emit several): decode rates start after
    finish_s: float | None = None
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    policy: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round (accepted + 1)."""
        return self.emitted_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        if self.finish_s is None or self.first_token_s is None:
            return 0.0
        dt = self.finish_s - self.arrival_s
        return self.emitted_tokens / dt if dt > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "ttft_s": None if self.first_token_s is None else round(self.first_token_s - self.arrival_s, 4),
            "first_tokens": self.first_tokens,
            "latency_s": None if self.finish_s is None else round(self.finish_s - self.arrival_s, 4),
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "policy": dict(self.policy),
        }


class Sequence:
    def __init__(
        self,
        seq_id: int,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        decode: Callable[[list[int]], str] | None,
        prompt_text: str | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.prompt_text = prompt_text
        self.params = params
        self.output_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics()
        self._decode = decode
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.text = ""
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def stop_ids(self) -> set[int]:
        """Token ids that end this sequence (its stop_token_ids, and eos unless ignore_eos)."""
        return self._stop_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def append(self, tokens: list[int]) -> list[int]:
        """Add emitted tokens, stopping at eos / stop ids / stop strings / max_tokens. Returns what was kept.

        A round may emit several tokens; each stop condition ends the output at the token where one token
        at a time would have ended it, so every mode returns the same tokens and text."""
        start = len(self.output_ids)
        stop_id = False
        for t in tokens:
            if self.remaining <= 0:
                break
            self.output_ids.append(t)
            if t in self._stop_ids:  # like vLLM: the stop token id is kept, its text is not
                stop_id = True
                break
        kept = self.output_ids[start:]
        if kept and self.metrics.first_token_s is None:
            self.metrics.first_token_s = time.perf_counter()
            self.metrics.first_tokens = len(kept)
        self._update_text()
        cut = self._stop_string_cut(start)
        if cut is not None:
            n, self.text = cut
            del self.output_ids[start + n:]
            kept = kept[:n]
            if start == 0:
                self.metrics.first_tokens = n
            self._finish("stop")
        elif stop_id:
            self._finish("stop")
        elif self.remaining <= 0:
            self._finish("length")
        return kept

    def _stop_string_cut(self, start: int) -> tuple[int, str] | None:
        """Where a stop string ends the output, if one appeared in the tokens after `start`: the number of
        those tokens kept (through the one that completed it) and the text cut before it."""
        if not self.params.stop or self._decode is None or _find_stop(self.text, self.params.stop) is None:
            return None
        for n in range(1, len(self.output_ids) - start + 1):  # the first token whose text completes one
            text = self._text_of(self.output_ids[: start + n])
            idx = _find_stop(text, self.params.stop)
            if idx is not None:
                return n, text[:idx]
        raise AssertionError("a stop string in the whole text must appear in some prefix")

    def _update_text(self) -> None:
        if self._decode is not None:
            self.text = self._text_of(self.output_ids)

    def _text_of(self, ids: list[int]) -> str:
        if ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]  # the stop token's text is not part of the output
        return self._decode(ids)

    def fail(self, message: str) -> None:
        self.error = message
        self._finish("error")

    def _finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.metrics.finish_s = time.perf_counter()


def _find_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in `text` (None: none does)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stable_text_len(text: str, stops: list[str]) -> int:
    """How much of a running sequence's text is final: hold back a trailing partial UTF-8 character
    (U+FFFD) and any suffix that could be the start of a stop string (it may yet be cut)."""
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, n), hold, -1):
            if text[:n].endswith(s[:k]):
                hold = k
                break
    return n - hold
