"""Optional CUDA kernels for the verification hot path (``verify.cu``), loaded lazily through cupy.

cupy is an optional extra (``pip install ssd[cuda]``) and is never required: ``available()`` is False
when cupy does not import, when torch has no CUDA, or when the environment variable
``SSD_DISABLE_CUPY=1`` is set, and ``ssd.kernels.verify`` then uses its torch implementation.
Nothing here is imported or compiled until a CUDA tensor reaches a verify function.

The kernels reproduce the torch path (see ``ssd.kernels.verify``) exactly, except for the float64
summation order of the final inverse-CDF sample (a block scan instead of a sequential cumsum).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = ["BLOCK", "available", "cu_path", "cu_source", "verify_greedy_cuda", "verify_rejection_cuda"]

BLOCK = 256  # threads per block; must match SSD_BLOCK in verify.cu (passed as -DSSD_BLOCK)


def cu_path() -> Path:
    """Path of the kernel source shipped with the package."""
    return Path(__file__).with_name("verify.cu")


def cu_source() -> str:
    return cu_path().read_text()


@functools.cache
def _cupy() -> Any:
    if os.environ.get("SSD_DISABLE_CUPY", "") not in ("", "0"):
        return None
    try:
        import cupy  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken CUDA runtime behind the import
        return None
    return cupy


def available() -> bool:
    """True when the CUDA path can be used: cupy imports, torch sees a GPU and the kernels compile (a cupy
    without a working NVRTC imports fine, and would fail every verification instead)."""
    return torch.cuda.is_available() and _cupy() is not None and _compiles()


@functools.cache
def _compiles() -> bool:
    try:
        _module().get_function("ssd_verify_greedy")
    except Exception as e:  # any compiler or driver error: verification takes the torch path
        log.warning("the CUDA verify kernels did not compile (%s); verification uses the torch path", e)
        return False
    return True


@functools.cache
def _module() -> Any:
    cp = _cupy()
    return cp.RawModule(code=cu_source(), options=("--std=c++17", f"-DSSD_BLOCK={BLOCK}"))


def _kernel(name: str) -> Any:
    return _module().get_function(name)


def _launch(name: str, device: torch.device, grid: int, args: tuple[Any, ...]) -> None:
    cp = _cupy()
    with cp.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            _kernel(name)((grid,), (BLOCK,), args)


def _cp(t: Tensor) -> Any:
    """Zero-copy cupy view of a contiguous CUDA tensor (via __cuda_array_interface__)."""
    return _cupy().asarray(t)


def verify_greedy_cuda(draft: Tensor, nd: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """draft [B, K] int64, nd [B] int64 clamped to [0, K], target [B, K+1, V].

    Returns (num_accepted [B], tokens [B, K+1])."""
    import numpy as np

    B, K = draft.shape
    V = target.shape[-1]
    dev = target.device
    tgt = target.float().contiguous()  # fp16 / bf16 -> fp32 keeps the argmax
    d = draft.to(dev, torch.int64).contiguous()
    n = nd.to(dev, torch.int64).contiguous()
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    tokens = torch.empty(B, K + 1, dtype=torch.int64, device=dev)
    if d.numel() == 0:  # K == 0: cupy needs a real allocation behind every pointer argument
        d = torch.zeros(1, dtype=torch.int64, device=dev)
    args = (_cp(tgt), _cp(d), _cp(n), np.int32(B), np.int32(K), np.int32(V), _cp(num_acc), _cp(tokens))
    _launch("ssd_verify_greedy", dev, B, args)
    return num_acc, tokens


def verify_rejection_cuda(
    draft: Tensor,
    nd: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    u_accept: Tensor,
    u_sample: Tensor,
) -> tuple[Tensor, Tensor]:
    """CUDA version of the torch path in ``ssd.kernels.verify.verify_rejection`` (same arguments;
    nd already clamped to [0, K]). Returns (num_accepted [B], tokens [B, K+1])."""
    import numpy as np

    B, K = draft.shape
    V = p_target.shape[-1]
    dev = p_target.device
    p = p_target.float().contiguous()  # [B, K+1, V]
    q = p if q_draft is None else q_draft.to(dev, torch.float32).contiguous()  # [B, K, V] (dummy if None)
    d = draft.to(dev, torch.int64).contiguous()
    n = nd.to(dev, torch.int64).contiguous()
    ua = u_accept.to(dev, torch.float64).contiguous()
    us = u_sample.to(dev, torch.float64).contiguous()
    num_acc = torch.empty(B, dtype=torch.int64, device=dev)
    tokens = torch.empty(B, K + 1, dtype=torch.int64, device=dev)
    if ua.numel() == 0:  # K == 0: cupy needs a real allocation behind every pointer argument
        ua = torch.zeros(1, dtype=torch.float64, device=dev)
    if d.numel() == 0:
        d = torch.zeros(1, dtype=torch.int64, device=dev)
    args = (
        _cp(p),
        _cp(q) if q.numel() > 0 else _cp(p),
        np.int32(q_draft is not None),
        _cp(d),
        _cp(n),
        _cp(ua),
        _cp(us),
        np.int32(B),
        np.int32(K),
        np.int32(V),
        _cp(num_acc),
        _cp(tokens),
    )
    _launch("ssd_verify_rejection", dev, B, args)
    return num_acc, tokens
