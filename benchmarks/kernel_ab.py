"""This checkout's CPU kernels against another checkout's, alternated in one process on one real model.

Sequential runs of `benchmarks/runner.py` on two commits drift by 5-10 % on a shared machine, more than
most kernel changes. Here both kernel libraries are loaded at once (the base built from `--base`, a
`kernels/cpu` folder of another checkout, e.g. a `git worktree` of main) and every round times the
same forwards with one and then the other, in alternating order, on the same weights and KV cache.

    git worktree add --detach /tmp/base main
    python benchmarks/kernel_ab.py --base /tmp/base/kernels/cpu --model qwen-coder-1.5b --threads 1,2

Prints ms per forward (median) for each (threads, n) and the ratio new / base, t(8) / t(1) of each,
and whether both give the same logits (they must, unless the change alters the numerics on purpose);
writes results/kernel_ab-<model>.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ssd.kernels import cpu as qk
from ssd.workers.loader import load_model
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.hugepages import move_to_huge_pages


def load_from(folder: Path) -> object:
    """The kernel library built from the sources in `folder` (this CPU's best build)."""
    own = qk._sources
    qk._sources = lambda: [folder / name for name in qk.SOURCES]
    try:
        return qk.load(qk.isa())
    finally:
        qk._sources = own


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="kernels/cpu of the checkout to compare against")
    ap.add_argument("--model", default="qwen-coder-1.5b")
    ap.add_argument("--quantization", default="w4a8", choices=("w4a8", "w8a8"))
    ap.add_argument("--threads", default="2")
    ap.add_argument("--tokens", default="1,8", help="tokens scored per forward (1 = decode, K + 1 = verify K)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cache", type=int, default=200, help="tokens already in the KV cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not (args.base / qk.SOURCES[0]).is_file():
        ap.error(f"--base {args.base} has no {qk.SOURCES[0]}")
    threads = [int(t) for t in args.threads.split(",")]
    ns = [int(n) for n in args.tokens.split(",")]
    libs = {"base": load_from(args.base), "new": qk.load(qk.isa())}

    model = load_model(args.model, dtype=torch.bfloat16, quantization=args.quantization, progress=False).model
    move_to_huge_pages(model)  # as every CPU worker does
    runner = ModelRunner(model, max_slots=1, max_len=args.cache + max(ns) + 8)
    slot = runner.allocate()
    runner.forward([slot], [[(i * 7919) % 5000 + 100 for i in range(args.cache)]], last_only=True)

    spent: dict[tuple[str, int, int], list[float]] = {(v, t, n): [] for v in libs for t in threads for n in ns}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    for r in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            for n in ns:
                order = list(libs.items()) if r % 2 == 0 else list(reversed(libs.items()))
                for name, lib in order:
                    qk._lib = lambda lib=lib: lib  # the model's layers call whichever library _lib returns
                    for rep in range(4):  # the first call of each switch warms caches and is not counted
                        t0 = time.perf_counter()
                        out = runner.forward([slot], [[100 + i for i in range(n)]], last_only=n == 1)
                        dt = time.perf_counter() - t0
                        runner.truncate(slot, args.cache)
                        if rep > 0:
                            spent[(name, t, n)].append(dt)
                    logits[(name, n)] = out

    rows = []
    print(f"{args.model} {args.quantization}, {qk.isa()} build, ms per forward (median of {3 * args.rounds})")
    print(f"{'threads':>7} {'n':>3} {'base':>8} {'new':>8} {'new/base':>9}")
    for t in threads:
        for n in ns:
            b, w = (statistics.median(spent[(v, t, n)]) * 1e3 for v in ("base", "new"))
            rows.append(dict(threads=t, n=n, base_ms=round(b, 2), new_ms=round(w, 2), ratio=round(w / b, 3)))
            print(f"{t:>7} {n:>3} {b:>8.1f} {w:>8.1f} {w / b:>9.3f}")
    if 1 in ns and 8 in ns:
        for t in threads:
            ratios = {v: statistics.median(spent[(v, t, 8)]) / statistics.median(spent[(v, t, 1)]) for v in libs}
            print(f"threads {t}: t(8)/t(1) base {ratios['base']:.2f}, new {ratios['new']:.2f}")
    same = {n: bool(torch.equal(logits[("base", n)], logits[("new", n)])) for n in ns}
    print("same logits: " + ", ".join(f"n={n}: {s}" for n, s in same.items()))
    out_path = Path(args.out or Path(__file__).resolve().parent.parent / "results" / f"kernel_ab-{args.model}.json")
    out_path.write_text(json.dumps(dict(args={**vars(args), "base": str(args.base)}, isa=qk.isa(), rows=rows,
                                        same_logits=same), indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
