"""What a worker keeps per sequence: its KV slot, the last committed token, its sampling settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.workers.messages import SamplingSpec


def make_generator(seed: int | None, salt: int) -> torch.Generator:
    """Per-request generator: a seeded request draws the same numbers whatever shares its batch.

    `salt` separates the target's and the draft's streams for the same request.
    """
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed * 1_000_003 + salt) % (2**63))
    return g


def uniforms(gen: torch.Generator, n: int) -> torch.Tensor:
    """n uniforms in [0, 1) from a request's generator, in float64: float32 draws lie on a 2^-24 grid, which
    would round every probability sampled or tested with them to a multiple of 2^-24."""
    return torch.rand(n, generator=gen, dtype=torch.float64)  # [n]


@dataclass
class SeqState:
    slot: int
    pending: int  # last committed token: known, not yet in the KV cache
    committed: int  # committed tokens in the KV cache (speculative ones may sit past it)
    spec: SamplingSpec
    gen: torch.Generator
