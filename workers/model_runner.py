"""ModelRunner: one model plus its KV cache; scores blocks of new tokens for a batch of sequences.

A forward appends `tokens[b]` to slot `slots[b]` and returns logits for every new token. The new
tokens of a row may form a chain (ordinary decode / verification) or a tree (`parents`), scored in
one pass with a tree attention mask; rollback is `truncate`, tree compaction is `keep`.

A tree can also grow over several forwards (the SSD draft decodes all its branches one step per
forward): a slot's open *tree region* starts at some cache position, every node in it attends the
full prefix before the region plus its own ancestors, and later forwards attach new nodes to any
node already in the region.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ssd.cache.kv_cache import KVCache
from ssd.workers.cuda_graphs import CudaGraphs, length_bucket
from ssd.workers.models.decoder import DecoderModel, KVView


@dataclass
class TreeRegion:
    start: int  # cache position of region node 0
    depth: list[int]  # per node, 0 = child of the prefix
    anc: torch.Tensor  # [R, R] bool: anc[i, j] = node j is node i or one of its ancestors

    @classmethod
    def chain(cls, start: int, n: int) -> TreeRegion:
        return cls(start, list(range(n)), torch.ones(n, n, dtype=torch.bool).tril())

    def extend(self, parents: list[int]) -> torch.Tensor:
        """Append nodes (parents index region nodes, -1 = prefix); return their ancestor rows [n, R]."""
        r0, n = len(self.depth), len(parents)
        anc = torch.zeros(r0 + n, r0 + n, dtype=torch.bool)
        anc[:r0, :r0] = self.anc
        for i, p in enumerate(parents):
            node = r0 + i
            if not -1 <= p < node:
                raise ValueError(f"tree parent {p} of node {node} must be -1 or an earlier node")
            if p >= 0:
                anc[node] = anc[p]
            anc[node, node] = True
            self.depth.append(0 if p < 0 else self.depth[p] + 1)
        self.anc = anc
        return anc[r0:]


GRAPH_LAST_ONLY_MAX = 4  # a draft's catch-up feed (last_only) is graphed up to this many tokens


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        max_slots: int,
        max_len: int,
        device: str | torch.device = "cpu",
        cuda_graphs: bool = True,
    ) -> None:
        """cuda_graphs: replay captured graphs for small forwards on CUDA (workers/cuda_graphs.py); not
        for batch-invariant models, whose per-token attention plan is built on the host each forward."""
        cfg = model.config
        self.model = model
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = model.embed_tokens.weight.dtype
        self.max_len = max_len
        # KV heads held here: the attention modules' count (a tensor-parallel rank holds only its share).
        n_kv = model.layers[0].self_attn.n_kv if len(model.layers) else cfg.num_key_value_heads
        graphs = cuda_graphs and self.device.type == "cuda" and not model.batch_invariant
        # With graphs, one more slot: padding tokens of ragged rows write their keys there.
        slots = max_slots + 1 if graphs else max_slots
        self.kv = KVCache(cfg.num_hidden_layers, slots, n_kv, max_len, cfg.head_dim, self.dtype, device)
        self.regions: dict[int, TreeRegion] = {}
        self.graphs: CudaGraphs | None = None
        if graphs:
            self.graphs = CudaGraphs(model, self.kv, scratch_slot=self.kv.allocate())

    # -- slot management -------------------------------------------------------------------
    def allocate(self) -> int:
        return self.kv.allocate()

    def free(self, slot: int) -> None:
        self.regions.pop(slot, None)
        self.kv.free(slot)

    def length(self, slot: int) -> int:
        return self.kv.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        self.regions.pop(slot, None)
        self.kv.truncate(slot, length)

    def keep(self, slot: int, base_len: int, offsets: list[int]) -> None:
        self.regions.pop(slot, None)
        self.kv.keep(slot, base_len, offsets)

    def open_tree(self, slot: int, start: int) -> None:
        """Open a tree region at `start`; tokens already cached after it become a chain of nodes."""
        length = self.kv.lengths[slot]
        if not 0 <= start <= length:
            raise ValueError(f"tree start {start} outside slot {slot} of length {length}")
        self.regions[slot] = TreeRegion.chain(start, length - start)

    # -- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        tokens: list[list[int]],
        parents: list[list[int] | None] | None = None,
        last_only: bool = False,
        full_vocab: bool = False,
    ) -> torch.Tensor:
        """Append tokens[b] to slot slots[b]; return logits [B, n, V] float32 (or [B, V] if last_only).
        full_vocab: the whole vocabulary's logits from a restricted output layer (an eager forward).

        parents[b], when given, makes row b's tokens tree nodes: parents index the slot's open tree
        region (opened at the current length if none is open; -1 = child of the prefix). Row b's
        logits at index i are then the distribution after node i's path.
        """
        full_vocab = full_vocab and hasattr(self.model.lm_head, "full")  # else the usual (graphed) path
        B = len(slots)
        if B == 0 or B != len(tokens):
            raise ValueError("forward needs one token list per slot")
        lens = [len(t) for t in tokens]
        if min(lens) < 1:
            raise ValueError("every row needs at least one new token")
        n = max(lens)
        base = [self.kv.lengths[s] for s in slots]
        for s, b0, nb in zip(slots, base, lens):
            if b0 + nb > self.max_len:
                raise ValueError(f"sequence in slot {s} would exceed the KV cache length {self.max_len}")
        dev = self.device

        trees: list[list[int] | None] = list(parents) if parents is not None else [None] * B
        pos_base = list(base)
        depth: list[list[int]] = []
        anc_rows: list[tuple[int, torch.Tensor] | None] = []  # (region start, [n_b, R] ancestor rows)
        for b in range(B):
            tr, slot = trees[b], slots[b]
            if tr is None:
                if slot in self.regions:
                    raise ValueError(f"slot {slot} has an open tree region; pass parents or truncate/keep first")
                depth.append(list(range(lens[b])))
                anc_rows.append(None)
                continue
            if len(tr) != lens[b]:
                raise ValueError("parents must give one parent per new token")
            region = self.regions.setdefault(slot, TreeRegion.chain(base[b], 0))
            r0 = len(region.depth)
            rows = region.extend(tr)
            depth.append(region.depth[r0:])
            pos_base[b] = region.start
            anc_rows.append((region.start, rows))

        pad_ids = [t + [0] * (n - len(t)) for t in tokens]
        pad_pos = [[b0 + d for d in dep] + [b0] * (n - len(dep)) for b0, dep in zip(pos_base, depth)]
        read_len = max(b0 + nb for b0, nb in zip(base, lens))
        # Prompt prefill (last_only, longer) stays eager: one graph per prompt length would not pay.
        if (self.graphs is not None and not full_vocab and self.graphs.supports(B, n)
                and (n <= GRAPH_LAST_ONLY_MAX or not last_only)):
            mask = self._mask(base, lens, anc_rows, n, length_bucket(read_len, self.max_len))
            logits = self.graphs.run(slots, pad_ids, pad_pos, lens, base, mask)  # [B, n, V], shared buffer
            for s, nb in zip(slots, lens):
                self.kv.lengths[s] += nb
            if not last_only:
                return logits.clone()
            if min(lens) == n:
                return logits[:, n - 1].clone()  # [B, V]
            return logits[torch.arange(B, device=dev), torch.tensor([nb - 1 for nb in lens], device=dev)]  # a gather
        input_ids = torch.tensor(pad_ids, dtype=torch.long, device=dev)  # [B, n]
        positions = torch.tensor(pad_pos, dtype=torch.long, device=dev)  # [B, n]

        write_b = torch.tensor([b for b in range(B) for _ in range(lens[b])], device=dev)
        write_i = torch.tensor([i for b in range(B) for i in range(lens[b])], device=dev)
        slot_t = torch.tensor(slots, device=dev)
        base_t = torch.tensor(base, device=dev)
        write_slot = slot_t[write_b]
        write_pos = base_t[write_b] + write_i
        write_src = write_b * n + write_i

        mask = torch.from_numpy(self._mask(base, lens, anc_rows, n, read_len)).to(dev)
        if slots == list(range(slots[0], slots[0] + B)):
            slot_index: torch.Tensor | slice = slice(slots[0], slots[0] + B)
        else:
            slot_index = slot_t
        kv = KVView(
            self.kv.k, self.kv.v, slot_index, write_b, write_slot, write_pos, write_src, read_len, mask,
            rope_len=max(p for row in pad_pos for p in row) + 1,
        )
        hidden = self.model(input_ids, positions, kv)  # [B, n, D]
        for s, nb in zip(slots, lens):
            self.kv.lengths[s] += nb
        if last_only:
            last = torch.tensor([nb - 1 for nb in lens], device=dev)
            return self.model.logits(hidden[torch.arange(B, device=dev), last], full_vocab)  # [B, V]
        return self.model.logits(hidden, full_vocab)  # [B, n, V]

    @staticmethod
    def _mask(
        base: list[int], lens: list[int], anc_rows: list[tuple[int, torch.Tensor] | None], n: int, read_len: int,
    ) -> np.ndarray:
        """[B, 1, n, read_len] bool, on the host: the whole prefix, plus causal (or tree-ancestor) new tokens.

        numpy, not torch: a dozen tiny torch ops cost ~0.1 ms of host time per forward, which a graphed
        GPU step of a few ms notices.
        """
        cols = np.arange(read_len)[None, None, :]  # [1, 1, L]
        rows = np.arange(n)[None, :, None]  # [1, n, 1]
        base_a = np.asarray(base)[:, None, None]  # [B, 1, 1]
        lens_a = np.asarray(lens)[:, None, None]
        mask = (cols <= base_a + rows) & (rows < lens_a)  # [B, n, L]: prefix + new tokens up to this one
        for b, ar in enumerate(anc_rows):
            if ar is not None:
                start, anc = ar  # [n_b, R], R = region nodes including the new ones
                mask[b, : lens[b], start : start + anc.shape[1]] = anc.numpy()
        # Padding rows attend position 0 only, so softmax never sees an all-masked row.
        mask[:, :, 0] |= rows[..., 0] >= lens_a[..., 0]
        return mask[:, None]
