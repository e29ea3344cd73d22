"""CUDA graphs for the model runner's small forwards: decode steps, verification blocks, tree steps.

A decode step of a small model on a GPU is mostly kernel-launch overhead: hundreds of small
kernels, each launched from Python. A captured graph replays them all with one launch. A graph
has fixed shapes and fixed buffers, so one is captured per (batch rows, tokens per row, attended
length bucket), lazily, on the first forward of that shape: its inputs are then the real ones,
so the warm-up and capture runs write exactly the keys and values the replay writes again. With
it, the same rows x tokens are captured for every longer bucket on padding alone (`capture_ahead_of`),
so that a request growing past a bucket boundary does not stop for a capture.

The runner builds every input on the host as for an eager forward (token ids, RoPE positions,
where each new token's keys go, the attention mask, so chains, ragged rows and SSD's token trees
all fit), and `run` copies them into the graph's buffers with two host-to-device transfers. Keys
are read up to a power-of-two bucket of the longest row; the mask, not the shape, tracks each
row's length. Padding tokens of ragged rows write their keys to a scratch slot nobody reads.
Logits land in one buffer shared by all graphs (each graph copies its own into the front of it),
so many captured shapes do not each hold a [B, n, V] output.

`capture=False` runs the same static-shape forward eagerly: how the tests exercise this path's
input building on a machine without CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ssd.cache.kv_cache import KVCache
from ssd.workers.models.decoder import DecoderModel, KVView

MIN_BUCKET = 256  # smallest attended-length bucket


class GraphCaptureError(RuntimeError):
    """A forward could not be captured (some op in it reads back to the host, say)."""


def length_bucket(read_len: int, max_len: int) -> int:
    """The smallest power of two >= read_len (at least MIN_BUCKET), capped at max_len."""
    b = MIN_BUCKET
    while b < read_len:
        b *= 2
    return min(b, max_len)


@dataclass
class GraphInputs:
    """Device buffers of one shape [B, n] attending L positions; a graph reads them at replay."""

    ints: torch.Tensor  # [4 * B * n + B] int64: ids, positions, write slots, write positions (each [B*n]), slots [B]
    mask: torch.Tensor  # [B, 1, n, L] bool

    def views(self, B: int, n: int) -> tuple[torch.Tensor, ...]:
        T = B * n
        ids, pos, wslot, wpos = (self.ints[i * T : (i + 1) * T] for i in range(4))
        return ids.view(B, n), pos.view(B, n), wslot, wpos, self.ints[4 * T :]


def static_forward(
    model: DecoderModel, kv_cache: KVCache, inp: GraphInputs, B: int, n: int, out: torch.Tensor
) -> None:
    """The forward a graph captures: logits of every token into out[: B * n], nothing read back to the host."""
    ids, pos, wslot, wpos, slots = inp.views(B, n)
    dev = ids.device
    T = B * n
    kv = KVView(
        kv_cache.k, kv_cache.v, slots, torch.arange(T, device=dev) // n, wslot, wpos, torch.arange(T, device=dev),
        inp.mask.shape[-1], inp.mask, rope_len=kv_cache.max_len,
    )
    out[:T].copy_(model.logits(model(ids, pos, kv)).view(T, -1))  # [B*n, V]


@dataclass
class _Graph:
    inputs: GraphInputs
    host_ints: torch.Tensor  # pinned twins of the inputs
    host_mask: torch.Tensor
    copied: torch.cuda.Event | None  # the last host-to-device copy is done (the pinned buffers are free)
    graph: torch.cuda.CUDAGraph | None = None
    keep: tuple[torch.Tensor, ...] = field(default_factory=tuple)  # tensors the graph reads, kept alive


class CudaGraphs:
    """Graphed forwards of one model over one KV cache; `run` replays (capturing first if needed)."""

    def __init__(
        self, model: DecoderModel, kv: KVCache, scratch_slot: int, max_tokens: int = 64, max_rows: int = 512,
        capture: bool = True, capture_ahead: bool = True,
    ) -> None:
        self.model = model
        # With a shape's first capture, capture it for every longer length bucket too (capture_ahead_of).
        self.capture_ahead = capture_ahead
        self.kv = kv
        self.scratch_slot = scratch_slot  # padding tokens write here
        self.max_tokens = max_tokens  # longest graphed row (tree steps, K + 1 <= 33)
        self.max_rows = max_rows  # most tokens (B * n) in one graphed forward
        self.capture = capture
        self.device = kv.k.device
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # graphs replay one at a time
        self.logits = torch.empty(max_rows, model.config.vocab_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}

    def supports(self, B: int, n: int) -> bool:
        return n <= self.max_tokens and B * n <= self.max_rows

    def run(
        self, slots: list[int], pad_ids: list[list[int]], pad_pos: list[list[int]], lens: list[int],
        base: list[int], mask: np.ndarray,
    ) -> torch.Tensor:
        """Logits [B, n, V]: a view of the shared buffer, valid until the next run.

        mask [B, 1, n, L] (host, bool, L a length bucket); row b's first lens[b] tokens go to cache
        positions base[b]..; its padding writes to the scratch slot."""
        B, n, L = mask.shape[0], mask.shape[2], mask.shape[3]
        key = (B, n, L)
        g = self.graphs.get(key)
        fresh = g is None
        if fresh:
            if self.capture_ahead:  # first: its warm-ups write the shared logits buffer
                self.capture_ahead_of(B, n, L)
            g = self._allocate(B, n, L)
        wslot = [slots[b] if i < lens[b] else self.scratch_slot for b in range(B) for i in range(n)]
        wpos = [base[b] + i if i < lens[b] else (b * n + i) % self.kv.max_len for b in range(B) for i in range(n)]
        flat = [t for row in pad_ids for t in row] + [p for row in pad_pos for p in row] + wslot + wpos + slots
        self._load(g, flat, mask)
        if fresh:
            self._first_run(g, B, n)
            self.graphs[key] = g
        elif self.capture:
            g.graph.replay()
        else:
            static_forward(self.model, self.kv, g.inputs, B, n, self.logits)
        return self.logits[: B * n].view(B, n, -1)

    def capture_ahead_of(self, B: int, n: int, L: int) -> None:
        """Capture [B, n] for every length bucket above L up to the cache length, on padding alone (every token
        writes to the scratch slot and attends its position 0): a sequence growing into the next bucket then
        replays at once. Captured lazily there, on an H200 the first forward of a new bucket took 0.3-0.8 s in
        the middle of a request (most of it the first attention calls at the new length)."""
        T, longer = B * n, L
        while longer < self.kv.max_len:
            longer = min(2 * longer, self.kv.max_len)
            if (B, n, longer) in self.graphs:
                continue
            g = self._allocate(B, n, longer)
            scratch = [self.scratch_slot] * T
            flat = [0] * T + [i % n for i in range(T)] + scratch + [i % self.kv.max_len for i in range(T)] + scratch[:B]
            mask = np.zeros((B, 1, n, longer), dtype=bool)
            mask[..., 0] = True
            self._load(g, flat, mask)
            self._first_run(g, B, n, replay=False)  # padding: nothing to compute beyond the capture's warm-up
            self.graphs[(B, n, longer)] = g

    def _load(self, g: _Graph, flat: list[int], mask: np.ndarray) -> None:
        """The inputs into the graph's device buffers, through its pinned host twins."""
        if g.copied is not None:
            g.copied.synchronize()  # the pinned buffers may still be in flight from the last call
        g.host_ints.numpy()[:] = flat  # numpy views of the pinned buffers: no torch op overhead
        g.host_mask.numpy()[:] = mask
        g.inputs.ints.copy_(g.host_ints, non_blocking=True)
        g.inputs.mask.copy_(g.host_mask, non_blocking=True)
        if g.copied is not None:
            g.copied.record()

    def _first_run(self, g: _Graph, B: int, n: int, replay: bool = True) -> None:
        """A new shape's first forward: captured (its warm-up runs the inputs once) and replayed unless `replay` is
        False; capture=False: the eager forward in place of both."""
        if not self.capture:
            static_forward(self.model, self.kv, g.inputs, B, n, self.logits)
            return
        try:
            self._capture(g, B, n)
        except RuntimeError as e:
            raise GraphCaptureError(
                f"capturing a forward of {B} x {n} tokens failed ({e}); cuda_graphs=False "
                "(CLI --no-cuda-graphs) runs every forward eagerly"
            ) from e
        if replay:
            g.graph.replay()

    def _allocate(self, B: int, n: int, L: int) -> _Graph:
        size = 4 * B * n + B
        pin = self.device.type == "cuda"
        inputs = GraphInputs(torch.zeros(size, dtype=torch.long, device=self.device),
                             torch.zeros(B, 1, n, L, dtype=torch.bool, device=self.device))
        host_ints = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        host_mask = torch.zeros(B, 1, n, L, dtype=torch.bool, pin_memory=pin)
        return _Graph(inputs, host_ints, host_mask, torch.cuda.Event() if pin else None)

    def _capture(self, g: _Graph, B: int, n: int) -> None:
        g.keep = self.model.rope_tables(self.kv.max_len, self.model.embed_tokens.weight.dtype)  # no growth inside
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture (lazy inits, cuBLAS workspaces)
            static_forward(self.model, self.kv, g.inputs, B, n, self.logits)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        # thread_local: work this thread does not issue must not break the capture
        with torch.cuda.graph(g.graph, pool=self.pool, capture_error_mode="thread_local"):
            static_forward(self.model, self.kv, g.inputs, B, n, self.logits)
