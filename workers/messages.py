"""Typed messages between the coordinator and the workers, with a msgpack wire encoding.

Token blocks and small scalars travel in these; large tensors (draft q distributions) travel
separately (the object store, actor to actor) and are referenced by position. Over Ray, every
class in WIRE_TYPES crosses as its msgpack bytes (launch/actors.py registers the serializers),
never as a pickle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TypeVar

import msgpack

T = TypeVar("T")


class Message:
    def to_msgpack(self) -> bytes:
        try:
            return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)
        except TypeError as e:  # e.g. a numpy integer among the tokens: the wire takes plain Python values
            raise TypeError(f"{type(self).__name__} cannot go on the msgpack wire: {e}") from e

    @classmethod
    def from_msgpack(cls: type[T], data: bytes) -> T:
        return cls(**msgpack.unpackb(data, raw=False))


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


WIRE_TYPES: tuple[type[Message], ...] = (SamplingSpec, Draft, Outcome)
