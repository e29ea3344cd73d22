"""How the coordinator calls a worker: `handle.call(method, *args)` returns a future.

LocalHandle runs the worker in this process on its own thread (torch releases the GIL, so a
draft and a target on separate threads overlap); launch/actors.py provides RayHandle, the same
interface over a Ray actor. In-process workers on CUDA take turns instead: a CUDA graph capture
in one thread fails when another thread issues CUDA work meanwhile (seen on an H200 with torch
2.11), and the two share the default stream, so only host-side overlap is lost. Ray actors (own
process, own GPU) keep the overlap.

Both handles accept a future of another call as a top-level argument (the value is used once it
is ready; over Ray it goes actor to actor without visiting the coordinator), and `call_split`
gives one future per element of a tuple-returning method, so e.g. the draft's q tensors can go
straight to the target while the coordinator only fetches the draft tokens.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

_CUDA_TURN = threading.Lock()  # held by an in-process CUDA worker for the whole of each call


class WorkerDied(RuntimeError):
    """A worker process is gone (killed, crashed, its node died), cannot be reached or stopped answering.
    `startup_error`: the error its constructor raised, as text, when that is why (a bad setting, a model that
    cannot load)."""

    def __init__(self, name: str, cause: BaseException | None = None, startup_error: str | None = None) -> None:
        if startup_error:
            super().__init__(f"worker {name!r} failed to start: {startup_error}")
        elif isinstance(cause, TimeoutError):
            super().__init__(f"worker {name!r} stopped answering: {cause}")
        else:
            super().__init__(f"worker {name!r} died: {cause}")
        self.name = name
        self.cause = cause
        self.startup_error = startup_error


class WorkerFuture(Protocol):
    def result(self, timeout: float | None = None) -> Any: ...


class WorkerHandle(Protocol):
    name: str

    def call(self, method: str, *args: Any, **kwargs: Any) -> WorkerFuture: ...

    def call_split(self, method: str, n: int, *args: Any, **kwargs: Any) -> list[WorkerFuture]: ...

    def shutdown(self) -> None: ...


def _resolve(a: Any) -> Any:
    return a.result() if isinstance(a, Future) else a


def split_result(whole: Future, parts: list[Future], method: str) -> None:
    """Complete `parts` with the elements of the tuple `whole` returned (or all with its exception)."""
    exc = whole.exception()
    values = None
    if exc is None:
        try:
            values = tuple(whole.result())
        except TypeError:  # not a tuple: every part fails rather than waiting forever
            exc = TypeError(f"{method} returned {type(whole.result()).__name__}, expected a {len(parts)}-tuple")
    if values is not None and len(values) != len(parts):
        exc, values = ValueError(f"{method} returned {len(values)} values, expected {len(parts)}"), None
    for i, p in enumerate(parts):
        p.set_exception(exc) if values is None else p.set_result(values[i])


class LocalHandle:
    def __init__(self, worker: Any, name: str) -> None:
        self.worker = worker
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._turn = _CUDA_TURN if str(getattr(worker, "device", "cpu")).startswith("cuda") else None

    def call(self, method: str, *args: Any, **kwargs: Any) -> Future:
        return self._pool.submit(self._run, getattr(self.worker, method), args, kwargs)

    def _run(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        # Arguments that are futures of the other worker resolve first: never wait for one holding the turn.
        args, kwargs = tuple(map(_resolve, args)), {k: _resolve(v) for k, v in kwargs.items()}
        own = getattr(self.worker, "own_threads", None)  # CPU workers: this thread on the worker's cores
        if own is not None:
            own()
        if self._turn is None:
            return fn(*args, **kwargs)
        with self._turn:
            return fn(*args, **kwargs)

    def call_split(self, method: str, n: int, *args: Any, **kwargs: Any) -> list[Future]:
        parts: list[Future] = [Future() for _ in range(n)]
        self.call(method, *args, **kwargs).add_done_callback(lambda whole: split_result(whole, parts, method))
        return parts

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """Shut down without waiting for a call that never returns (a worker that stopped answering): its
        thread is left to finish, or not, on its own; queued calls are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)
