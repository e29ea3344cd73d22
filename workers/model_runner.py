"""ModelRunner: one model plus its KV cache; scores blocks of new tokens for a batch of sequences.

A forward appends `tokens[b]` to slot `slots[b]` and returns logits for every new token. The new
tokens of a row may form a chain (ordinary decode / verification) or a tree (`parents`), scored in
one pass with a tree attention mask; rollback is `truncate`, tree compaction is `keep`.
"""

from __future__ import annotations

import torch

from ssd.cache.kv_cache import KVCache
from ssd.workers.models.decoder import DecoderModel, KVView


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node (0 = child of the prefix); parents[i] < i, -1 = attached to the prefix."""
    depth: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree parent {p} of node {i} must be -1 or an earlier node")
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def tree_ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i may attend node j iff j is i or an ancestor of i."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        max_slots: int,
        max_len: int,
        device: str | torch.device = "cpu",
    ) -> None:
        cfg = model.config
        self.model = model
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = model.embed_tokens.weight.dtype
        self.max_len = max_len
        self.kv = KVCache(
            cfg.num_hidden_layers, max_slots, cfg.num_key_value_heads, max_len, cfg.head_dim, self.dtype, device
        )

    # -- slot management -------------------------------------------------------------------
    def allocate(self) -> int:
        return self.kv.allocate()

    def free(self, slot: int) -> None:
        self.kv.free(slot)

    def length(self, slot: int) -> int:
        return self.kv.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        self.kv.truncate(slot, length)

    def keep(self, slot: int, base_len: int, offsets: list[int]) -> None:
        self.kv.keep(slot, base_len, offsets)

    # -- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        tokens: list[list[int]],
        parents: list[list[int] | None] | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Append tokens[b] to slot slots[b]; return logits [B, n, V] float32 (or [B, V] if last_only).

        parents[b], when given, makes row b a tree (see tree_depths); row b's logits at index i are
        then the target's distribution after node i's path.
        """
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

        depth = []
        trees: list[list[int] | None] = list(parents) if parents is not None else [None] * B
        for b in range(B):
            tr = trees[b]
            if tr is not None and len(tr) != lens[b]:
                raise ValueError("parents must give one parent per new token")
            depth.append(tree_depths(tr) if tr is not None else list(range(lens[b])))

        pad_ids = [t + [0] * (n - len(t)) for t in tokens]
        pad_pos = [[b0 + d for d in dep] + [b0] * (n - len(dep)) for b0, dep in zip(base, depth)]
        input_ids = torch.tensor(pad_ids, dtype=torch.long, device=dev)  # [B, n]
        positions = torch.tensor(pad_pos, dtype=torch.long, device=dev)  # [B, n]

        write_b = torch.tensor([b for b in range(B) for _ in range(lens[b])], device=dev)
        write_i = torch.tensor([i for b in range(B) for i in range(lens[b])], device=dev)
        slot_t = torch.tensor(slots, device=dev)
        base_t = torch.tensor(base, device=dev)
        write_slot = slot_t[write_b]
        write_pos = base_t[write_b] + write_i
        write_src = write_b * n + write_i
        read_len = max(b0 + nb for b0, nb in zip(base, lens))

        mask = self._mask(base, lens, trees, n, read_len)
        if slots == list(range(slots[0], slots[0] + B)):
            slot_index: torch.Tensor | slice = slice(slots[0], slots[0] + B)
        else:
            slot_index = slot_t
        kv = KVView(self.kv.k, self.kv.v, slot_index, write_b, write_slot, write_pos, write_src, read_len, mask)
        hidden = self.model(input_ids, positions, kv)  # [B, n, D]
        for s, nb in zip(slots, lens):
            self.kv.lengths[s] += nb
        if last_only:
            last = torch.tensor([nb - 1 for nb in lens], device=dev)
            return self.model.logits(hidden[torch.arange(B, device=dev), last])  # [B, V]
        return self.model.logits(hidden)  # [B, n, V]

    def _mask(
        self, base: list[int], lens: list[int], trees: list[list[int] | None], n: int, read_len: int
    ) -> torch.Tensor:
        """[B, 1, n, read_len] bool: the whole prefix, plus causal (or tree-ancestor) new tokens."""
        dev = self.device
        B = len(base)
        cols = torch.arange(read_len, device=dev)[None, None, :]  # [1, 1, L]
        rows = torch.arange(n, device=dev)[None, :, None]  # [1, n, 1]
        base_t = torch.tensor(base, device=dev)[:, None, None]  # [B, 1, 1]
        lens_t = torch.tensor(lens, device=dev)[:, None, None]
        causal = cols <= base_t + rows  # prefix + new tokens up to and including this one
        mask = causal & (rows < lens_t)  # [B, n, L]
        for b, tr in enumerate(trees):
            if tr is not None:
                anc = tree_ancestor_mask(tr).to(dev)
                mask[b, : lens[b], base[b] : base[b] + lens[b]] = anc
        # Padding rows attend position 0 only, so softmax never sees an all-masked row.
        mask[:, :, 0] |= rows[..., 0] >= lens_t[..., 0]
        return mask[:, None]
