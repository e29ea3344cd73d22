"""Cost of moving a draft q-distribution tensor from the draft actor to the target actor.

Compares, for one [B, V] float32 tensor (default [8, 151936], 4.9 MB):
  objstore-ref    draft returns the tensor; its ObjectRef is passed straight into a target call
  objstore-numpy  same, but the tensor crosses as a numpy array (Ray reads numpy zero-copy)
  via-driver      the driver ray.get()s the tensor and passes the value to the target
  gloo            torch.distributed send/recv between the two actors (TCP store, 2 ranks)
  null            the same two calls with a 1-element tensor: Ray's per-call floor
under three serialisations of torch tensors (see main()); and over the actors' call channels (launch/channel.py,
what RayHandle uses on one node: `channel`): null and via-driver, the driver receiving q from the draft's
channel and sending it down the target's; dense-verify and columns-verify, the same with the target writing q
into a zeroed [B, V] as its verifier does, q sent whole or as a SubsetQ of its first `--columns` ids (what a
draft restricted by `draft_vocab` sends, workers/subset_q.py).

Every variant runs the same two actor calls per round (produce on the draft, consume on the
target) and the table reports wall time per round and the time above the `null` floor.

    python benchmarks/transfer.py [--rows 8] [--vocab 151936] [--rounds 50] [--kept 32769]
Writes results/transfer.json. `--kept N`: q is zero outside the first N token ids, as with a draft
restricted by `draft_vocab`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import ray
import torch

from ssd.launch.actors import register_serializers
from ssd.launch.channel import ChannelClient, ChannelServer
from ssd.workers.subset_q import SubsetQ, write_q


@ray.remote(num_cpus=1)
class Side:
    """One end: rank 0 = target (consumer), rank 1 = draft (producer)."""

    def __init__(self, rows: int, vocab: int, numpy_serializer: bool, kept: int | None = None) -> None:
        if numpy_serializer:
            register_serializers()
        torch.set_num_threads(1)
        self.q = torch.rand(rows, vocab)
        if kept is not None:
            self.q[:, kept:] = 0.0
        self.q /= self.q.sum(-1, keepdim=True)
        self.buf = torch.empty(rows, vocab)
        self.tiny = torch.ones(1, 1)

    # -- object store --------------------------------------------------------------------------
    def produce(self, tiny: bool = False) -> torch.Tensor:
        return self.tiny if tiny else self.q.clone()  # a fresh tensor per round, like a real draft

    def produce_np(self) -> np.ndarray:
        return self.q.clone().numpy()

    def produce_columns(self, columns: int) -> SubsetQ:
        return SubsetQ(self.q[:, :columns].clone(), torch.arange(columns), self.q.shape[1])

    def consume_into(self, q: torch.Tensor | SubsetQ) -> float:
        """What the verifier does with a draft's q: write it into zeroed rows of the whole vocabulary."""
        out = torch.zeros(self.q.shape)
        write_q(out, q)
        return float(out[0, 0])

    def consume(self, q) -> float:
        if isinstance(q, np.ndarray):
            q = torch.from_numpy(q)
        return float(q[0, 0])  # touch it

    # -- gloo ----------------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_gloo(self, addr: str, port: int, rank: int) -> bool:
        import torch.distributed as dist

        store = dist.TCPStore(addr, port, 2, is_master=rank == 0, wait_for_workers=True)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        return True

    def send(self) -> bool:
        import torch.distributed as dist

        dist.send(self.q.clone(), dst=0)
        return True

    def recv(self) -> float:
        import torch.distributed as dist

        dist.recv(self.buf, src=1)
        return float(self.buf[0, 0])

    def open_channel(self) -> str:
        self._server = ChannelServer(self)
        return self._server.path

    def close_gloo(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def timed(variants: dict, rounds: int, warmup: int = 5) -> dict[str, list[float]]:
    """Round-robin over the variants, so drifting load on a shared machine hits them all alike."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                out[name].append((time.perf_counter() - t0) * 1e3)
    return out


def run(rows: int, vocab: int, rounds: int, numpy_serializer: bool, kept: int | None = None) -> dict:
    if numpy_serializer:
        register_serializers()
    target, draft = (Side.remote(rows, vocab, numpy_serializer, kept) for _ in range(2))
    ray.get([target.address.remote(), draft.address.remote()])
    variants = {
        "null": lambda: ray.get(target.consume.remote(draft.produce.remote(True))),
        "objstore-ref": lambda: ray.get(target.consume.remote(draft.produce.remote())),
        "objstore-numpy": lambda: ray.get(target.consume.remote(draft.produce_np.remote())),
        "via-driver": lambda: ray.get(target.consume.remote(ray.get(draft.produce.remote()))),
    }
    addr, port = ray.get(target.address.remote())
    ray.get([target.init_gloo.remote(addr, port, 0), draft.init_gloo.remote(addr, port, 1)])
    variants["gloo"] = lambda: ray.get([target.recv.remote(), draft.send.remote()])
    times = timed(variants, rounds)
    ray.get([target.close_gloo.remote(), draft.close_gloo.remote()])
    for a in (target, draft):
        ray.kill(a)
    return times


def run_channel(rows: int, vocab: int, rounds: int, columns: int, kept: int | None = None) -> dict:
    register_serializers()
    target, draft = (Side.remote(rows, vocab, True, kept) for _ in range(2))
    t_chan, d_chan = (ChannelClient(ray.get(a.open_channel.remote()), n) for a, n in ((target, "t"), (draft, "d")))
    variants = {
        "null": lambda: t_chan.call("consume", (d_chan.call("produce", (True,), {}),), {}).result(),
        "via-driver": lambda: t_chan.call("consume", (d_chan.call("produce", (), {}),), {}).result(),
        "dense-verify": lambda: t_chan.call("consume_into", (d_chan.call("produce", (), {}),), {}).result(),
        "columns-verify": lambda: t_chan.call(
            "consume_into", (d_chan.call("produce_columns", (columns,), {}),), {}).result(),
    }
    times = timed(variants, rounds)
    for c, a in ((t_chan, target), (d_chan, draft)):
        c.close()
        ray.kill(a)
    return times


def summarise(times: dict[str, list[float]], nbytes: int) -> dict[str, dict]:
    floor = statistics.median(times["null"])
    out = {}
    for name, t in times.items():
        med = statistics.median(t)
        extra = max(med - floor, 1e-9)
        out[name] = {
            "median_ms": round(med, 3),
            "p90_ms": round(sorted(t)[int(0.9 * (len(t) - 1))], 3),
            "above_null_ms": round(med - floor, 3),
            "effective_GBps": None if name == "null" else round(nbytes / extra / 1e6, 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--kept", type=int, default=None, help="q = 0 outside the first KEPT token ids")
    ap.add_argument("--columns", type=int, default=32770,
                    help="columns-verify's SubsetQ width (draft_vocab 32768 plus the end-of-sequence ids)")
    ap.add_argument("--out", default="results/transfer.json")
    args = ap.parse_args()
    nbytes = args.rows * args.vocab * 4
    results = {}
    # default: Ray pickles tensors with torch's reducer; ssd_numpy: ssd.launch.actors'
    # register_serializers (what RayHandle actors use); zero_copy_torch: Ray's own
    # RAY_ENABLE_ZERO_COPY_TORCH_TENSORS, which must be set in the workers' environment.
    for key in ("default", "ssd_numpy", "zero_copy_torch"):
        zc = "1" if key == "zero_copy_torch" else "0"
        os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = zc
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": zc}})
        try:
            times = run(args.rows, args.vocab, args.rounds, numpy_serializer=key == "ssd_numpy", kept=args.kept)
        finally:
            ray.shutdown()
        results[key] = summarise(times, nbytes)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        results["channel"] = summarise(run_channel(args.rows, args.vocab, args.rounds, args.columns, kept=args.kept),
                                       nbytes)
    finally:
        ray.shutdown()

    kept = "" if args.kept is None else f", zero outside the first {args.kept} ids"
    print(f"q tensor [{args.rows}, {args.vocab}] float32 = {nbytes / 1e6:.2f} MB{kept}, {args.rounds} rounds, "
          f"{os.cpu_count()} cores")
    head = ("ray serialisation", "transport", "median ms", "p90 ms", "+null ms", "GB/s")
    print(f"{head[0]:<18} {head[1]:<16} {head[2]:>10} {head[3]:>8} {head[4]:>9} {head[5]:>7}")
    for key, table in results.items():
        for name, r in table.items():
            gbps = "" if r["effective_GBps"] is None else f"{r['effective_GBps']:.2f}"
            print(f"{key:<18} {name:<16} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} "
                  f"{r['above_null_ms']:>9.3f} {gbps:>7}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "shape": [args.rows, args.vocab], "dtype": "float32", "bytes": nbytes, "kept": args.kept,
        "columns": args.columns,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
        "ray": ray.__version__, "results": results,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
