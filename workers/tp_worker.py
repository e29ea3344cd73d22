"""TPTargetWorker: one rank of a tensor-parallel target (workers/models/tensor_parallel.py).

Every rank loads the model, keeps its shard, and runs every call the coordinator makes (the
launcher broadcasts each call to all ranks, in the same order, and returns rank 0's result). The
ranks compute the same logits (replicated LM head on all-reduced hidden states) and draw from the
same per-request generators, so they take the same decisions and their KV caches stay in step:

* `add` with no seed: rank 0's freshly seeded generator state is broadcast to the other ranks.
* `verify`: rank 0's outcomes are broadcast (a few integers) and compared; a rank that disagrees
  (different thread counts or kernels can round the LM head differently, flipping a near tie)
  adopts rank 0's outcome for a chain, whose scored block is still in its cache; for a tree, whose
  cache block has already been compacted, it raises.

The process group is torch.distributed's default group: `dist_init` (an init_method such as
tcp://host:port or file:///path) in the constructor, or `init_tp(init_method)` later (the Ray
launcher first starts every rank, then asks rank 0 for a free port). Backend: gloo on CPU, NCCL on
CUDA unless `dist_backend` says otherwise.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from ssd.workers.base import build_model
from ssd.workers.messages import Draft, Outcome, SamplingSpec
from ssd.workers.models.decoder import DecoderModel
from ssd.workers.models.dense import apply_linear_kernel
from ssd.workers.models.tensor_parallel import shard_model
from ssd.workers.subset_q import QDraft
from ssd.workers.target_worker import TargetWorker

log = logging.getLogger("ssd.tp")


class TPTargetWorker(TargetWorker):
    def __init__(
        self,
        model: str | DecoderModel,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dist_init: str | None = None,
        dist_backend: str | None = None,
        dist_timeout_s: float = 600.0,
        **kwargs,
    ) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside 0..{tp_size - 1}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        device = str(kwargs.get("device", "cpu"))
        self.dist_backend = dist_backend or ("nccl" if device.startswith("cuda") else "gloo")
        self.dist_timeout_s = dist_timeout_s
        self.tp_disagreements = 0  # verify outcomes this rank took from rank 0 instead of its own
        self._comm_device = torch.device("cpu")
        if dist_init is not None:
            self.init_tp(dist_init, device)
        kwargs["cuda_graphs"] = False  # the all-reduces between ranks are not captured
        super().__init__(model, **kwargs)

    # -- process group -----------------------------------------------------------------------------
    def init_tp(self, init_method: str, device: str | None = None) -> bool:
        """Join the tensor-parallel group (blocks until every rank has joined)."""
        if self.tp_size == 1:
            return True
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        if self.dist_backend == "nccl":
            dev = torch.device(device or getattr(self, "device", "cuda"))
            self._comm_device = torch.device("cuda", dev.index or 0)
            torch.cuda.set_device(self._comm_device)
        dist.init_process_group(
            self.dist_backend, init_method=init_method, rank=self.tp_rank, world_size=self.tp_size,
            timeout=timedelta(seconds=self.dist_timeout_s),
        )
        probe = torch.ones(1, device=self._comm_device)
        dist.all_reduce(probe)  # fail here, not in the first forward, if the group is broken
        if int(probe.item()) != self.tp_size:
            raise RuntimeError(f"tensor-parallel group check: all_reduce gave {probe.item()}, not {self.tp_size}")
        return True

    def close_tp(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank (same shape and dtype everywhere)."""
        buf = t.to(self._comm_device, copy=True).contiguous()  # a copy: `t` itself stays this rank's
        dist.broadcast(buf, src=0)
        return buf.cpu()

    # -- model ---------------------------------------------------------------------------------------
    def load_model(
        self, model: str | DecoderModel, dtype: torch.dtype, device: str, quantization: str | None
    ) -> tuple[DecoderModel, object | None]:
        # Unquantised on CUDA: load on the host and move only this rank's shard to the GPU, so a GPU
        # never holds the whole model. Quantised layers are built on their device (packing is per device).
        load_dev = "cpu" if str(device).startswith("cuda") and quantization is None else device
        m, tok = build_model(model, dtype, load_dev, quantization, linear_kernel="torch")
        shard_model(m, self.tp_rank, self.tp_size)
        if load_dev != device:
            m = m.to(device)
        return apply_linear_kernel(m, self.linear_kernel), tok  # after sharding: shard_model slices nn.Linear

    def info(self) -> dict:
        return {**super().info(), "tp_rank": self.tp_rank, "tp_size": self.tp_size, "tp_backend": self.dist_backend,
                "tp_disagreements": self.tp_disagreements}

    # -- calls that must leave every rank in the same state -----------------------------------------
    def add(self, seq_id: int, prompt_ids: list[int], spec: SamplingSpec) -> None:
        super().add(seq_id, prompt_ids, spec)
        if self.tp_size > 1 and spec is not None and spec.seed is None:
            st = self.seqs[seq_id]
            st.gen.set_state(self._broadcast(st.gen.get_state()))

    def verify(
        self, drafts: list[Draft], q_draft: list[QDraft | None] | None = None, borrow: bool = False
    ) -> list[Outcome]:
        outcomes = super().verify(drafts, q_draft, borrow)
        if self.tp_size > 1 and drafts:
            self._agree(drafts, outcomes)
        return outcomes

    def _agree(self, drafts: list[Draft], outcomes: list[Outcome]) -> None:
        """Compare with rank 0's outcomes; adopt them (chains) or raise (trees) where they differ."""
        width = [2 + 2 * len(d.tokens) + 1 for d in drafts]  # k, n tokens, tokens (<= K+1), nodes (<= K)
        rows = []
        for o, w in zip(outcomes, width):
            row = [o.num_accepted, len(o.tokens), *o.tokens, *(o.accepted_nodes or [])]
            rows += row + [-1] * (w - len(row))
        mine = torch.tensor(rows, dtype=torch.long)
        ref = self._broadcast(mine)
        if torch.equal(ref, mine):
            return
        off = 0
        for i, (d, o, w) in enumerate(zip(drafts, outcomes, width)):
            r = ref[off : off + w].tolist()
            off += w
            k0, n0 = r[0], r[1]
            tokens0 = r[2 : 2 + n0]
            if k0 == o.num_accepted and tokens0 == o.tokens:
                continue
            if d.parents is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {self.tp_rank} disagrees with rank 0 on the tree verification of "
                    f"sequence {d.seq_id} ({o.tokens} vs {tokens0}): the ranks' LM heads round differently"
                )
            st = self.seqs[d.seq_id]
            start = st.committed - 1 - o.num_accepted  # the pending token's cache position
            st.committed = start + 1 + k0  # the block [pending, drafts...] is still cached past `start`
            self.runner.kv.lengths[st.slot] = st.committed
            st.pending = tokens0[-1]
            outcomes[i] = Outcome(seq_id=d.seq_id, num_accepted=k0, tokens=tokens0)
            self.tp_disagreements += 1
            log.warning("tp rank %d: took rank 0's outcome for sequence %d (%s, not %s)",
                        self.tp_rank, d.seq_id, tokens0, o.tokens)
