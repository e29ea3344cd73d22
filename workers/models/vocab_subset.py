"""A draft whose output layer covers only part of the vocabulary.

Speculative decoding stays lossless with any draft distribution q, as long as verification uses that
very q. A draft that only ever proposes the frequent tokens (q = 0 elsewhere) therefore changes how
often drafts are accepted, never the output. On the qwen pair the draft's output layer is a third of
its decode step (151936 rows x 896), and the first 32768 token ids (BPE merges come roughly in order
of frequency) cover ~93-96 % of the tokens the target emits on HumanEval and MT-Bench.

`restrict_head(model, keep)` swaps the model's `lm_head` for a `SubsetHead`: the kept rows of the same
weights (the same codes for quantised heads, so kept logits keep their values) whose logits are
scattered into a full-vocabulary row of -inf. It keeps the whole layer too, for `full`: with
candidate_vocab="full" SSD ranks the likely verification outcomes with it (a target token outside the kept
ids is still a token the draft can continue from; predicting it costs one full-vocabulary row per round).
"""

from __future__ import annotations

import torch
from torch import nn

from ssd.workers.models.blockquant import W4A8Linear, _TiledLinear
from ssd.workers.models.dense import DenseLinear
from ssd.workers.models.quant import Int8Linear


class SubsetHead(nn.Module):
    """logits [..., V]: the kept rows' logits at their token ids, -inf everywhere else; `full(x)` gives
    the whole layer's logits.

    `set_row_extras(extras)` lets input row b (x[b]) also produce the token ids extras[b] until cleared:
    the draft passes each sequence's own prompt and output tokens outside the kept ids, which on HumanEval
    are nearly all the target's tokens outside them (identifiers, code fences). Their rows come from the
    full layer (the same codes), for the union of the batch's extras; a row's other extras stay -inf.
    `compact(x)` gives the same logits on `columns()` only, the ids they can be finite at.
    """

    def __init__(self, head: nn.Module, keep: torch.Tensor, vocab_size: int, full: nn.Module) -> None:
        super().__init__()
        self.head = head
        self.full = full
        self.vocab_size = vocab_size
        self.register_buffer("keep", keep)
        self.kept_ids = set(keep.tolist())  # for membership tests
        self._extras: list[list[int]] | None = None
        self._extra_layer: tuple[tuple[int, ...], nn.Module] | None = None  # the last union's rows, reused
        self._layout: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None  # compact's, per union

    def set_row_extras(self, extras: list[list[int]] | None) -> None:
        """Token ids each input row may also produce (ids already kept are ignored); None clears."""
        if extras is not None and any(not 0 <= t < self.vocab_size for ids in extras for t in ids):
            raise ValueError(f"extra token ids must lie in 0..{self.vocab_size - 1}")
        self._extras = None if extras is None else [sorted(set(ids) - self.kept_ids) for ids in extras]

    def _union(self) -> tuple[int, ...]:
        """The extra ids some row may produce now, ascending."""
        extras = self._extras
        return tuple(sorted({t for ids in extras for t in ids})) if extras else ()

    def _extra_logits(self, x: torch.Tensor, union: tuple[int, ...]) -> torch.Tensor:
        """Logits [..., len(union)] of the union's ids in x's dtype, -inf where a row may not produce one."""
        extras = self._extras
        assert extras is not None
        if len(extras) != x.shape[0]:
            raise ValueError(f"extras for {len(extras)} rows, input has {x.shape[0]}")
        if self._extra_layer is None or self._extra_layer[0] != union:
            ids = torch.tensor(union, dtype=torch.long, device=self.keep.device)
            self._extra_layer = (union, head_rows(self.full, ids))
        ex = self._extra_layer[1](x)  # [..., n_union]
        col = {t: i for i, t in enumerate(union)}
        allowed = torch.zeros(x.shape[0], len(union), dtype=torch.bool, device=ex.device)  # [B, n_union]
        for b, ids in enumerate(extras):
            allowed[b, [col[t] for t in ids]] = True
        allowed = allowed.view(x.shape[0], *([1] * (ex.dim() - 2)), len(union))
        return torch.where(allowed, ex, torch.full_like(ex, float("-inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.head(x)  # [..., n_keep]
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        out.index_copy_(-1, self.keep, sub)
        union = self._union()
        if not union:
            return out
        ids = torch.tensor(union, dtype=torch.long, device=out.device)
        return out.index_copy_(-1, ids, self._extra_logits(x, union).to(out.dtype))

    def columns(self) -> torch.Tensor:
        """The token ids, ascending, whose logits `compact` gives: the kept ids and the current extras."""
        return self._compact_layout(self._union())[0]

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., C] at `columns()`: forward's logits without the full-vocabulary row of -inf
        (the draft samples, ranks and takes argmaxes on ~33k columns instead of 152k). Ascending ids keep
        argmax's ties on the lowest id, as on the whole row."""
        sub = self.head(x).float()  # [..., n_keep]
        union = self._union()
        if not union:
            return sub
        cols, at_keep, at_extra = self._compact_layout(union)
        out = sub.new_empty(*sub.shape[:-1], cols.numel())  # [..., C]
        out.index_copy_(-1, at_keep, sub)
        return out.index_copy_(-1, at_extra, self._extra_logits(x, union).float())

    def _compact_layout(self, union: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(columns, where the kept ids go among them, where the union's go), for this union (cached)."""
        if self._layout is None or self._layout[0] != union:
            ids = torch.cat([self.keep, torch.tensor(union, dtype=torch.long, device=self.keep.device)])
            cols, order = ids.sort()
            at = torch.empty_like(order)
            at[order] = torch.arange(order.numel(), device=order.device)  # position of ids[i] among cols
            n = self.keep.numel()
            self._layout = (union, (cols, at[:n], at[n:]))
        return self._layout[1]


def head_rows(head: nn.Module, keep: torch.Tensor) -> nn.Module:
    """A layer computing only output rows `keep` of `head`, from the same stored weights."""
    bias = None if getattr(head, "bias", None) is None else head.bias[keep]
    if isinstance(head, nn.Linear):
        lin = nn.Linear(head.in_features, len(keep), bias=bias is not None, dtype=head.weight.dtype)
        lin.weight = nn.Parameter(head.weight.detach()[keep].clone(), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return lin
    act_dtype = bias.dtype if bias is not None else torch.bfloat16  # only the bias's dtype depends on it
    if isinstance(head, DenseLinear):
        return DenseLinear(head.weight.detach()[keep], bias)
    if isinstance(head, W4A8Linear):  # q4, q4g64
        return type(head)(head.codes(keep), head.scale_of(keep), head.offset_of(keep), bias, act_dtype)
    if isinstance(head, _TiledLinear):
        return type(head)(head.codes(keep), head.scale_of(keep), bias, act_dtype)
    if isinstance(head, Int8Linear):
        return Int8Linear(head.qweight[keep], head.scales[keep], bias)
    raise ValueError(f"cannot restrict an output layer of type {type(head).__name__} to part of the vocabulary")


def draft_vocab_ids(vocab_size: int, first: int, always: list[int]) -> torch.Tensor:
    """Token ids 0..first-1 plus `always` (the end-of-sequence ids), sorted, within the vocabulary."""
    ids = set(range(min(first, vocab_size))) | {t for t in always if 0 <= t < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def restrict_head(model: nn.Module, keep: torch.Tensor) -> None:
    """Replace model.lm_head by a SubsetHead over `keep` (token ids, sorted, unique)."""
    vocab = model.config.vocab_size
    if keep.numel() == 0 or int(keep.min()) < 0 or int(keep.max()) >= vocab or bool((keep.diff() <= 0).any()):
        raise ValueError(f"keep must be sorted, unique token ids in 0..{vocab - 1}")
    head = model.lm_head
    if isinstance(head, SubsetHead):
        raise ValueError("the output layer is already restricted")
    model.lm_head = SubsetHead(head_rows(head, keep), keep.to(model.embed_tokens.weight.device), vocab, head)
