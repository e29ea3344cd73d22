"""How the coordinator calls a worker: `handle.call(method, *args)` returns a future.

LocalHandle runs the worker in this process on its own thread (torch releases the GIL, so a
draft and a target on separate threads overlap); launch/ provides the Ray actor handle with
the same interface.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol


class WorkerFuture(Protocol):
    def result(self, timeout: float | None = None) -> Any: ...


class WorkerHandle(Protocol):
    name: str

    def call(self, method: str, *args: Any, **kwargs: Any) -> WorkerFuture: ...

    def shutdown(self) -> None: ...


class LocalHandle:
    def __init__(self, worker: Any, name: str) -> None:
        self.worker = worker
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(getattr(self.worker, method), *args, **kwargs)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
