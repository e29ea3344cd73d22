"""A tensor-parallel target over Ray: one actor per rank, and `TPHandle`, which the coordinator uses as one worker.

`start_tp_target` starts the ranks (each loads the model and keeps its shard), asks rank 0 for a free
TCP port on its node, and has every rank join the torch.distributed group there (gloo on CPU, NCCL
on CUDA). `TPHandle.call` sends each call to every rank, in the same order on every rank (a lock
keeps concurrent callers from interleaving, which would deadlock the ranks' collectives), and
resolves to rank 0's result once every rank has finished; an error or death on any rank surfaces
as soon as it happens. Methods without collectives or state (`info`, `ping`, ...) go to rank 0 only.

Passing a TPHandle future to another worker's call passes rank 0's ObjectRef. A TP target cannot
be restarted rank by rank (the group would have to re-form): a dead rank is a dead target.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from ssd.handles import WorkerDied
from ssd.launch.actors import RayFuture, RayHandle, remove_placement_group_quietly
from ssd.workers.tp_worker import TPTargetWorker


class RayTPTargetWorker(TPTargetWorker):
    def free_tcp_address(self) -> str:
        """tcp://<this node's IP>:<a port free right now> for the process group's rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"



class TPFuture(RayFuture):
    """Rank 0's result of a call made on every rank; `.ref` is rank 0's ObjectRef."""

    def __init__(self, futures: list[RayFuture], handle: TPHandle) -> None:
        super().__init__(futures[0].ref, handle)  # type: ignore[arg-type]
        self.futures = futures

    def result(self, timeout: float | None = None) -> Any:
        by_ref = {f.ref: f for f in self.futures}
        pending = list(by_ref)
        result: Any = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left, fetch_local=False)
            if not ready:
                raise TimeoutError(f"{self.handle.name}: no result from every rank after {timeout} s")
            for r in ready:  # the first rank to fail raises its error (or WorkerDied) at once
                value = by_ref[r].result()
                if r == self.ref:
                    result = value
        return result

    def done(self) -> bool:
        ready, _ = ray.wait([f.ref for f in self.futures], num_returns=len(self.futures), timeout=0,
                            fetch_local=False)
        return len(ready) == len(self.futures)


class TPHandle:
    """WorkerHandle over the ranks of a tensor-parallel target (see the module docstring)."""

    rank0_only = frozenset({"info", "ping", "tokenizer_obj", "num_free_slots", "free_tcp_address"})

    def __init__(self, ranks: list[RayHandle], name: str = "target", placement_group: Any = None) -> None:
        self.ranks = ranks
        self.name = name
        self.tp_size = len(ranks)
        self._pg = placement_group
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, **kwargs: Any) -> RayFuture:
        if method in self.rank0_only:
            return self.ranks[0].call(method, *args, **kwargs)
        return TPFuture(self.call_all(method, *args, **kwargs), self)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[RayFuture]:
        """The call on every rank; one future per rank."""
        with self._lock:
            return [h.call(method, *args, **kwargs) for h in self.ranks]

    def call_split(self, method: str, n: int, *args: Any, **kwargs: Any) -> list[RayFuture]:
        with self._lock:
            per_rank = [h.call_split(method, n, *args, **kwargs) for h in self.ranks]
        return [TPFuture([parts[i] for parts in per_rank], self) for i in range(n)]

    def _died(self, e: BaseException) -> WorkerDied:
        return WorkerDied(self.name, e)

    def alive(self, timeout: float = 5.0) -> bool:
        return all(h.alive(timeout) for h in self.ranks)

    def shutdown(self) -> None:
        for h in self.ranks:
            h.shutdown()
        remove_placement_group_quietly(self._pg)
        self._pg = None


def start_tp_target(
    spawns: list[Callable[[], Any]], name: str = "target", placement_group: Any = None,
    timeout: float | None = None,
) -> TPHandle:
    """Start one actor per rank (`spawns[r]()` starts rank r), form the process group, return the handle.

    On failure every rank started is killed (the placement group is left to the caller).
    """
    ranks: list[RayHandle] = []
    try:
        for spawn in spawns:
            ranks.append(RayHandle(spawn(), name))
        handle = TPHandle(ranks, name)
        address = ranks[0].call("free_tcp_address").result(timeout)
        handle.call("init_tp", address).result(timeout)
    except BaseException:
        for h in ranks:
            h.shutdown()
        raise
    handle._pg = placement_group
    return handle
