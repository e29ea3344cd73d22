"""Weights in normal (4 KiB) pages against the same weights in transparent huge pages, one process.

Loads the model twice, moves one copy's weights into huge pages (`workers/models/hugepages.py`, what
every CPU worker now does) and alternates the two, round by round, scoring n tokens over a 200-token
cache: ms per forward (median) and the ratio. Both copies must give the same logits.

    python benchmarks/huge_pages.py --model qwen-coder-1.5b --threads 1,2

Writes results/huge_pages-<model>.json unless --out says otherwise. Run it without THP_MEM_ALLOC_ENABLE
in the environment (that would put the baseline's weights in huge pages too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ssd.workers.loader import load_model
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.hugepages import move_to_huge_pages, thp_mode


def anon_huge_kb() -> int:
    """AnonHugePages of this process (kB), from /proc/self/smaps_rollup; -1 where unreadable."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-coder-1.5b")
    ap.add_argument("--quantization", default="w4a8", choices=("w4a8", "w8a8"))
    ap.add_argument("--threads", default="2")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0"):
        ap.error("unset THP_MEM_ALLOC_ENABLE: the baseline's weights must stay in normal pages")
    threads = [int(t) for t in args.threads.split(",")]
    ns = [int(n) for n in args.tokens.split(",")]

    models = {v: load_model(args.model, dtype=torch.bfloat16, quantization=args.quantization, progress=False).model
              for v in ("4k", "huge")}
    huge_kb_before = anon_huge_kb()
    moved = move_to_huge_pages(models["huge"])
    huge_kb = anon_huge_kb() - huge_kb_before
    print(f"THP {thp_mode()}: moved {moved / 1e6:.0f} MB; the process gained {huge_kb / 1e3:.0f} MB of huge pages")
    if moved == 0:
        print("nothing moved: no comparison to make")
        return 1
    runners = {}
    for v, model in models.items():
        runner = ModelRunner(model, max_slots=1, max_len=256)
        slot = runner.allocate()
        runner.forward([slot], [[(i * 7919) % 5000 + 100 for i in range(200)]], last_only=True)
        runners[v] = (runner, slot)

    spent: dict[tuple[str, int, int], list[float]] = {(v, t, n): [] for v in runners for t in threads for n in ns}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    for r in range(args.rounds):
        for t in threads:
            torch.set_num_threads(t)
            for n in ns:
                for v in (("4k", "huge") if r % 2 == 0 else ("huge", "4k")):
                    runner, slot = runners[v]
                    for rep in range(4):  # the first call after a switch is not counted
                        t0 = time.perf_counter()
                        logits[(v, n)] = runner.forward([slot], [[100 + i for i in range(n)]], last_only=n == 1)
                        dt = time.perf_counter() - t0
                        runner.truncate(slot, 200)
                        if rep > 0:
                            spent[(v, t, n)].append(dt)

    rows = []
    print(f"{args.model} {args.quantization}: ms per forward (median of {3 * args.rounds})")
    print(f"{'threads':>7} {'n':>3} {'4 KiB':>8} {'huge':>8} {'huge/4k':>8}")
    for t in threads:
        for n in ns:
            a, b = (statistics.median(spent[(v, t, n)]) * 1e3 for v in ("4k", "huge"))
            rows.append(dict(threads=t, n=n, ms_4k=round(a, 2), ms_huge=round(b, 2), ratio=round(b / a, 3)))
            print(f"{t:>7} {n:>3} {a:>8.1f} {b:>8.1f} {b / a:>8.3f}")
    same = {n: bool(torch.equal(logits[("4k", n)], logits[("huge", n)])) for n in ns}
    print("same logits: " + ", ".join(f"n={n}: {s}" for n, s in same.items()))
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" / f"huge_pages-{args.model}.json")
    out.write_text(json.dumps(dict(args=vars(args), thp=thp_mode(), moved_mb=round(moved / 1e6), huge_mb=huge_kb / 1e3,
                                   rows=rows, same_logits=same), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
