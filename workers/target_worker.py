"""TargetWorker: owns the target model; verifies speculations and emits tokens (AR = empty draft)."""

from __future__ import annotations

import time

import torch

from ssd.kernels.sampling import filter_logits
from ssd.kernels.verify import verify_greedy, verify_rejection, verify_tree_greedy, verify_tree_rejection
from ssd.workers.base import ModelWorker
from ssd.workers.messages import Draft, Outcome
from ssd.workers.seq_state import uniforms
from ssd.workers.subset_q import QDraft, dense_q, write_q


class TargetWorker(ModelWorker):
    salt = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last_verify_s = 0.0

    def verify(
        self, drafts: list[Draft], q_draft: list[QDraft | None] | None = None, borrow: bool = False
    ) -> list[Outcome]:
        """Score [pending] + draft tokens for each sequence in one forward and verify losslessly.

        q_draft[b] is [K_b, V] (the exact distribution each draft token was sampled from), or a SubsetQ of its
        columns, for drafts of q_kind "dist"; ignored otherwise. `borrow`: also compute on the draft's cores
        (`spare_cores`), which the coordinator asks for only while the draft has nothing to do.
        """
        with self._cores(borrow):
            return self._verify(drafts, q_draft)

    def decode(self, seq_ids: list[int], steps: list[int], stop_ids: list[list[int]]) -> list[Outcome]:
        """Plain decoding of up to steps[b] tokens for sequence seq_ids[b] in one call (one actor round trip
        instead of one per token). Each step is a verification of no drafted tokens, so the tokens and every
        sequence's random draws are those of as many one-token rounds. A sequence stops after a token in its
        stop_ids (the coordinator's eos and stop tokens); the coordinator applies stop strings."""
        if not (len(seq_ids) == len(steps) == len(stop_ids)):
            raise ValueError("decode needs one step count and one stop list per sequence")
        out: dict[int, list[int]] = {sid: [] for sid in seq_ids}
        left = dict(zip(seq_ids, steps))
        stops = {sid: set(ids) for sid, ids in zip(seq_ids, stop_ids)}
        active = [sid for sid in seq_ids if left[sid] > 0]
        while active:
            for o in self.verify([Draft(seq_id=sid) for sid in active]):
                out[o.seq_id].extend(o.tokens)
                left[o.seq_id] -= len(o.tokens)
            active = [sid for sid in active if left[sid] > 0 and out[sid][-1] not in stops[sid]]
        return [Outcome(seq_id=sid, num_accepted=0, tokens=out[sid]) for sid in seq_ids]

    def _verify(self, drafts: list[Draft], q_draft: list[QDraft | None] | None) -> list[Outcome]:
        t0 = time.perf_counter()
        if q_draft is None:
            q_draft = [None] * len(drafts)
        self._check_q(drafts, q_draft)
        chains = [i for i, d in enumerate(drafts) if d.parents is None]
        trees = [i for i, d in enumerate(drafts) if d.parents is not None]
        out: list[Outcome | None] = [None] * len(drafts)
        if chains:
            for i, o in zip(chains, self._verify_chains([drafts[i] for i in chains], [q_draft[i] for i in chains])):
                out[i] = o
        if trees:
            for i, o in zip(trees, self._verify_trees([drafts[i] for i in trees], [q_draft[i] for i in trees])):
                out[i] = o
        self.last_verify_s = time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def _check_q(self, drafts: list[Draft], q_draft: list[QDraft | None]) -> None:
        """Before any forward: a sampled "dist" draft's q is [K, V] for a chain, [N + 1, V] for a tree."""
        V = self.config.vocab_size
        for d, q in zip(drafts, q_draft):
            if d.q_kind != "dist" or not d.tokens or self.seqs[d.seq_id].spec.greedy:
                continue
            rows = len(d.tokens) + (d.parents is not None)
            if q is None or tuple(q.shape) != (rows, V):
                got = None if q is None else tuple(q.shape)
                raise ValueError(f"sequence {d.seq_id}: q_draft must be [{rows}, {V}], got {got}")

    def _verify_chains(self, drafts: list[Draft], q_draft: list[QDraft | None]) -> list[Outcome]:
        states = [self.seqs[d.seq_id] for d in drafts]
        blocks = [[st.pending, *d.tokens] for st, d in zip(states, drafts)]
        logits = self.runner.forward([st.slot for st in states], blocks)  # [B, K+1, V]
        B, n, V = logits.shape
        K = n - 1
        dev = logits.device  # small inputs go to the logits' device; results come back in one read
        draft_tokens = torch.full((B, max(K, 1)), -1, dtype=torch.long)  # [B, K] padded with -1
        for b, d in enumerate(drafts):
            draft_tokens[b, : len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
        draft_tokens = draft_tokens[:, :K].to(dev)
        num_draft = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long, device=dev)

        num_acc = torch.zeros(B, dtype=torch.long, device=dev)
        tokens = torch.zeros(B, K + 1, dtype=torch.long, device=dev)
        greedy = [b for b, st in enumerate(states) if st.spec.greedy]
        sampled = [b for b, st in enumerate(states) if not st.spec.greedy]
        if greedy:
            g = torch.tensor(greedy, device=dev) if sampled else slice(None)  # all rows: no copies
            res = verify_greedy(draft_tokens[g], num_draft[g], logits[g])
            num_acc[g], tokens[g] = res.num_accepted, res.tokens
        if sampled:
            s = torch.tensor(sampled, device=dev) if greedy else slice(None)
            specs = [states[b].spec for b in sampled]
            p_target = filter_logits(
                logits[s],
                torch.tensor([sp.temperature for sp in specs], dtype=torch.float32, device=dev),
                torch.tensor([sp.top_k for sp in specs], dtype=torch.long, device=dev),
                torch.tensor([sp.top_p for sp in specs], dtype=torch.float32, device=dev),
            )  # [Bs, K+1, V]
            q = torch.zeros(len(sampled), K, V, dtype=torch.float32, device=dev)  # [Bs, K, V]
            u_accept = torch.zeros(len(sampled), K, dtype=torch.float64)
            u_sample = torch.zeros(len(sampled), dtype=torch.float64)
            for row, b in enumerate(sampled):
                d, kb = drafts[b], len(drafts[b].tokens)
                if kb:
                    if d.q_kind == "dist":  # its shape checked by _check_q
                        write_q(q[row, :kb], q_draft[b])
                    else:  # point mass: a drafter without probabilities
                        q[row, torch.arange(kb, device=dev), torch.tensor(d.tokens, device=dev)] = 1.0
                # Fixed draw pattern per sequence: reproducible whatever else is in the batch.
                gen = states[b].gen
                u_accept[row, :kb] = uniforms(gen, kb)
                u_sample[row] = uniforms(gen, 1)[0]
            res = verify_rejection(draft_tokens[s], num_draft[s], p_target, q, u_accept, u_sample)
            num_acc[s], tokens[s] = res.num_accepted, res.tokens

        outcomes = []
        num_acc_l, tokens_l = num_acc.tolist(), tokens.tolist()
        for b, (st, d) in enumerate(zip(states, drafts)):
            k = num_acc_l[b]
            emitted = tokens_l[b][: k + 1]
            st.committed += 1 + k  # pending + accepted drafts now committed in the cache
            self.runner.truncate(st.slot, st.committed)
            st.pending = emitted[-1]
            outcomes.append(Outcome(seq_id=d.seq_id, num_accepted=k, tokens=emitted))
        return outcomes

    def _verify_trees(self, drafts: list[Draft], q_draft: list[QDraft | None]) -> list[Outcome]:
        """Verify token trees, all scored in one forward: [pending] is node 0, tree node i is node i + 1.

        q_draft[b] (q_kind "dist") is [N+1, V]: row 0 is the distribution the root's children were
        drawn from, row 1 + i the one node i's children were drawn from (i.i.d. siblings). Without
        it, siblings are distinct point masses (e.g. the draft's top-k).
        """
        states = [self.seqs[d.seq_id] for d in drafts]
        blocks = [[st.pending, *d.tokens] for st, d in zip(states, drafts)]
        parents = [[-1] + [p + 1 if p >= 0 else 0 for p in d.parents or []] for d in drafts]
        logits = self.runner.forward([st.slot for st in states], blocks, parents=parents)  # [B, N+1, V]
        outcomes = []
        for b, (st, d) in enumerate(zip(states, drafts)):
            n = len(d.tokens)
            row = logits[b, : n + 1]  # [N+1, V]
            tree_tokens, tree_parents = list(d.tokens), list(d.parents or [])
            if st.spec.greedy:
                path, nxt = verify_tree_greedy(tree_tokens, tree_parents, row[0], row[1:])
            else:
                sp = st.spec
                p_target = filter_logits(
                    row[None], torch.tensor([sp.temperature]), torch.tensor([sp.top_k]), torch.tensor([sp.top_p])
                )[0]  # [N+1, V]
                u = uniforms(st.gen, 2 * n + 1).to(row.device)  # [2N+1]
                q = dense_q(q_draft[b]).to(row.device) if d.q_kind == "dist" else None  # shape: _check_q
                path, nxt = verify_tree_rejection(
                    tree_tokens, tree_parents, p_target[0], p_target[1:],
                    None if q is None else q[0], None if q is None else q[1:], u,
                )
            self.runner.keep(st.slot, st.committed, [0] + [1 + i for i in path])
            st.committed += 1 + len(path)
            st.pending = int(nxt)
            emitted = [d.tokens[i] for i in path] + [int(nxt)]
            outcomes.append(Outcome(seq_id=d.seq_id, num_accepted=len(path), tokens=emitted, accepted_nodes=list(path)))
        return outcomes
