"""Per-request sampling settings, validated up front so bad values never reach torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this, temperature sampling is greedy (as vLLM's 1e-5): logits / t would overflow float32.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1


def is_int(x: object) -> bool:
    """An int that is not a bool (True passes isinstance(x, int))."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_tokens: int = 128
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if is_int(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:  # 1 / t would overflow float32 logits: the limit t -> 0 is greedy
            self.temperature = 0.0
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        self.top_k = min(self.top_k, MAX_TOP_K)  # beyond any vocabulary: the same as no limit, and fits int64
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None:
            # Every seed the same draws as before (the generators take seed * c + salt mod 2^63), now also
            # in an int64 over the actors' wire, where a larger one failed the request.
            self.seed %= 2**63
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
            not is_int(t) or t < 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
