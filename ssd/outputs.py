from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Output:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # why the request failed (finish_reason "error"; generate(raise_errors=False))
