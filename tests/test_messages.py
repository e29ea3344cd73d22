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


def _wire_bytes(payload) -> int:
    kind, data, _ = payload
    return sum(a.nbytes for a in data[:2]) if kind == "columns" else data.nbytes


def test_a_q_over_part_of_the_vocabulary_crosses_as_its_used_columns_bit_exactly():
    import torch

    from ssd.launch.actors import _tensor_from_wire, _tensor_to_wire

    q = _q_over_kept_ids(8, 151936, 32768)
    q[2, 5] = -0.0  # bit patterns are compared: -0.0 marks its column used and arrives as -0.0
    q[:, 40000] = 0.0
    q[3, 40000] = -0.0
    payload = _tensor_to_wire(q)
    assert payload[0] == "columns"
    assert _wire_bytes(payload) < 0.25 * q.numel() * 4
    back = _tensor_from_wire(payload)
    assert back.dtype == torch.float32 and back.shape == q.shape
    assert torch.equal(back.view(torch.int32), q.view(torch.int32))


@pytest.mark.parametrize("shape,dtype,kept", [((8, 151936), "float32", 151936), ((8, 151936), "float32", 80000),
                                              ((4, 1000), "float32", 10), ((8, 151936), "bfloat16", 100)])
def test_other_tensors_cross_whole(shape, dtype, kept):
    """Dense q (over half the columns used), small tensors and other dtypes keep the plain encoding."""
    import torch

    from ssd.launch.actors import _tensor_from_wire, _tensor_to_wire

    t = _q_over_kept_ids(*shape, kept).to(getattr(torch, dtype))
    payload = _tensor_to_wire(t)
    assert payload[0] != "columns"
    assert torch.equal(_tensor_from_wire(payload), t)
