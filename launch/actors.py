"""Workers as Ray actors, and `RayHandle`, the WorkerHandle the coordinator uses to call them.

`workers/` knows nothing about Ray: `actor_class(TargetWorker)` wraps the plain class at launch
time in a thin subclass (registers the tensor and message serializers, reports placement in
`info()`, hands out the tokenizer) and turns it into a Ray actor class.

Calls: on the driver's node a handle made with `channel=True` (placement.py's default, `ray_channel`)
calls its actor over a Unix socket the actor serves (launch/channel.py: ~2 ms less per call than a Ray
task); otherwise `RayHandle.call` returns a `RayFuture`. Passing a RayFuture (or several, e.g. from
`call_split`) as a top-level argument of a Ray call hands the ObjectRef to Ray, so the value goes from
one actor to the other through the object store without visiting the driver; a channel's futures are
resolved by the driver.

Failures: an actor that died, is unreachable, or whose node died surfaces as
`ssd.handles.WorkerDied(name, cause)`, named after the worker that failed (a verify that fails
because the draft that produced its argument died names the draft). Exceptions raised by the
worker code itself propagate as themselves (Ray's RayTaskError subclasses the original type).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray import exceptions as rex

from ssd.handles import WorkerDied
from ssd.launch.channel import ChannelClient, ChannelFuture, ChannelServer
from ssd.launch.wire import Payload, tensor_from_wire, tensor_to_wire
from ssd.workers.messages import WIRE_TYPES

log = logging.getLogger("ssd")

# actor id (hex) -> worker name, so an error raised by a dependency blames the right worker
_ACTOR_NAMES: dict[str, str] = {}

_DEATH = (
    rex.RayActorError,  # ActorDiedError, ActorUnavailableError
    rex.ActorUnschedulableError,
    rex.WorkerCrashedError,
    rex.NodeDiedError,
    rex.LocalRayletDiedError,
    rex.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError, ...: its producer is gone
    rex.ActorPlacementGroupRemoved,
)


# -- tensors through the object store ----------------------------------------------------------
# Numpy payloads (launch/wire.py). Against a 100-200 ms CPU verify a gloo channel's saving over the object
# store is a few %, not worth a second, blocking channel to keep paired and re-rendezvous after a draft
# restart; so without the call channel q goes through the object store, actor to actor
# (RayHandle.call_split + passing the future).


def _tensor_from_wire(payload: Payload) -> torch.Tensor:
    return tensor_from_wire(*payload)


def register_serializers() -> None:
    """Per process: torch.Tensor (exact type; nn.Parameter keeps torch's path) crosses as numpy, and
    the typed messages (Draft, Outcome, SamplingSpec) as their msgpack bytes."""
    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_wire, deserializer=_tensor_from_wire)
    for cls in WIRE_TYPES:
        ray.util.register_serializer(cls, serializer=cls.to_msgpack, deserializer=cls.from_msgpack)


# -- actor classes -------------------------------------------------------------------------------


def _placement() -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "node_id": ctx.get_node_id(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),  # see launch/placement.py (OpenMP in CPU actors)
    }


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\w*: ", re.MULTILINE)


def creation_error(e: BaseException) -> str | None:
    """The exception an actor's constructor raised ("ValueError: ..."), from Ray's ActorDiedError, which
    carries it only as the text of the remote traceback; None for any other death."""
    if not getattr(e, "actor_init_failed", False):
        return None
    text = _ANSI.sub("", str(getattr(e, "error_msg", "") or ""))
    raised = list(_RAISED.finditer(text))  # the last: a chained traceback names its causes first
    return text[raised[-1].start():].strip() if raised else None


def actor_class(worker_cls: type) -> Any:
    """`ray.remote` of a thin subclass of `worker_cls` (TargetWorker, DraftWorker, ...)."""

    class Actor(worker_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            register_serializers()
            super().__init__(*args, **kwargs)

        def info(self) -> dict:
            return {**super().info(), **_placement()}

        def tokenizer_obj(self) -> Any:
            return self.tokenizer

        def open_channel(self, node_id: str) -> str | None:
            """Serve this actor's calls on a Unix socket (launch/channel.py) for a coordinator on node
            `node_id`; None (keep Ray's calls) when this actor runs on another node."""
            if node_id != ray.get_runtime_context().get_node_id():
                return None
            self._channel_server = ChannelServer(self)
            return self._channel_server.path

    Actor.__name__ = Actor.__qualname__ = worker_cls.__name__
    return ray.remote(Actor)


# -- handle --------------------------------------------------------------------------------------


class RayFuture:
    """The result of one actor call. `.ref` is the ObjectRef (pass the future itself to `call`)."""

    def __init__(self, ref: ray.ObjectRef, handle: RayHandle) -> None:
        self.ref = ref
        self.handle = handle

    def result(self, timeout: float | None = None) -> Any:
        try:
            return ray.get(self.ref, timeout=timeout)
        except rex.GetTimeoutError as e:
            raise TimeoutError(f"{self.handle.name}: no result after {timeout} s") from e
        except _DEATH as e:
            raise self.handle._died(e) from e

    def done(self) -> bool:
        ready, _ = ray.wait([self.ref], timeout=0, fetch_local=False)
        return bool(ready)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 - mirrors concurrent.futures.Future.exception
            return e
        return None


def _ref(a: Any) -> Any:
    if isinstance(a, ChannelFuture):  # a channel call's value goes through the driver
        return a.result()
    return a.ref if isinstance(a, RayFuture) else a


class RayHandle:
    """WorkerHandle over a Ray actor.

    `spawn()` (optional) builds a replacement actor for `restart()`; `placement_group` (optional)
    is removed by `shutdown()` (give it to the handle shut down last). `channel=True`: calls go over a
    Unix socket the actor serves (launch/channel.py) when it runs on the driver's node, Ray's calls
    otherwise; the channel opens on the first call, so building two actors still overlaps.
    """

    def __init__(
        self, actor: Any, name: str, spawn: Callable[[], Any] | None = None, placement_group: Any = None,
        channel: bool = False,
    ) -> None:
        self.name = name
        self._spawn = spawn
        self._pg = placement_group
        self._closed = False
        self._use_channel = channel
        self._channel_lock = threading.Lock()  # the first call may come from two threads (recovery's restart)
        self._starting: Any = None  # a replacement actor restart() is waiting for
        self._adopt(actor)

    def _adopt(self, actor: Any) -> None:
        with self._channel_lock:
            self._adopt_locked(actor)

    def _adopt_locked(self, actor: Any) -> None:
        self.actor = actor
        _ACTOR_NAMES[actor._actor_id.hex()] = self.name
        # The path first: a call that finds it set waits on the lock instead of taking Ray's calls.
        self._channel_path = (actor.open_channel.remote(ray.get_runtime_context().get_node_id())
                              if self._use_channel else None)
        self._channel: ChannelClient | None = None

    @property
    def via_channel(self) -> bool:
        """Whether calls go over the channel (opens it if still pending)."""
        return self._open_channel() is not None

    def _open_channel(self) -> ChannelClient | None:
        if self._channel_path is None:
            return self._channel
        with self._channel_lock:  # no call may take Ray's path while another opens the channel
            if self._channel_path is None:
                return self._channel
            try:
                path = ray.get(self._channel_path)
            except _DEATH:  # Ray's calls then fail with WorkerDied where their results are read
                path = None
            except Exception as e:  # noqa: BLE001 - e.g. the socket path too long to bind: Ray's calls instead
                log.warning("%s: the actor could not serve a channel (%s); using Ray's calls", self.name, e)
                path = None
            if path is not None:
                try:
                    self._channel = ChannelClient(path, self.name)
                except OSError as e:  # e.g. the actor sees another /tmp: Ray's calls, same results
                    log.warning("%s: cannot connect to the actor's channel at %s (%s); using Ray's calls",
                                self.name, path, e)
            self._channel_path = None
            return self._channel

    def call(self, method: str, *args: Any, **kwargs: Any) -> RayFuture | ChannelFuture:
        channel = self._open_channel()
        if channel is not None:
            return channel.call(method, args, kwargs)
        return RayFuture(self._submit(method, 1, args, kwargs), self)

    def call_split(self, method: str, n: int, *args: Any, **kwargs: Any) -> list[RayFuture] | list[ChannelFuture]:
        """Call a method that returns an n-tuple; one future per element (each its own object)."""
        channel = self._open_channel()
        if channel is not None:
            return channel.call_split(method, n, args, kwargs)
        return [RayFuture(r, self) for r in self._submit(method, n, args, kwargs)]

    def _submit(self, method: str, n: int, args: tuple, kwargs: dict) -> Any:
        fn = getattr(self.actor, method)
        if n != 1:
            fn = fn.options(num_returns=n)
        try:
            return fn.remote(*map(_ref, args), **{k: _ref(v) for k, v in kwargs.items()})
        except _DEATH as e:
            raise self._died(e) from e

    def _died(self, e: BaseException) -> WorkerDied:
        actor_id = getattr(e, "actor_id", None)
        name = _ACTOR_NAMES.get(actor_id, self.name) if actor_id else self.name
        return WorkerDied(name, e, startup_error=creation_error(e))

    def alive(self, timeout: float = 5.0) -> bool:
        try:
            return bool(ray.get(self.actor.ping.remote(), timeout=timeout))
        except Exception:  # noqa: BLE001 - dead, unreachable or too slow: not alive
            return False

    def restart(self, timeout: float | None = 300.0) -> RayHandle:
        """Replace the actor with a fresh one from the same arguments (empty state); wait until it is up."""
        if self._spawn is None:
            raise RuntimeError(f"{self.name}: this handle cannot restart its actor")
        self._kill()
        actor = self._starting = self._spawn()  # shutdown() meanwhile kills it too
        try:
            ray.get(actor.ping.remote(), timeout=timeout)
            with self._channel_lock:  # no shutdown between this check and adopting the actor
                if self._closed:
                    raise RuntimeError(f"{self.name}: shut down while restarting")
                self._starting = None
                self._adopt_locked(actor)
        except BaseException as e:
            self._starting = None
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - never came up
                pass
            if isinstance(e, _DEATH):
                raise WorkerDied(self.name, e) from e
            raise
        return self

    def _kill(self) -> None:
        if self._channel is not None:
            self._channel.close()
        elif self._channel_path is not None:  # served but never connected: the killed actor leaves its socket
            try:
                path = ray.get(self._channel_path, timeout=0)
            except Exception:  # noqa: BLE001 - not served yet, or the actor is gone
                path = None
            if path is not None:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def shutdown(self) -> None:
        self._closed = True
        try:  # first: a call opening the channel holds the lock while it waits for this actor to come up
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        with self._channel_lock:
            self._closed = True
        starting = self._starting
        if starting is not None:  # a replacement still starting (restart waits for it in another thread)
            try:
                ray.kill(starting, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._kill()
        remove_placement_group_quietly(self._pg)
        self._pg = None


def remove_placement_group_quietly(pg: object | None) -> None:
    """Release a placement group; a cluster that is already gone is not an error at shutdown."""
    if pg is None:
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - cluster already gone
        pass
