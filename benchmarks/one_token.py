"""A decode step through ModelRunner's OneTokenStep against the general forward, one process, alternated.

Both runners share one model (weights in huge pages, as every CPU worker has them) and each keeps its own
200-token cache; every round times one-token forwards with one and then the other, in alternating order.
ms per forward (median), the ratio lean / general, and whether both gave the same logits (they must).

    python benchmarks/one_token.py --model qwen-coder-0.5b --threads 1,2

Writes results/one_token-<model>.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from alternate import alternate, prefilled, report  # noqa: E402

from ssd.workers.loader import load_model  # noqa: E402
from ssd.workers.models.hugepages import move_to_huge_pages  # noqa: E402


def compare(model: torch.nn.Module, threads: list[int], rounds: int) -> tuple[list[dict], dict[int, bool]]:
    """Rows of report() for n = 1 (lean: OneTokenStep; general: the same runner kind without it)."""
    variants = {v: prefilled(model, 1) for v in ("general", "lean")}
    variants["general"].runner.one_token = None
    if variants["lean"].runner.one_token is None:
        raise SystemExit("this model's runner has no OneTokenStep (CPU kernels unavailable or a GPU cache)")
    spent, logits = alternate(variants, threads, [1], rounds)
    return report(spent, logits, "general", "lean", threads, [1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-coder-0.5b")
    ap.add_argument("--quantization", default="w4a8", choices=("w4a8", "w8a8"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = load_model(args.model, dtype=torch.bfloat16, quantization=args.quantization, progress=False).model
    move_to_huge_pages(model)
    print(f"{args.model} {args.quantization}: ms per one-token forward (median of {3 * args.rounds})")
    rows, same = compare(model, [int(t) for t in args.threads.split(",")], args.rounds)
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" / f"one_token-{args.model}.json")
    out.write_text(json.dumps(dict(args=vars(args), rows=rows, same_logits=same), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
