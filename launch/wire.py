"""Torch tensors as numpy payloads, for Ray's object store (launch/actors.py) and the call channel
(launch/channel.py): bf16 as its int16 bits, dtypes numpy lacks (float8, ...) in torch's own format, cuda
tensors through the host and back onto this process's current device.

Ray pickles torch tensors through torch's own reducer (several copies); numpy arrays cross out-of-band.
benchmarks/transfer.py, one [8, 151936] float32 q (4.9 MB) draft actor -> target actor, ms above Ray's
two-call floor on this 2-core box: torch reducer 38, this encoding 11, gloo send/recv 4.3; via the driver
61 (torch reducer) / 16 (this encoding).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

Payload = tuple[str, Any, str]  # (kind: "np" | "bf16" | "torch", data, device type)


def tensor_to_wire(t: torch.Tensor) -> Payload:
    t = t.detach()
    device = t.device.type
    if device != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return "bf16", t.view(torch.int16).numpy(), device
    try:
        return "np", t.numpy(), device
    except TypeError:  # a dtype numpy lacks (float8, ...): torch's own format
        buf = io.BytesIO()
        torch.save(t, buf)
        return "torch", buf.getvalue(), device


def tensor_from_wire(kind: str, data: Any, device: str, copy: bool = True) -> torch.Tensor:
    """`copy`: out of a read-only buffer (Ray's shared memory; the receiver may write to its tensors). An array
    unpickled in-band is fresh and writable already."""
    if kind == "torch":
        t = torch.load(io.BytesIO(data), weights_only=True)
    else:
        t = torch.from_numpy(np.array(data, copy=True) if copy else data)
        if kind == "bf16":
            t = t.view(torch.bfloat16)
    # A cuda tensor lands on this process's current device (Ray sets CUDA_VISIBLE_DEVICES).
    return t.to(device) if device != "cpu" and torch.cuda.is_available() else t
