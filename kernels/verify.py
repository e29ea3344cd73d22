"""Speculative-decoding verification: greedy and lossless rejection sampling, linear and tree.

Linear (one chain of K drafts per row, batched, ragged):

* ``verify_greedy``   : accept x_i iff x_i == argmax p_i; the correction / bonus is argmax.
* ``verify_rejection``: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
  sample from norm(max(0, p_i - q_i)); if all K_b drafts are accepted sample the bonus from p_{K_b+1}
  (row index K_b, NOT K: batches are ragged). Lossless: the emitted tokens are distributed exactly as p.

Each has a fast vectorised torch version (no Python loop over B or K; O(B*K*V)), a CUDA version used
automatically for CUDA tensors when cupy imports (``ssd.kernels.cuda``), and a plain ``ref_*`` loop
version that is the ground truth in tests.

Tree (one sequence; SpecInfer / EAGLE recursive rejection sampling): ``verify_tree_greedy`` and
``verify_tree_rejection``. These are plain Python over nodes (N is small) and serve as their own reference.

Shared conventions
------------------
* Randomness is passed in as uniforms in [0, 1) (from per-request seeded generators, drawn in float64:
  float32 draws lie on a 2^-24 grid, which would bias every probability by up to that much).
* The acceptance test is ``u * q(x) < p(x)`` evaluated in float64: the real-number test u < p(x) / q(x)
  up to one float64 rounding of the product (relative 2^-53). q(x) == 0 < p(x) always accepts, p(x) == 0
  never accepts, and p(x) >= q(x) accepts unless u lies within 2^-53 of 1.
* ``q_draft is None`` means a point-mass drafter (q = delta(x_i), e.g. n-gram / prompt lookup /
  random tokens): accept with probability p_i(x_i); residual = p_i with x_i zeroed. A q row that is an
  exact one-hot gives the identical result through the general formula.
* Ragged rows: row b uses only drafts [0, num_draft[b]) (num_draft is clamped to [0, K]); the padding
  (any value, e.g. -1) is never accepted and never used as an index. A draft id outside [0, V) inside
  the valid range is treated as p(x) = 0, i.e. always rejected (and, for a point-mass drafter, there is
  then no token to zero in the residual).
* Zero-mass residual (max(0, p - q) == 0 everywhere, i.e. p == q, where rejection has probability 0
  but can be hit numerically): fall back to sampling from p itself.
* Sampling uses ``sample_from_probs`` (inverse CDF on the unnormalised masses, never a
  zero-probability token).
* Output ``tokens`` [B, K+1] int64: accepted drafts at [0, n), the correction / bonus at index n =
  num_accepted, -1 after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import cuda as _cuda
from .sampling import argmax_last, ref_sample_from_probs, sample_from_probs

__all__ = [
    "VerifyResult",
    "verify_greedy",
    "verify_rejection",
    "verify_tree_greedy",
    "verify_tree_rejection",
    "ref_verify_greedy",
    "ref_verify_rejection",
]


@dataclass
class VerifyResult:
    num_accepted: Tensor  # [B] int64, 0..K_b
    tokens: Tensor  # [B, K+1] int64: accepted drafts, then the correction / bonus at num_accepted, then -1


# ----------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------


def _prep(draft_tokens: Tensor, num_draft: Tensor, dists: Tensor) -> tuple[int, int, int, Tensor, Tensor]:
    """Validate shapes; return B, K, V, draft [B, K] int64, nd [B] int64 clamped to [0, K]."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    if dists.dim() != 3 or dists.shape[0] != B or dists.shape[1] != K + 1:
        raise ValueError(f"target must be [B, K+1, V] = [{B}, {K + 1}, V], got {tuple(dists.shape)}")
    V = dists.shape[-1]
    dev = dists.device
    draft = draft_tokens.to(device=dev, dtype=torch.int64)
    nd = torch.as_tensor(num_draft, device=dev).to(torch.int64).reshape(B).clamp(0, K)
    return B, K, V, draft, nd


def _assemble(draft: Tensor, num_acc: Tensor, last: Tensor) -> Tensor:
    """tokens [B, K+1]: draft[:, :n] then ``last`` at index n then -1 (n = num_acc per row)."""
    B, K = draft.shape
    pos = torch.arange(K + 1, device=draft.device)  # [K+1]
    padded = torch.cat([draft, torch.full((B, 1), -1, dtype=torch.int64, device=draft.device)], dim=1)
    tokens = torch.where(pos[None, :] < num_acc[:, None], padded, -1)  # [B, K+1]
    tokens.scatter_(1, num_acc[:, None], last[:, None])
    return tokens


def _num_leading_true(mask: Tensor) -> Tensor:
    """[B, K] bool -> [B] int64: length of the all-True prefix of each row."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.int64, device=mask.device)
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(dim=1)


# ----------------------------------------------------------------------------------------------
# greedy
# ----------------------------------------------------------------------------------------------


def verify_greedy(draft_tokens: Tensor, num_draft: Tensor, target_logits: Tensor) -> VerifyResult:
    """Greedy verification. draft_tokens [B, K] int64, num_draft [B], target_logits [B, K+1, V]
    (logits or probabilities: only argmax is used; ties -> lowest index)."""
    B, K, V, draft, nd = _prep(draft_tokens, num_draft, target_logits)
    if target_logits.is_cuda and B > 0 and _cuda.available():
        num_acc, tokens = _cuda.verify_greedy_cuda(draft, nd, target_logits)
        return VerifyResult(num_acc, tokens)
    argmax = argmax_last(target_logits)  # [B, K+1]
    valid = torch.arange(K, device=draft.device)[None, :] < nd[:, None]  # [B, K]
    match = valid & (draft == argmax[:, :K])  # [B, K]
    num_acc = _num_leading_true(match)  # [B]
    last = argmax.gather(1, num_acc[:, None]).squeeze(1)  # [B] correction / bonus
    return VerifyResult(num_acc, _assemble(draft, num_acc, last))


def ref_verify_greedy(draft_tokens: Tensor, num_draft: Tensor, target_logits: Tensor) -> VerifyResult:
    """Reference greedy verification: loop over rows and positions."""
    B, K, V, draft, nd = _prep(draft_tokens, num_draft, target_logits)
    num_acc = torch.zeros(B, dtype=torch.int64)
    tokens = torch.full((B, K + 1), -1, dtype=torch.int64)
    for b in range(B):
        n = int(nd[b])
        i = 0
        while True:
            best = int(torch.argmax(target_logits[b, i]))  # target's choice at position i
            if i < n and int(draft[b, i]) == best:
                tokens[b, i] = best  # draft agrees: accept and continue
                i += 1
                continue
            tokens[b, i] = best  # correction (i < n) or bonus (i == n)
            num_acc[b] = i
            break
    return VerifyResult(num_acc.to(target_logits.device), tokens.to(target_logits.device))


# ----------------------------------------------------------------------------------------------
# rejection sampling (lossless)
# ----------------------------------------------------------------------------------------------


def verify_rejection(
    draft_tokens: Tensor,
    num_draft: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    u_accept: Tensor,
    u_sample: Tensor,
) -> VerifyResult:
    """Lossless speculative-sampling verification of a ragged batch.

    draft_tokens [B, K] int64 (padding beyond num_draft[b] may be anything, e.g. -1)
    num_draft    [B] int64
    p_target     [B, K+1, V] filtered target probabilities (row i = distribution of the token after
                 the prefix plus drafts x_1..x_i)
    q_draft      [B, K, V] the distributions the drafts were sampled from, or None (point-mass drafter)
    u_accept     [B, K] uniforms for the acceptance tests; u_sample [B] uniform for the final sample.
    """
    B, K, V, draft, nd = _prep(draft_tokens, num_draft, p_target)
    dev = p_target.device
    if q_draft is not None and (q_draft.shape[0] != B or q_draft.shape[1] != K or q_draft.shape[2] != V):
        raise ValueError(f"q_draft must be [B, K, V] = [{B}, {K}, {V}], got {tuple(q_draft.shape)}")
    q_draft = None if q_draft is None else q_draft.to(dev)
    u_accept, u_sample = u_accept.to(dev), u_sample.to(dev)  # drawn on the host from per-request generators
    if p_target.is_cuda and B > 0 and _cuda.available():
        num_acc, tokens = _cuda.verify_rejection_cuda(draft, nd, p_target, q_draft, u_accept, u_sample)
        return VerifyResult(num_acc, tokens)

    p = p_target.float()  # [B, K+1, V]
    pos = torch.arange(K, device=dev)  # [K]
    valid = pos[None, :] < nd[:, None]  # [B, K]
    in_vocab = (draft >= 0) & (draft < V)  # [B, K]
    x = torch.where(valid & in_vocab, draft, 0)  # [B, K] safe gather index
    p_x = p[:, :K].gather(2, x[:, :, None]).squeeze(2)  # [B, K]
    p_x = torch.where(in_vocab, p_x, 0.0)
    if q_draft is None:
        q_x = torch.ones_like(p_x)  # point mass: q(x) = 1
    else:
        q_x = q_draft.float().gather(2, x[:, :, None]).squeeze(2)  # [B, K]
    accept = valid & (u_accept.to(dev).double() * q_x.double() < p_x.double())  # [B, K]
    num_acc = _num_leading_true(accept)  # [B]

    rows = torch.arange(B, device=dev)
    p_j = p[rows, num_acc]  # [B, V] target distribution at the stop position
    rejected = num_acc < nd  # [B] stopped by a rejection (else: all K_b accepted -> bonus)
    if K > 0:
        jq = num_acc.clamp(max=K - 1)  # [B] (only meaningful where rejected)
        if q_draft is None:
            x_j = x[rows, jq]  # [B]
            zero_x = rejected & in_vocab[rows, jq]  # [B]
            hit = torch.arange(V, device=dev)[None, :] == x_j[:, None]  # [B, V]
            residual = torch.where(hit & zero_x[:, None], 0.0, p_j)  # [B, V] p with x zeroed
        else:
            residual = (p_j - q_draft.float()[rows, jq]).clamp(min=0.0)  # [B, V] max(0, p - q)
        use_res = rejected & (residual > 0).any(dim=1)  # zero-mass residual -> fall back to p
        dist = torch.where(use_res[:, None], residual, p_j)  # [B, V]
    else:
        dist = p_j
    last = sample_from_probs(dist, u_sample.to(dev))  # [B]
    return VerifyResult(num_acc, _assemble(draft, num_acc, last))


def ref_verify_rejection(
    draft_tokens: Tensor,
    num_draft: Tensor,
    p_target: Tensor,
    q_draft: Tensor | None,
    u_accept: Tensor,
    u_sample: Tensor,
) -> VerifyResult:
    """Reference rejection verification: loop over rows, then left to right over that row's drafts."""
    B, K, V, draft, nd = _prep(draft_tokens, num_draft, p_target)
    p_all = p_target.float().cpu()
    q_all = None if q_draft is None else q_draft.float().cpu()
    ua = u_accept.cpu()
    us = u_sample.cpu()
    num_acc = torch.zeros(B, dtype=torch.int64)
    tokens = torch.full((B, K + 1), -1, dtype=torch.int64)
    for b in range(B):
        n = int(nd[b])
        i = 0
        final_dist = p_all[b, n]  # default: all n drafts accepted -> bonus from p_{n+1} (row index n)
        while i < n:
            x = int(draft[b, i])
            valid_x = 0 <= x < V
            p_x = float(p_all[b, i, x]) if valid_x else 0.0  # invalid id: p(x) = 0 -> never accepted
            q_x = 1.0 if q_all is None else (float(q_all[b, i, x]) if valid_x else 0.0)
            # accept with probability min(1, p(x) / q(x)), written without division
            if float(ua[b, i]) * q_x < p_x:
                tokens[b, i] = x
                i += 1
                continue
            # first rejection at position i: residual norm(max(0, p_i - q_i))
            if q_all is None:
                residual = p_all[b, i].clone()
                if valid_x:
                    residual[x] = 0.0  # point mass: p_i with x zeroed
            else:
                residual = (p_all[b, i] - q_all[b, i]).clamp(min=0.0)
            final_dist = residual if bool((residual > 0).any()) else p_all[b, i]
            break
        tokens[b, i] = int(ref_sample_from_probs(final_dist[None], us[b : b + 1])[0])
        num_acc[b] = i
    return VerifyResult(num_acc.to(p_target.device), tokens.to(p_target.device))


# ----------------------------------------------------------------------------------------------
# tree verification (one sequence)
# ----------------------------------------------------------------------------------------------


def _as_int_list(x: Tensor | Sequence[int]) -> list[int]:
    if isinstance(x, Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _children(parents: list[int]) -> dict[int, list[int]]:
    """node -> children in index order; key -1 is the root. Requires parents[i] < i."""
    kids: dict[int, list[int]] = {-1: []}
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"parents[{i}] = {par}: must be -1 (root) or an earlier node index")
        kids.setdefault(par, []).append(i)
        kids.setdefault(i, [])
    return kids


def verify_tree_greedy(
    tree_tokens: Tensor | Sequence[int],
    parents: Tensor | Sequence[int],
    p_root: Tensor,
    p_nodes: Tensor,
) -> tuple[list[int], int]:
    """Greedy tree verification.

    tree_tokens [N], parents [N] (-1 = child of the root, parents[i] < i),
    p_root [V] target logits/probs for the first new token, p_nodes [N, V] target logits/probs after
    each node. Walk from the root: descend into the (first, by index) child whose token is the argmax;
    stop when none matches. Returns (accepted node path from the root, next token = argmax at the end).
    """
    toks = _as_int_list(tree_tokens)
    kids = _children(_as_int_list(parents))
    path: list[int] = []
    node = -1
    dist = p_root
    while True:
        best = int(torch.argmax(dist))
        nxt = next((c for c in kids[node] if toks[c] == best), None)
        if nxt is None:
            return path, best
        path.append(nxt)
        node = nxt
        dist = p_nodes[nxt]


def verify_tree_rejection(
    tree_tokens: Tensor | Sequence[int],
    parents: Tensor | Sequence[int],
    p_root: Tensor,
    p_nodes: Tensor,
    q_root: Tensor | None,
    q_nodes: Tensor | None,
    uniforms: Tensor,
) -> tuple[list[int], int]:
    """Lossless tree verification by recursive rejection sampling over siblings (SpecInfer / EAGLE).

    tree_tokens [N] int, parents [N] (-1 = child of the root; parents[i] < i).
    p_root [V]: filtered target distribution of the first new token; p_nodes [N, V]: after node i.
    q_root [V] / q_nodes [N, V]: draft distributions, or both None.
    uniforms [N+1] in [0, 1): uniforms[i] is node i's acceptance test (each node is tested at most
    once), uniforms[N] drives the single final sample (correction or bonus).

    Which q applies to siblings:
    * q given (i.i.d. mode): the children of a node were drawn i.i.d. (with replacement) from that
      node's draft distribution (q_root for the root's children, q_nodes[n] for node n's children).
      Every sibling is tested against the SAME parent q and the current residual r:
      accept c with min(1, r(x_c) / q(x_c)); on rejection r <- norm(max(0, r - q)).
    * q None (point-mass mode): siblings are distinct deterministic tokens (e.g. the draft's top-k),
      each treated as its own point mass delta(x_c): accept with probability r(x_c); on rejection
      r <- r with x_c zeroed, renormalised. Do NOT pass a q for deterministic top-k siblings: the
      i.i.d. rule is not lossless for them.
    If a child is accepted, descend into it with r = p_nodes[child]; if every child is rejected sample
    the next token from the residual r. An accepted leaf samples the bonus from p_nodes[leaf].

    Implementation detail: r is kept unnormalised together with its mass ``tot`` (tot = 1 for a fresh
    p row), and the test is u * q(x) * tot < r(x) in float64. For a chain (one child per node) this is
    exactly ``verify_rejection`` with u_accept = uniforms[:N], u_sample = uniforms[N].
    Zero-mass residual guard: keep the previous r.
    Returns (accepted node path from the root, next token).
    """
    toks = _as_int_list(tree_tokens)
    N = len(toks)
    kids = _children(_as_int_list(parents))
    if (q_root is None) != (q_nodes is None):
        raise ValueError("q_root and q_nodes must both be given (i.i.d. siblings) or both None (point mass)")
    us = [float(v) for v in uniforms.reshape(-1).double().tolist()]
    if len(us) < N + 1:
        raise ValueError(f"need N+1 = {N + 1} uniforms, got {len(us)}")
    V = p_root.shape[-1]

    path: list[int] = []
    node = -1
    r = p_root.float()  # [V] current (unnormalised) target distribution
    tot = 1.0  # its mass; a fresh p row is taken as normalised
    q = None if q_root is None else q_root.float()  # [V] parent's draft distribution
    while True:
        accepted = None
        for c in kids[node]:
            x = toks[c]
            valid_x = 0 <= x < V
            r_x = float(r[x]) if valid_x else 0.0
            q_x = 1.0 if q is None else (float(q[x]) if valid_x else 0.0)
            if us[c] * q_x * tot < r_x:  # accept with prob min(1, (r(x)/tot) / q(x))
                accepted = c
                break
            if q is None:
                new_r = r.clone()
                if valid_x:
                    new_r[x] = 0.0  # point mass delta(x): zero it out
            else:
                new_r = (r - q * tot).clamp(min=0.0)  # norm(max(0, r/tot - q)) up to scale
            if bool((new_r > 0).any()):
                r = new_r
                tot = float(r.double().sum())
        if accepted is None:
            nxt = int(sample_from_probs(r[None], uniforms.reshape(-1)[N : N + 1])[0])
            return path, nxt
        path.append(accepted)
        node = accepted
        r = p_nodes[accepted].float()
        tot = 1.0
        q = None if q_nodes is None else q_nodes[accepted].float()
