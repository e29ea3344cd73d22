"""Preallocated, slot-based KV cache: one row per sequence, contiguous positions, O(1) rollback."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for `num_slots` sequences of up to `max_len` tokens each.

    A slot's valid length is tracked on the host; rolling back after a rejected draft only
    lowers that length (stale entries past it are overwritten by the next write).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, max_len, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"KV cache full: all {self.num_slots} slots in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        self._free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Roll a sequence back to its first `length` tokens."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def keep(self, slot: int, base_len: int, offsets: list[int]) -> None:
        """Keep only the entries at base_len + offsets (in that order) after base_len.

        Used after tree verification: the accepted path's nodes are scattered through the
        tree block and are moved down to sit contiguously after the prefix.
        """
        if not offsets:
            self.truncate(slot, base_len)
            return
        src = torch.tensor([base_len + o for o in offsets], device=self.k.device)
        if max(offsets) + base_len >= self.lengths[slot]:
            raise ValueError("keep() offset beyond the slot's length")
        dst = slice(base_len, base_len + len(offsets))
        self.k[:, slot, :, dst] = self.k[:, slot, :, src].clone()
        self.v[:, slot, :, dst] = self.v[:, slot, :, src].clone()
        self.lengths[slot] = base_len + len(offsets)
