"""Typed messages between the coordinator and the workers, with a msgpack wire encoding.

Token blocks and small scalars travel in these; large tensors (draft q distributions) travel
separately (object store or a torch.distributed group) and are referenced by position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class Message:
    def to_msgpack(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def from_msgpack(cls: type[T], data: bytes) -> T:
        fields = msgpack.unpackb(data, raw=False)
        return _build(cls, fields)


def _build(cls: Any, fields: dict[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = fields[f.name]
        sub = _NESTED.get((cls.__name__, f.name))
        if sub is not None and value is not None:
            value = [_build(sub, v) for v in value] if isinstance(value, list) else _build(sub, value)
        kwargs[f.name] = value
    return cls(**kwargs)


@dataclass
class SamplingSpec(Message):
    """The part of SamplingParams a worker needs."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class AddSequence(Message):
    seq_id: int
    prompt_ids: list[int]
    spec: SamplingSpec


@dataclass
class Draft(Message):
    """A speculation for one sequence: tokens to verify after its pending token.

    q_kind: "dist" (q distributions travel beside this message), "point" (no probabilities:
    n-gram / random drafters, verified as point masses) or "none" (greedy: q unused).
    """

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    q_kind: str = "none"
    parents: list[int] | None = None  # a token tree instead of a chain (tree verification)


@dataclass
class Outcome(Message):
    """A verification outcome v = (k, t*): k accepted drafts, then the target's token t*."""

    seq_id: int
    num_accepted: int
    tokens: list[int]  # accepted drafts followed by the correction / bonus token
    accepted_nodes: list[int] | None = None  # tree verification: accepted node indices


_NESTED: dict[tuple[str, str], type] = {("AddSequence", "spec"): SamplingSpec}
