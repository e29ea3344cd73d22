"""DraftWorker: owns the draft model; proposes K tokens per sequence with their q distributions.

The worker keeps, per sequence, the committed tokens it has not cached yet (`todo`) and the
speculative tokens it fed while drafting (`spec`). On the next proposal it keeps the cached
speculative tokens that were accepted, rolls back the rest and feeds what is missing, so a
rejection costs no recomputation of the prefix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ssd.kernels.sampling import filter_logits, sample_from_probs
from ssd.workers.base import ModelWorker
from ssd.workers.messages import Draft, SamplingSpec
from ssd.workers.seq_state import make_generator


@dataclass
class DraftSeq:
    slot: int
    spec: SamplingSpec
    gen: torch.Generator
    base: int  # committed tokens in the KV cache
    todo: list[int] = field(default_factory=list)  # committed, not cached
    spec_fed: list[int] = field(default_factory=list)  # speculative tokens cached after `base`


class DraftWorker(ModelWorker):
    salt = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dseqs: dict[int, DraftSeq] = {}
        self.last_propose_s = 0.0

    def add(self, seq_id: int, prompt_ids: list[int], spec: SamplingSpec) -> None:
        if seq_id in self.dseqs:
            raise ValueError(f"sequence {seq_id} already added")
        slot = self.runner.allocate()
        self.dseqs[seq_id] = DraftSeq(
            slot=slot, spec=spec, gen=make_generator(spec.seed, self.salt), base=0, todo=list(prompt_ids)
        )

    def remove(self, seq_id: int) -> None:
        st = self.dseqs.pop(seq_id, None)
        if st is not None:
            self.runner.free(st.slot)

    def commit(self, seq_id: int, tokens: list[int]) -> None:
        """Tokens the target emitted for this sequence (accepted drafts + correction/bonus)."""
        self.dseqs[seq_id].todo.extend(tokens)

    def _sync(self, st: DraftSeq) -> list[int]:
        """Reuse cached speculative tokens that got committed; return the committed tokens still to feed."""
        m = 0
        while m < min(len(st.spec_fed), len(st.todo)) and st.spec_fed[m] == st.todo[m]:
            m += 1
        st.base += m
        self.runner.truncate(st.slot, st.base)
        st.spec_fed = []
        todo, st.todo = st.todo[m:], []
        return todo

    def propose(self, requests: list[tuple[int, int]]) -> tuple[list[Draft], list[torch.Tensor | None]]:
        """Draft k tokens for each (seq_id, k). Returns the drafts and, for sampled rows, q [k, V]."""
        t0 = time.perf_counter()
        states = [self.dseqs[sid] for sid, _ in requests]
        ks = [k for _, k in requests]
        feeds = [self._sync(st) for st in states]
        tokens: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Rows with nothing to feed (already cached) need the logits of their last cached token:
        # roll that token back and feed it again, which costs one token in a batched forward.
        for b, st in enumerate(states):
            if not feeds[b]:
                raise RuntimeError(f"draft for sequence {requests[b][0]} has no new committed token to continue from")
        active = [b for b in range(len(requests)) if ks[b] > 0]
        step = 0
        while active:
            slots = [states[b].slot for b in active]
            blocks = [feeds[b] if step == 0 else [tokens[b][-1]] for b in active]
            logits = self.runner.forward(slots, blocks, last_only=True)  # [B, V]
            for b, blk in zip(active, blocks):
                if step == 0:
                    states[b].base += len(blk)
                else:
                    states[b].spec_fed.append(blk[0])
            probs = self._probs(logits, [states[b].spec for b in active])  # [B, V]
            u = torch.stack([torch.rand(1, generator=states[b].gen)[0] for b in active])
            new = sample_from_probs(probs, u)  # [B]
            for row, b in enumerate(active):
                tokens[b].append(int(new[row]))
                if not states[b].spec.greedy:
                    qs[b].append(probs[row])
            step += 1
            active = [b for b in active if len(tokens[b]) < ks[b]]
        # Rows drafting 0 tokens still feed their committed tokens lazily on the next call.
        for b, st in enumerate(states):
            if ks[b] == 0:
                st.todo = feeds[b]
        drafts = []
        q_out: list[torch.Tensor | None] = []
        for b, (sid, _) in enumerate(requests):
            greedy = states[b].spec.greedy
            drafts.append(Draft(seq_id=sid, tokens=tokens[b], q_kind="none" if greedy else "dist"))
            q_out.append(torch.stack(qs[b]) if qs[b] else None)
        self.last_propose_s = time.perf_counter() - t0
        return drafts, q_out

    def _probs(self, logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        return filter_logits(
            logits,
            torch.tensor([s.temperature for s in specs], dtype=torch.float32),
            torch.tensor([s.top_k for s in specs], dtype=torch.long),
            torch.tensor([s.top_p for s in specs], dtype=torch.float32),
        )
