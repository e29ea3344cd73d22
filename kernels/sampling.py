"""Sampling math: logits -> filtered probabilities -> a token, driven by pre-drawn uniforms.

Every op here has two implementations:

* ``ref_*``: a plain loop over rows, written to be obviously correct. It is the ground truth.
* the public fast version: vectorised torch over all rows at once (no Python loop over rows).

Tests check fast == ref on random inputs (tokens bit-exactly, probabilities to float tolerance).

Randomness is always passed IN as uniforms in [0, 1) (drawn by the caller from per-request seeded
``torch.Generator`` objects), so results never depend on global RNG state or on batch composition.

Conventions shared by every function in this module
----------------------------------------------------
* Ranking ("top-k", "top-F", "nucleus order") is by descending probability with ties broken by the
  LOWEST token index, i.e. a stable descending sort. Exactly k tokens are kept by top-k even when
  there are ties at the k-th place.
* ``temperature <= 0`` means greedy: a one-hot at ``torch.argmax`` of the raw logits (ties -> lowest
  index). top-k / top-p do not change a one-hot.
* ``top_k <= 0`` or ``top_k >= V`` disables top-k; ``top_p >= 1`` disables top-p. top-p is applied to
  the top-k-restricted, renormalised distribution (HF / vLLM order): sorted token j is kept iff the
  probability mass strictly before it is < top_p (so the top token is always kept, and the kept set
  is the smallest prefix whose mass reaches top_p). That comparison is done in float64 on a
  sequential cumulative sum so the ref and fast versions agree exactly.
* Inverse-CDF sampling (``sample_from_probs``) normalises internally, so callers may pass
  unnormalised non-negative masses (e.g. a speculative-decoding residual max(0, p - q)).

Fast-path notes: top-k / top-p / top-F never sort whole rows when the largest k in the batch is small
(``torch.topk`` of the L largest values, then a value threshold with lowest-index tie filling, which
reproduces the stable-sort ranking exactly); rows with top-p but no top-k need a full sort. The fast
versions make a few host syncs per call (``.any()`` on the filter flags, the largest k / F).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu as cpu_kernels

__all__ = [
    "filter_logits",
    "sample_from_probs",
    "saguaro_probs",
    "ref_filter_logits",
    "ref_sample_from_probs",
    "ref_saguaro_probs",
]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _row_param(
    param: Tensor | float | int, shape: torch.Size, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Broadcast a per-row parameter ``[B]`` (or ``[B, ...]`` / scalar) to ``shape`` = logits.shape[:-1].

    A ``[B]`` tensor is viewed as ``[B, 1, ..., 1]`` so it broadcasts over the middle dims.
    Returns a flat ``[N]`` tensor, N = prod(shape).
    """
    t = torch.as_tensor(param, device=device, dtype=dtype)
    if t.dim() > 0 and t.dim() < len(shape):
        t = t.reshape(t.shape + (1,) * (len(shape) - t.dim()))
    return t.expand(shape).reshape(-1)


def _stable_desc_sort(x: Tensor) -> tuple[Tensor, Tensor]:
    """Descending sort along the last dim, ties -> lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def _top_values(probs: Tensor, L: int) -> Tensor:
    """The L largest values of each row, descending: [N, V] -> [N, L].

    Only VALUES are used by the fast paths, and those are unique whatever the tie order, so this is
    bit-identical to the first L entries of a stable sort. topk is used when L is small vs V.
    """
    if 8 * L < probs.shape[-1]:
        return torch.topk(probs, L, dim=-1, largest=True, sorted=True).values
    return torch.sort(probs, dim=-1, descending=True).values[:, :L]


def _top_m_mask(probs: Tensor, m: Tensor, top_vals: Tensor) -> Tensor:
    """Token mask of the m[n] highest-ranked tokens of each row (stable-sort ranking: descending
    value, ties -> lowest index), without sorting the whole row.

    probs [N, V]; m [N] int64 in [1, L]; top_vals [N, L] = _top_values(probs, L).
    The m-th value t is the threshold: every token > t is in, and of the tokens == t the lowest-index
    ones fill the remaining m - #(> t) places.
    """
    t = top_vals.gather(1, (m - 1)[:, None])  # [N, 1] value at rank m
    greater = probs > t  # [N, V]
    equal = probs == t  # [N, V]
    need = m[:, None] - greater.sum(dim=-1, keepdim=True)  # [N, 1] tied tokens still to take (>= 1)
    if not bool((equal.sum(dim=-1, keepdim=True) > need).any()):
        return greater | equal  # no row has more ties at the threshold than places left (usual case)
    return greater | (equal & (torch.cumsum(equal.to(torch.int32), dim=-1) <= need))


# ----------------------------------------------------------------------------------------------
# filter_logits
# ----------------------------------------------------------------------------------------------


def filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """softmax(logits / T) restricted to top-k, then to the top-p nucleus, renormalised.

    logits:      [B, ..., V] (any float dtype; computed in float32)
    temperature: [B] float  (per row, broadcast over the middle dims); <= 0 -> greedy one-hot
    top_k:       [B] int    (<= 0 or >= V -> off)
    top_p:       [B] float  (>= 1 -> off)
    returns      [B, ..., V] float32 probabilities (each row sums to 1 up to rounding), each row's bits
    independent of the other rows.
    """
    shape = logits.shape
    V = shape[-1]
    lead = shape[:-1]
    dev = logits.device
    x = logits.reshape(-1, V).float()  # [N, V]
    temp = _row_param(temperature, lead, dev, torch.float32)  # [N]
    k = _row_param(top_k, lead, dev, torch.int64)  # [N]
    tp = _row_param(top_p, lead, dev, torch.float64)  # [N]

    greedy = temp <= 0  # [N]
    safe_t = torch.where(greedy, torch.ones_like(temp), temp)
    probs = torch.softmax(x / safe_t[:, None], dim=-1)  # [N, V]

    k_on = (k > 0) & (k < V)
    p_on = tp < 1.0
    active = k_on | p_on  # [N] rows that filter at all
    if bool(active.any()):
        k_eff = torch.where(k_on, k, torch.full_like(k, V))  # [N]
        # Only the first L sorted positions can survive: L = largest top-k among active rows
        # (V when some active row uses top-p without top-k). Sorted VALUES suffice for the decisions.
        L = int(torch.where(active, k_eff, torch.ones_like(k_eff)).max())
        sp = _top_values(probs, L)  # [N, L] descending
        pos = torch.arange(L, device=dev)  # [L]
        keep_k = pos[None, :] < k_eff[:, None]  # [N, L] top-k in sorted space
        # Sequential float64 cumsum of the top-k-restricted masses; its last entry is the top-k total.
        cum = torch.cumsum(torch.where(keep_k, sp, 0.0).double(), dim=-1)  # [N, L] inclusive
        # Exclusive prefix (mass strictly before sorted position j): the inclusive cumsum shifted right.
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [N, L]
        total_k = cum[:, -1:]  # [N, 1]
        keep_p = (before < tp[:, None] * total_k) | ~p_on[:, None]  # [N, L]
        keep = keep_k & keep_p  # [N, L], a prefix of the sorted positions
        keep[:, 0] = True  # the top token always survives
        m = keep.sum(dim=-1)  # [N] number of tokens kept
        tok_keep = _top_m_mask(probs, m, sp) | ~active[:, None]  # [N, V] back in vocab order
        filtered = torch.where(tok_keep, probs, 0.0)
        # Renormalised by the kept mass from the sequential cumsum, and only rows that filter: a row's bits
        # then depend neither on the rows beside it nor on how many threads a row sum would split over (a
        # seeded request samples the same token alone or in any batch).
        kept = cum.gather(1, (m - 1)[:, None])  # [N, 1] float64
        probs = torch.where(active[:, None], (filtered.double() / kept).float(), probs)

    if bool(greedy.any()):
        onehot = torch.zeros_like(probs)
        onehot.scatter_(-1, torch.argmax(x, dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs.reshape(shape)


def argmax_last(x: Tensor) -> Tensor:
    """torch.argmax(x, dim=-1), ties -> lowest index: contiguous fp32 CPU logits take the C kernel
    (ssd.kernels.cpu.argmax_rows, 5-10x faster on vocabulary rows: ~0.1 ms per 152k-token row saved)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] > 0 and (
            cpu_kernels.available()):
        return cpu_kernels.argmax_rows(x)
    return torch.argmax(x, dim=-1)


def ref_filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Reference for ``filter_logits``: one row at a time, explicit loops for top-k / top-p."""
    shape = logits.shape
    V = shape[-1]
    lead = shape[:-1]
    x = logits.reshape(-1, V).float()  # [N, V]
    temp = _row_param(temperature, lead, logits.device, torch.float32)
    ks = _row_param(top_k, lead, logits.device, torch.int64)
    tps = _row_param(top_p, lead, logits.device, torch.float64)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        row = x[n]  # [V]
        t = float(temp[n])
        if t <= 0:
            # Greedy: one-hot at the first maximal logit.
            out[n, int(torch.argmax(row))] = 1.0
            continue
        probs = torch.softmax(row / temp[n], dim=-1)  # [V]
        sp, idx = _stable_desc_sort(probs)  # ranking: descending prob, ties -> lower index
        k = int(ks[n])
        if k <= 0 or k >= V:
            k = V  # top-k off
        top_p = float(tps[n])
        # Total mass of the top-k set, accumulated left to right (Python floats are float64).
        total_k = 0.0
        for j in range(k):
            total_k += float(sp[j])
        keep = [False] * V
        mass_before = 0.0  # mass (of the top-k set) strictly before sorted position j
        for j in range(k):
            if j == 0 or top_p >= 1.0 or mass_before < top_p * total_k:
                keep[j] = True
            mass_before += float(sp[j])
        if k == V and top_p >= 1.0:
            out[n] = probs  # nothing filtered: softmax as it is
            continue
        kept = 0.0  # kept mass in sorted order, float64
        for j in range(V):
            if keep[j]:
                out[n, int(idx[j])] = sp[j]
                kept += float(sp[j])
        out[n] = (out[n].double() / kept).float()
    return out.reshape(shape)


# ----------------------------------------------------------------------------------------------
# sample_from_probs
# ----------------------------------------------------------------------------------------------


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: one token per row from (possibly unnormalised) non-negative masses.

    probs: [..., V] non-negative (need not sum to 1); u: [...] uniforms in [0, 1).
    returns [...] int64.

    Rule (exact, shared with the reference and the CUDA kernel): with the float64 sequential cumsum
    c_j = sum_{i<=j} probs_i and target = u * c_{V-1}, the token is the smallest j with c_j > target
    and probs_j > 0. Hence u exactly at a boundary c_j / total goes to the next positive token, and a
    zero-probability token is never returned. If rounding leaves no such j (u -> 1), the last token
    with positive mass is returned. An all-zero row (invalid input) returns token 0.
    """
    V = probs.shape[-1]
    lead = probs.shape[:-1]
    pr = probs.reshape(-1, V)  # [N, V]
    cdf = torch.cumsum(pr.double(), dim=-1)  # [N, V]
    target = u.reshape(-1).to(pr.device, torch.float64) * cdf[:, -1]  # [N]
    positive = pr > 0  # [N, V]
    hit = (cdf > target[:, None]) & positive  # [N, V]
    first = torch.argmax(hit.to(torch.int8), dim=-1)  # [N] first True (0 if none)
    # Fallback: last positive index (argmax of the flipped mask), used when no hit.
    last_pos = (V - 1) - torch.argmax(positive.flip(-1).to(torch.int8), dim=-1)  # [N]
    last_pos = torch.where(positive.any(dim=-1), last_pos, 0)  # an all-zero (or NaN) row: token 0, as documented
    tok = torch.where(hit.any(dim=-1), first, last_pos)
    return tok.reshape(lead)


def ref_sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Reference for ``sample_from_probs``: Python loop, float64 running sum."""
    V = probs.shape[-1]
    pr = probs.reshape(-1, V)
    us = u.reshape(-1)
    out = torch.zeros(pr.shape[0], dtype=torch.int64)
    for n in range(pr.shape[0]):
        vals = [float(v) for v in pr[n]]
        total = 0.0
        for v in vals:
            total += v
        target = float(us[n]) * total
        tok = None
        cum = 0.0
        for j, v in enumerate(vals):
            cum += v
            if cum > target and v > 0:
                tok = j
                break
        if tok is None:  # rounding at the very end of the CDF: last positive token
            positives = [j for j, v in enumerate(vals) if v > 0]
            tok = positives[-1] if positives else 0
        out[n] = tok
    return out.reshape(probs.shape[:-1]).to(probs.device)


# ----------------------------------------------------------------------------------------------
# Saguaro sampling sigma_{F,C}
# ----------------------------------------------------------------------------------------------


def _fanout_rows(fanout: Tensor | int, lead: torch.Size, device: torch.device) -> Tensor:
    """fanout [B] / [B, ...] / scalar, broadcast to lead dims (a [B] tensor broadcasts over middle dims)."""
    return _row_param(fanout, lead, device, torch.int64)


def saguaro_probs(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    fanout: Tensor,
    C: float,
) -> Tensor:
    """Saguaro draft distribution sigma_{F,C}: filtered probs with the top-F tokens' mass scaled by C.

    logits [B, ..., V]; temperature / top_k / top_p [B]; fanout [B] or [B, ...] int (F per row /
    position, broadcastable to logits.shape[:-1]); C in [0, 1]. Returns [B, ..., V] float32.

    * "top-F" ranks the FILTERED probabilities (descending, ties -> lowest index); F <= 0 scales nothing.
    * C == 1 returns exactly ``filter_logits(...)``.
    * Zero-mass fallback (only possible when C == 0 and the top-F set covers the whole support, e.g.
      F >= number of non-zero tokens, or a greedy one-hot row): the row keeps the top-F tokens
      UNSCALED, i.e. it equals the filtered distribution, so it stays a distribution.
    The same function must produce q for drafting and for verification (that is what keeps SD lossless).
    """
    probs = filter_logits(logits, temperature, top_k, top_p)  # [B, ..., V]
    if C == 1.0:
        return probs
    if not 0.0 <= C <= 1.0:
        raise ValueError(f"C must be in [0, 1], got {C}")
    shape = probs.shape
    V = shape[-1]
    pr = probs.reshape(-1, V)  # [N, V]
    F = _fanout_rows(fanout, shape[:-1], probs.device).clamp(0, V)  # [N]
    L = int(F.max()) if F.numel() > 0 else 0
    if L == 0:
        return probs  # nothing to scale
    in_top = _top_m_mask(pr, F.clamp(min=1), _top_values(pr, L)) & (F > 0)[:, None]  # [N, V] top-F tokens
    scaled = torch.where(in_top, pr * C, pr)  # [N, V]
    ok = (scaled > 0).any(dim=-1, keepdim=True)  # [N, 1] zero-mass fallback guard
    scaled = torch.where(ok, scaled, pr)
    total = torch.cumsum(scaled.double(), dim=-1)[:, -1:]  # [N, 1] sequential: the same bits in any batch
    return (scaled.double() / total).float().reshape(shape)


def ref_saguaro_probs(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    fanout: Tensor,
    C: float,
) -> Tensor:
    """Reference for ``saguaro_probs``: per row, scale the F highest filtered probabilities by C."""
    probs = ref_filter_logits(logits, temperature, top_k, top_p)
    if C == 1.0:
        return probs
    shape = probs.shape
    V = shape[-1]
    pr = probs.reshape(-1, V)
    Fs = _fanout_rows(fanout, shape[:-1], probs.device)
    out = torch.empty_like(pr)
    for n in range(pr.shape[0]):
        row = pr[n].clone()
        _, idx = _stable_desc_sort(row)
        F = max(0, int(Fs[n]))
        for j in range(min(F, V)):
            row[idx[j]] = row[idx[j]] * C
        if not bool((row > 0).any()):
            row = pr[n].clone()  # C == 0 removed all mass: keep the top-F unscaled
        total = 0.0  # float64, in vocabulary order
        for v in row.tolist():
            total += v
        out[n] = (row.double() / total).float()
    return out.reshape(shape)
