"""launch/channel.py: the Unix-socket call channel between the coordinator and an actor (no Ray here: the
server runs on a thread of this process, or in a child process that the death test kills)."""

import multiprocessing as mp
import os
import stat
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from ssd.handles import WorkerDied
from ssd.launch.channel import ChannelClient, ChannelServer
from ssd.workers.messages import Draft, Outcome
from ssd.workers.subset_q import SubsetQ


class Worker:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.threads_owned = 0
        self.gate = threading.Event()

    def own_threads(self) -> None:
        self.threads_owned += 1

    def echo(self, x):
        return x

    def record(self, tag: str) -> str:
        self.log.append(tag)
        return tag

    def pair(self, a, b):
        return a, b

    def fail(self, msg: str):
        raise ValueError(msg)

    def block(self) -> bool:
        return self.gate.wait(60)

    def sleep(self, s: float) -> float:
        time.sleep(s)
        return s


@pytest.fixture
def served():
    worker = Worker()
    server = ChannelServer(worker)
    client = ChannelClient(server.path, "worker")
    yield worker, server, client
    client.close()


def test_socket_is_private_and_removed_once_connected():
    server = ChannelServer(Worker())
    assert stat.S_IMODE(os.stat(os.path.dirname(server.path)).st_mode) == 0o700
    client = ChannelClient(server.path, "w")
    assert client.call("echo", (1,), {}).result(timeout=10) == 1
    assert not os.path.exists(server.path)  # one connection: nobody else can connect
    client.close()


def test_a_socket_path_too_long_fails_cleanly(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 120)  # AF_UNIX paths hold ~108 bytes
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with pytest.raises(OSError):
        ChannelServer(Worker())
    assert list(deep.iterdir()) == []  # its private directory went with it (RayHandle then uses Ray's calls)


def test_values_tensors_and_messages_roundtrip(served):
    _, _, client = served
    tensors = [torch.randn(3, 5), torch.randn(4, 7).to(torch.bfloat16), torch.arange(6), torch.zeros(0, 3)]
    back = client.call("echo", (tensors,), {}).result(timeout=10)
    for t, b in zip(tensors, back, strict=True):
        assert b.dtype == t.dtype and torch.equal(b, t)
        assert (b.view(torch.int16) if b.dtype == torch.bfloat16 else b).numpy().flags.writeable
    msgs = [Draft(seq_id=1, tokens=[5, 6], q_kind="dist"), Outcome(seq_id=1, num_accepted=1, tokens=[5, 9])]
    assert client.call("echo", (msgs,), {}).result(timeout=10) == msgs
    with pytest.raises(TypeError, match="msgpack wire"):  # what msgpack refuses, the call refuses
        client.call("echo", (Draft(seq_id=2, tokens=[np.int64(3)]),), {}).result(timeout=10)
    assert client.call("echo", ({"k": (1, 2.5, "s")},), {}).result(timeout=10) == {"k": (1, 2.5, "s")}
    q = SubsetQ(torch.rand(3, 4), torch.tensor([0, 2, 7, 9]), 12)  # a restricted draft's q: its columns only
    back = client.call("echo", (q,), {}).result(timeout=10)
    assert isinstance(back, SubsetQ) and torch.equal(back.dense(), q.dense())


def test_worker_errors_keep_their_type_and_the_remote_traceback(served):
    worker, _, client = served
    with pytest.raises(ValueError, match="bad input") as e:
        client.call("fail", ("bad input",), {}).result(timeout=10)
    assert any("remote traceback" in n and "in fail" in n for n in e.value.__notes__)
    with pytest.raises(AttributeError):
        client.call("no_such_method", (), {}).result(timeout=10)
    assert client.call("echo", (7,), {}).result(timeout=10) == 7  # the channel still serves
    assert worker.threads_owned == 3  # every call first takes the worker's cores


def test_calls_run_in_order_even_behind_a_pending_argument(served):
    worker, _, client = served
    gate: Future = Future()
    first = client.call("record", ("a",), {})
    waiting = client.call("record", (gate,), {})  # goes out once its argument is ready
    later = client.call("record", ("c",), {})  # ready, but must not overtake
    time.sleep(0.2)
    assert worker.log == ["a"] and not waiting.done() and not later.done()
    gate.set_result("b")
    assert [f.result(timeout=10) for f in (first, waiting, later)] == ["a", "b", "c"]
    assert worker.log == ["a", "b", "c"]
    assert client.call("record", ("d",), {}).result(timeout=10) == "d"  # back to sending inline


def test_split_results_and_failed_arguments(served):
    _, _, client = served
    a, b = client.call_split("pair", 2, (1,), {"b": [2]})
    assert (a.result(timeout=10), b.result(timeout=10)) == (1, [2])
    x, y, z = client.call_split("pair", 3, (1, 2), {})
    with pytest.raises(ValueError, match="expected 3"):
        x.result(timeout=10)
    bad: Future = Future()
    bad.set_exception(WorkerDied("draft", RuntimeError("gone")))
    with pytest.raises(WorkerDied) as e:  # the producer's death names the producer
        client.call("echo", (bad,), {}).result(timeout=10)
    assert e.value.name == "draft"
    with pytest.raises(TimeoutError, match="worker: no result"):
        client.call("sleep", (0.5,), {}).result(timeout=0.05)


def test_a_large_request_to_a_busy_worker_does_not_hold_up_the_caller(served):
    worker, _, client = served
    busy = client.call("block", (), {})
    big = torch.randn(16, 1 << 18)  # 16 MiB: far more than a socket buffer holds
    sent: list = []
    caller = threading.Thread(target=lambda: sent.append(client.call("echo", (big,), {})))
    caller.start()
    caller.join(30)
    assert sent and not busy.done()  # `call` returned while the worker was still busy
    worker.gate.set()
    assert busy.result(timeout=30) and torch.equal(sent[0].result(timeout=30), big)


def _serve_in_child(conn) -> None:
    server = ChannelServer(Worker())
    conn.send(server.path)
    threading.Event().wait()


def test_a_dead_server_fails_pending_and_later_calls():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_in_child, args=(child,), daemon=True)
    proc.start()
    try:
        client = ChannelClient(parent.recv(), "draft")
        assert client.call("echo", ("up",), {}).result(timeout=60) == "up"
        slow = client.call("sleep", (30.0,), {})
        queued = client.call("echo", (1,), {})
        proc.kill()
        for f in (slow, queued):
            with pytest.raises(WorkerDied) as e:
                f.result(timeout=30)
            assert e.value.name == "draft"
        with pytest.raises(WorkerDied):
            client.call("echo", (2,), {}).result(timeout=10)
        with pytest.raises(WorkerDied):  # also a call that would have waited for its argument
            client.call("echo", (Future(),), {}).result(timeout=10)
        client.close()
    finally:
        proc.kill()
        proc.join(10)


def test_no_call_is_left_waiting_forever(served):
    """A split of a non-tuple result fails its parts; a call still waiting for another worker's result fails
    when the channel closes; a worker method raising SystemExit answers its caller and the channel goes on."""
    from ssd.handles import LocalHandle

    worker, _, client = served
    worker.exit = lambda: (_ for _ in ()).throw(SystemExit(3))
    a, b = client.call_split("echo", 2, (None,), {})
    with pytest.raises(TypeError, match="expected a 2-tuple"):
        a.result(timeout=10)
    with pytest.raises(TypeError):
        b.result(timeout=10)
    local = LocalHandle(Worker(), "local")
    part = local.call_split("echo", 2, 7)[0]
    with pytest.raises(TypeError, match="echo returned int"):
        part.result(timeout=10)
    local.shutdown()
    with pytest.raises(SystemExit):
        client.call("exit", (), {}).result(timeout=10)
    assert client.call("echo", (5,), {}).result(timeout=10) == 5
    never: Future = Future()
    waiting = client.call("echo", (never,), {})
    time.sleep(0.1)
    client.close()
    with pytest.raises(WorkerDied):
        waiting.result(timeout=10)
