"""How much the target's forwards slow down while the draft computes on the other core (placement a).

    python benchmarks/contention.py --quantization w4a8 --draft-vocab 32768 --out results/contention.json

At placement a, SSD's target verifies on one core while its draft speculates on another; the two share the
memory path (and the last-level cache). This times the target's forward of 1 and of `--tokens` tokens on
the first core (median of `--reps`) while the second core
- idles;
- runs the draft's forwards of `--branches` sibling tokens in a loop (as a speculation's branch steps do);
- runs a 128 x 128 fp32 matmul that stays in the first-level cache: a control for shared execution units
  (two hyperthreads of one core would slow each other's compute here; separate cores do not).
Each background is a process of its own, pinned before it imports torch, and the settings rotate over
`--rounds` passes so a drift of the machine's speed spreads over all of them. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ssd.workers.loader import load_model
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.hugepages import move_to_huge_pages

# The background loops, run as `python -c` on the second core; each prints "ready" once warmed up.
_PIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nimport torch\ntorch.set_num_threads(1)\n"
_MATMUL = _PIN + """a, b = torch.randn(128, 128), torch.randn(128, 128)
print("ready", flush=True)
while True:
    torch.mm(a, b)
"""
_DRAFT = _PIN + """from ssd.workers.loader import load_model
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.hugepages import move_to_huge_pages
from ssd.workers.models.vocab_subset import draft_vocab_ids, restrict_head
model = load_model(sys.argv[2], dtype=torch.bfloat16, quantization=sys.argv[3] or None, progress=False).model
if int(sys.argv[4]):
    restrict_head(model, draft_vocab_ids(model.config.vocab_size, int(sys.argv[4]), list(model.config.eos_token_ids)))
move_to_huge_pages(model)
runner = ModelRunner(model, max_slots=1, max_len=512)
slot = runner.allocate()
runner.forward([slot], [[(i * 7919) % 5000 + 100 for i in range(128)]], last_only=True)
n = int(sys.argv[5])
print("ready", flush=True)
while True:
    runner.forward([slot], [[100 + i for i in range(n)]], parents=[[-1] * n])
    runner.truncate(slot, 128)
"""


def background(kind: str, core: int, args: argparse.Namespace) -> subprocess.Popen | None:
    if kind == "idle":
        return None
    code = _MATMUL if kind == "matmul" else _DRAFT
    argv = [sys.executable, "-c", code, str(core)]
    if kind == "draft":
        argv += [args.draft, args.draft_quantization or "", str(args.draft_vocab or 0), str(args.branches)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        p.kill()
        raise RuntimeError(f"the {kind} background did not start")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--draft-quantization", default="auto",
                    help="the draft's format (default: the engine's choice for this target, Config's 'auto')")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=3, help="the longer forward: a verification of K = tokens - 1")
    ap.add_argument("--branches", type=int, default=3, help="sibling tokens per background draft forward")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/contention.json")
    args = ap.parse_args(argv)
    if args.draft_quantization == "auto":  # what an engine gives this pair's draft (w4a8-g64 under w4a8)
        from ssd.config import Config

        args.draft_quantization = Config(target=args.target, draft=args.draft, quantization=args.quantization or None,
                                         draft_quantization="auto").draft_quantization
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        ap.error("needs two cores")
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    model = load_model(args.target, dtype=torch.bfloat16, quantization=args.quantization or None, progress=False).model
    move_to_huge_pages(model)
    runner = ModelRunner(model, max_slots=1, max_len=512)
    slot = runner.allocate()
    runner.forward([slot], [[(i * 7919) % 5000 + 100 for i in range(200)]], last_only=True)

    def forward_ms(n: int) -> float:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            runner.forward([slot], [[100 + i for i in range(n)]])
            times.append(time.perf_counter() - t0)
            runner.truncate(slot, 200)
        return statistics.median(times) * 1e3

    kinds = ("idle", "draft", "matmul")
    ms: dict[str, dict[int, list[float]]] = {k: {1: [], args.tokens: []} for k in kinds}
    for r in range(args.rounds):
        for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            p = background(kind, cores[1], args)
            try:
                time.sleep(0.5)
                for n in ms[kind]:
                    ms[kind][n].append(forward_ms(n))
            finally:
                if p is not None:
                    p.kill()
                    p.wait()
    summary = {k: {str(n): round(statistics.median(v), 2) for n, v in d.items()} for k, d in ms.items()}
    print(f"{args.target} {args.quantization} on core {cores[0]}, forwards in ms (median of {args.rounds} rounds)")
    print(f"| core {cores[1]} runs | 1 token | {args.tokens} tokens | 1 token vs idle | {args.tokens} tokens vs idle |")
    print("|---|---|---|---|---|")
    base = summary["idle"]
    for k, row in summary.items():
        print(f"| {k} | {row['1']} | {row[str(args.tokens)]} | {row['1'] / base['1']:.2f}x | "
              f"{row[str(args.tokens)] / base[str(args.tokens)]:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "ms": summary, "rounds": {
        k: {str(n): [round(x, 2) for x in v] for n, v in d.items()} for k, d in ms.items()}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
