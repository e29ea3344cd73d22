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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from alternate import alternate, prefilled, report  # noqa: E402

from ssd.workers.loader import load_model  # noqa: E402
from ssd.workers.models.hugepages import move_to_huge_pages, thp_mode  # noqa: E402


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
    variants = {v: prefilled(model, max(ns)) for v, model in models.items()}
    spent, logits = alternate(variants, threads, ns, args.rounds)
    print(f"{args.model} {args.quantization}: ms per forward (median of {3 * args.rounds})")
    rows, same = report(spent, logits, "4k", "huge", threads, ns)
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" / f"huge_pages-{args.model}.json")
    out.write_text(json.dumps(dict(args=vars(args), thp=thp_mode(), moved_mb=round(moved / 1e6), huge_mb=huge_kb / 1e3,
                                   rows=rows, same_logits=same), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
