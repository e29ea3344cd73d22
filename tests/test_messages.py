"""Typed messages: the msgpack wire encoding round-trips every message type, and rejects what it cannot carry."""

from __future__ import annotations

import numpy as np
import pytest

from ssd.workers.messages import WIRE_TYPES, Draft, Outcome, SamplingSpec

MESSAGES = [
    SamplingSpec(),
    SamplingSpec(temperature=0.7, top_k=20, top_p=0.9, seed=3),
    Draft(seq_id=4),
    Draft(seq_id=5, tokens=[1, 2, 151643], q_kind="dist"),
    Draft(seq_id=6, tokens=[7, 8, 9], q_kind="point", parents=[-1, 0, 0]),
    Outcome(seq_id=7, num_accepted=2, tokens=[1, 2, 3]),
    Outcome(seq_id=8, num_accepted=1, tokens=[5, 6], accepted_nodes=[0, 2]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = msg.to_msgpack()
    assert isinstance(data, bytes)
    back = type(msg).from_msgpack(data)
    assert type(back) is type(msg) and back == msg


def test_every_wire_type_is_covered():
    assert {type(m) for m in MESSAGES} == set(WIRE_TYPES)


def test_values_msgpack_cannot_carry_are_refused_clearly():
    with pytest.raises(TypeError, match="Draft cannot go on the msgpack wire"):
        Draft(seq_id=1, tokens=[np.int64(3)]).to_msgpack()


# -- tensors on the Ray wire (launch/actors.py) ---------------------------------------------------


def _q_over_kept_ids(rows: int, vocab: int, kept: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(rows, vocab)  # a draft restricted to the first `kept` ids (+ an end-of-sequence id)
    q[:, :kept] = torch.rand(rows, kept, generator=g)
    q[:, vocab - 3] = 0.25
    return q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("shape,dtype,kept", [((8, 151936), "float32", 151936), ((8, 151936), "float32", 32770),
                                              ((4, 1000), "float32", 10), ((8, 151936), "bfloat16", 100)])
def test_tensors_cross_whole_and_bit_exact(shape, dtype, kept):
    """A dense q over part of the vocabulary crosses whole: finding its used columns measured twice as slow
    actor to actor (benchmarks/transfer.py --kept; the scan, gather and scatter cost more than the bytes saved
    on one machine). A restricted draft sends the columns it knows instead (workers/subset_q.py)."""
    import torch

    from ssd.launch.actors import _tensor_from_wire
    from ssd.launch.wire import tensor_to_wire as _tensor_to_wire

    t = _q_over_kept_ids(*shape, kept).to(getattr(torch, dtype))
    payload = _tensor_to_wire(t)
    assert payload[0] == ("bf16" if dtype == "bfloat16" else "np")
    back = _tensor_from_wire(payload)
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    assert back.dtype == t.dtype and torch.equal(back.view(bits), t.view(bits))
