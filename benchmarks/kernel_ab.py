"""This checkout's CPU kernels against another checkout's, alternated in one process on one real model.

Sequential runs of `benchmarks/runner.py` on two commits drift by 5-10 % on a shared machine, more than
most kernel changes. Here both kernel libraries are loaded at once (the base built from `--base`, a
`kernels/cpu` folder of another checkout, e.g. a `git worktree` of main) and every round times the
same forwards with one and then the other, in alternating order, on the same weights and KV cache.

    git worktree add --detach /tmp/base main
    python benchmarks/kernel_ab.py --base /tmp/base/kernels/cpu --model qwen-coder-1.5b --threads 1,2

`--caller thread` times the forwards from a second thread while the main thread, which loaded the model, keeps
its own OpenMP team: how an in-process worker (ssd/handles.py LocalHandle) runs.

Prints ms per forward (median) for each (threads, n) and the ratio new / base, t(8) / t(1) of each,
and whether both give the same logits (they must, unless the change alters the numerics on purpose);
writes results/kernel_ab-<model>.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from alternate import Variant, alternate, prefilled, report  # noqa: E402

from ssd.kernels import cpu as qk  # noqa: E402
from ssd.workers.loader import load_model  # noqa: E402
from ssd.workers.models.hugepages import move_to_huge_pages  # noqa: E402


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
    ap.add_argument("--caller", default="main", choices=("main", "thread"),
                    help="thread: from a second thread, the main thread's OpenMP team still there (in-process workers)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not (args.base / qk.SOURCES[0]).is_file():
        ap.error(f"--base {args.base} has no {qk.SOURCES[0]}")
    threads = [int(t) for t in args.threads.split(",")]
    ns = [int(n) for n in args.tokens.split(",")]
    libs = {"base": load_from(args.base), "new": qk.load(qk.isa())}

    model = load_model(args.model, dtype=torch.bfloat16, quantization=args.quantization, progress=False).model
    move_to_huge_pages(model)  # as every CPU worker does
    shared = prefilled(model, max(ns))

    def using(lib: object) -> Variant:  # the model's layers call whichever library _lib returns
        return Variant(shared.runner, shared.slot, enter=lambda: setattr(qk, "_lib", lambda: lib))

    variants = {name: using(lib) for name, lib in libs.items()}
    if args.caller == "thread":
        with ThreadPoolExecutor(1) as pool:
            spent, logits = pool.submit(alternate, variants, threads, ns, args.rounds).result()
    else:
        spent, logits = alternate(variants, threads, ns, args.rounds)
    caller = "a second thread" if args.caller == "thread" else "the main thread"
    print(f"{args.model} {args.quantization}, {qk.isa()} build, called from {caller}, "
          f"ms per forward (median of {3 * args.rounds})")
    rows, same = report(spent, logits, "base", "new", threads, ns)
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" / f"kernel_ab-{args.model}.json")
    out.write_text(json.dumps(dict(args={**vars(args), "base": str(args.base)}, isa=qk.isa(), rows=rows,
                                   same_logits=same), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
