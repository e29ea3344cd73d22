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
from typing import Any

import numpy as np
import torch

from ssd.cache.kv_cache import KVCache
from ssd.kernels import cpu as cpu_kernels
from ssd.workers.cuda_graphs import CudaGraphs, length_bucket
from ssd.workers.models.decoder import DecoderModel, KVView


@dataclass
class TreeRegion:
    start: int  # cache position of region node 0
    paths: list[list[int]]  # per node: its ancestors and itself, ascending region node indices

    @classmethod
    def chain(cls, start: int, n: int) -> TreeRegion:
        return cls(start, [list(range(i + 1)) for i in range(n)])

    def extend(self, parents: list[int]) -> list[list[int]]:
        """Append nodes (parents index region nodes, -1 = prefix); return their paths."""
        r0 = len(self.paths)
        for i, p in enumerate(parents):
            node = r0 + i
            if not -1 <= p < node:
                raise ValueError(f"tree parent {p} of node {node} must be -1 or an earlier node")
            self.paths.append([*self.paths[p], node] if p >= 0 else [node])
        return self.paths[r0:]


GRAPH_LAST_ONLY_MAX = 4  # a draft's catch-up feed (last_only) is graphed up to this many tokens


class OneTokenStep:
    """One new token of one sequence on the fused CPU layers (an AR decode step, a draft step): the same
    kernels and inputs as the general forward, so the same bits, without its per-forward planning.

    After a step has streamed the weights, every Python object and small tensor the host touches is a cache
    miss: the general path's index lists, ~10 new tensors, KVView and row plan cost ~1 ms of a 0.5B's 17.6 ms
    decode step (2 threads), with the second core idle. Here the step's index tensors are allocated once and
    rewritten through numpy views.
    """

    def __init__(self, model: DecoderModel, kv: KVCache) -> None:
        self.model, self.kv = model, kv
        self.ids = torch.zeros(1, dtype=torch.long)
        self.w_slot = torch.zeros(1, dtype=torch.int32)
        self.w_pos = torch.zeros(1, dtype=torch.int32)
        # Attention: positions 0..length-1 of the token's slot (off -1: no index list).
        self.plan = cpu_kernels.RowPlan(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                        torch.full((1,), -1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        self._ids, self._w_slot, self._w_pos = self.ids.numpy(), self.w_slot.numpy(), self.w_pos.numpy()
        self._p_slot, self._p_len = self.plan.slot.numpy(), self.plan.length.numpy()

    @staticmethod
    def usable(kv: KVCache) -> bool:
        """Whether the C layers can run over this cache (else the runner has no OneTokenStep)."""
        return kv.k.device.type == "cpu" and kv.k.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()

    def hidden(self, slot: int, token: int) -> torch.Tensor | None:
        """The final hidden state [1, D] of `token` appended to `slot` (its keys written, the length not yet
        advanced), or None when the model does not run on the fused layers now (nothing done)."""
        model, kv = self.model, self.kv
        if not (model.batch_invariant and model.use_fused_layers):
            return None
        fused = model.fused_layers(kv.k, kv.v)
        if fused is None:
            return None
        pos = kv.lengths[slot]
        self._ids[0] = token
        self._w_slot[0] = self._p_slot[0] = slot
        self._w_pos[0] = pos
        self._p_len[0] = pos + 1
        x = model.embed_tokens(self.ids)  # [1, D], a new tensor the C layers update in place
        cos_t, sin_t = model.rope_tables(pos + 1, x.dtype)
        x = fused.run(x, cos_t[pos : pos + 1], sin_t[pos : pos + 1], self.w_slot, self.w_pos, self.plan)
        return model.norm(x)


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
        self.one_token = OneTokenStep(model, self.kv) if OneTokenStep.usable(self.kv) else None

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
        compact: bool = False,
        logits_at: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Append tokens[b] to slot slots[b]; return logits [B, n, V] float32 (or [B, V] if last_only; or
        [sum of len(logits_at[b]), V] for the tokens at indices logits_at[b] of each row, in order).
        full_vocab: the whole vocabulary's logits from a restricted output layer (an eager forward);
        compact: a restricted layer's logits on its columns only, [..., C] (SubsetHead.compact; eager).

        parents[b], when given, makes row b's tokens tree nodes: parents index the slot's open tree
        region (opened at the current length if none is open; -1 = child of the prefix). Row b's
        logits at index i are then the distribution after node i's path.
        """
        full_vocab = full_vocab and hasattr(self.model.lm_head, "full")  # else the usual (graphed) path
        compact = compact and not full_vocab and hasattr(self.model.lm_head, "compact")
        B = len(slots)
        if B == 0 or B != len(tokens):
            raise ValueError("forward needs one token list per slot")
        if logits_at is not None and (len(logits_at) != B or any(
                not 0 <= i < len(t) for at, t in zip(logits_at, tokens) for i in at)):
            raise ValueError("logits_at must give, per row, indices of that row's new tokens")
        if logits_at is not None and all(at == [len(t) - 1] for at, t in zip(logits_at, tokens)):
            last_only, logits_at = True, None  # the same rows, on the paths that know last_only
        if (self.one_token is not None and B == 1 and len(tokens[0]) == 1 and (parents is None or parents[0] is None)
                and slots[0] not in self.regions and self.kv.lengths[slots[0]] < self.max_len):
            hidden = self.one_token.hidden(slots[0], tokens[0][0])  # [1, D]
            if hidden is not None:
                self.kv.lengths[slots[0]] += 1
                return self.model.logits(hidden if last_only else hidden[None], full_vocab, compact)
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
        trees_at: list[tuple[int, list[list[int]]] | None] = []  # (region start, the new nodes' paths)
        for b in range(B):
            tr, slot = trees[b], slots[b]
            if tr is None:
                if slot in self.regions:
                    raise ValueError(f"slot {slot} has an open tree region; pass parents or truncate/keep first")
                depth.append(list(range(lens[b])))
                trees_at.append(None)
                continue
            if len(tr) != lens[b]:
                raise ValueError("parents must give one parent per new token")
            region = self.regions.setdefault(slot, TreeRegion.chain(base[b], 0))
            paths = region.extend(tr)
            depth.append([len(path) - 1 for path in paths])
            pos_base[b] = region.start
            trees_at.append((region.start, paths))

        pad_ids = [t + [0] * (n - len(t)) for t in tokens]
        pad_pos = [[b0 + d for d in dep] + [b0] * (n - len(dep)) for b0, dep in zip(pos_base, depth)]
        read_len = max(b0 + nb for b0, nb in zip(base, lens))
        # Prompt prefill (last_only, longer) stays eager: one graph per prompt length would not pay.
        if (self.graphs is not None and not (full_vocab or compact) and self.graphs.supports(B, n)
                and (n <= GRAPH_LAST_ONLY_MAX or not last_only) and logits_at is None):
            mask = self._mask(base, lens, trees_at, n, length_bucket(read_len, self.max_len))
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

        # The valid (non-padding) tokens, b-major: where their keys go and where they sit in [B * n].
        w_b = [b for b in range(B) for _ in range(lens[b])]
        w_i = [i for b in range(B) for i in range(lens[b])]
        write_b = torch.tensor(w_b, device=dev)
        write_slot = torch.tensor([slots[b] for b in w_b], device=dev)
        write_pos = torch.tensor([base[b] + i for b, i in zip(w_b, w_i)], device=dev)
        write_src = torch.tensor([b * n + i for b, i in zip(w_b, w_i)], device=dev)

        # A batch-invariant model attends token by token: its plan comes straight from the tree structure.
        batch_invariant = self.model.batch_invariant
        mask = None if batch_invariant else torch.from_numpy(self._mask(base, lens, trees_at, n, read_len)).to(dev)
        if slots == list(range(slots[0], slots[0] + B)):
            slot_index: torch.Tensor | slice = slice(slots[0], slots[0] + B)
        else:
            slot_index = torch.tensor(slots, device=dev)
        kv = KVView(
            self.kv.k, self.kv.v, slot_index, write_b, write_slot, write_pos, write_src, read_len, mask,
            rope_len=max(p for row in pad_pos for p in row) + 1,
        )
        if batch_invariant:
            kv.set_rows(self._rows(slots, base, lens, trees_at))
        hidden = self.model(input_ids, positions, kv)  # [B, n, D]
        for s, nb in zip(slots, lens):
            self.kv.lengths[s] += nb
        if last_only:
            last = torch.tensor([nb - 1 for nb in lens], device=dev)
            return self.model.logits(hidden[torch.arange(B, device=dev), last], full_vocab, compact)  # [B, V]
        if logits_at is not None:
            rows = torch.tensor([b for b, at in enumerate(logits_at) for _ in at], device=dev)
            cols = torch.tensor([i for at in logits_at for i in at], device=dev)
            return self.model.logits(hidden[rows, cols], full_vocab, compact)  # [R, V]
        return self.model.logits(hidden, full_vocab, compact)  # [B, n, V]

    @staticmethod
    def _rows(
        slots: list[int], base: list[int], lens: list[int], trees_at: list[tuple[int, list[list[int]]] | None],
    ) -> list[tuple[int, int, int, Any]]:
        """Each new token's attention, for KVView.set_rows: (b, i, cache slot, keys), keys = L for cache
        positions 0..L-1, else a LongTensor of positions: the prefix before the tree region and the node's
        path. KVView.plan_rows derives the same from the mask (the reference; tests compare them)."""
        rows: list[tuple[int, int, int, Any]] = []
        for b, (slot, b0, nb, tree) in enumerate(zip(slots, base, lens, trees_at)):
            if tree is None:  # a chain: the prefix and the new tokens up to this one
                rows.extend((b, i, slot, b0 + i + 1) for i in range(nb))
                continue
            start, paths = tree
            prefix: torch.Tensor | None = None
            for i, path in enumerate(paths):
                if path[-1] == len(path) - 1:  # region nodes 0..j: positions 0..start + j
                    rows.append((b, i, slot, start + len(path)))
                    continue
                if prefix is None:
                    prefix = torch.arange(start)
                rows.append((b, i, slot, torch.cat([prefix, torch.tensor(path) + start])))
        return rows

    @staticmethod
    def _mask(
        base: list[int], lens: list[int], trees_at: list[tuple[int, list[list[int]]] | None], n: int, read_len: int,
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
        for b, tree in enumerate(trees_at):
            if tree is not None:
                start, paths = tree
                region = mask[b, : lens[b], start:]  # [n_b, L - start]: node i attends its path
                region[:] = False
                for i, path in enumerate(paths):
                    region[i, path] = True
        # Padding rows attend position 0 only, so softmax never sees an all-masked row.
        mask[:, :, 0] |= rows[..., 0] >= lens_a[..., 0]
        return mask[:, None]
