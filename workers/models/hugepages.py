"""Weights in transparent huge pages (Linux, CPU).

A decode step streams every weight once. With 4 KiB pages the block-quantised kernels take a TLB miss
every 4 KiB on each of their streams (codes, scales and offsets of two tiles), and on this project's
test machine that cost ~6-7 % of a decode step of the 1.5B (`benchmarks/huge_pages.py`). Linux backs
2 MiB-aligned anonymous memory with huge pages where a program asks for them (madvise), which the usual
THP setting ("madvise") allows; torch's CPU allocator only asks when THP_MEM_ALLOC_ENABLE is set before
its first allocation, so a worker copies its loaded weights once into memory that asks.

The copy has the same bits; nothing about the numerics changes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's THP setting ("always", "madvise" or "never"), or "unavailable" (not Linux, no THP)."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def huge_page_copy(t: Tensor) -> Tensor:
    """A copy of CPU tensor `t` in fresh anonymous memory that starts on a 2 MiB boundary and is
    advised MADV_HUGEPAGE. The tensor keeps its mapping alive (torch.frombuffer holds the buffer)."""
    if t.device.type != "cpu":
        raise ValueError(f"huge pages are for CPU tensors, got one on {t.device}")
    nbytes = t.numel() * t.element_size()
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a boundary
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    start = -addr % HUGE_PAGE
    buf.madvise(mmap.MADV_HUGEPAGE, start, size - start - (size - start) % HUGE_PAGE)
    out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start).view(t.dtype).view(t.shape)
    out.copy_(t)  # the first writes fault the pages in, as huge pages where the kernel has them
    return out


def move_to_huge_pages(model: nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Copy every contiguous CPU parameter and buffer of at least `min_bytes` into huge-page memory, in
    place (parameters keep their objects; a tensor shared by several modules stays shared). Returns the
    bytes moved: 0 where THP is off or unavailable."""
    if not available():
        log.debug("transparent huge pages: %s; weights stay in normal pages", thp_mode())
        return 0
    def big(t: Tensor | None) -> bool:
        return (t is not None and t.device.type == "cpu" and t.is_contiguous()
                and t.numel() * t.element_size() >= min_bytes)

    total = 0
    for p in model.parameters():  # each Parameter object once: a tied weight moves once and stays tied
        if big(p):
            p.data = huge_page_copy(p.data)
            total += p.numel() * p.element_size()
    # id of a buffer -> (the buffer, kept alive so its id stays its own; its copy), for a buffer registered
    # in several modules
    copies: dict[int, tuple[Tensor, Tensor]] = {}
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if big(b):
                if id(b) not in copies:
                    copies[id(b)] = (b, huge_page_copy(b))
                    total += b.numel() * b.element_size()
                module._buffers[name] = copies[id(b)][1]
    log.debug("moved %.0f MB of weights into huge pages", total / 1e6)
    return total
