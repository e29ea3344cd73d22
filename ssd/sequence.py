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
        """Add emitted tokens, stopping at eos / stop ids / stop strings / max_tokens. Returns what was kept."""
        kept: list[int] = []
        for t in tokens:
            if self.remaining <= 0:
                break
            if t in self._stop_ids:
                self.output_ids.append(t)  # like vLLM: the stop token id is kept, its text is not
                kept.append(t)
                self._finish("stop")
                break
            self.output_ids.append(t)
            kept.append(t)
        if kept and self.metrics.first_token_s is None:
            self.metrics.first_token_s = time.perf_counter()
        self._update_text()
        if not self.finished and self.params.stop and self._decode is not None:
            for s in self.params.stop:
                idx = self.text.find(s)
                if idx >= 0:
                    self.text = self.text[:idx]
                    self._finish("stop")
                    break
        if not self.finished and self.remaining <= 0:
            self._finish("length")
        return kept

    def _update_text(self) -> None:
        if self._decode is None:
            return
        ids = self.output_ids
        if ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]  # the stop token's text is not part of the output
        self.text = self._decode(ids)

    def fail(self, message: str) -> None:
        self.error = message
        self._finish("error")

    def _finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.metrics.finish_s = time.perf_counter()
