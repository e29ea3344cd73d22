"""Each kind of quantised linear layer of a real model on its own: ms per call of all layers of that kind,
multiply-adds and bytes per second, for 1 to 16 activation rows (decode = 1, a verification of K drafts = K + 1,
an SSD tree step = its branches).

A whole forward's time (`benchmarks/breakdown.py`) hides which format is slow; here every (class, layer name,
shape) group is timed alone, so a format far below the others' multiply-add rate at many rows, or below the
memory's rate at one row, stands out (session 30: q8 ran at a third of q4 / q5 / q6's rate at 8-16 rows).
Each call goes through the layer's Python forward (~10-20 us each), which small layers notice.

    python benchmarks/linears.py --model qwen-coder-0.5b --threads 1,2 --rows 1,8,16

Prints a table per thread count and writes results/linears-<model>.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from ssd.workers.models.blockquant import _BlockLinear


def linear_groups(model: nn.Module) -> dict[tuple[str, str, int, int], list[nn.Module]]:
    """(class, layer name, in, out) -> the block-quantised layers of that kind, in model order."""
    groups: dict[tuple[str, str, int, int], list[nn.Module]] = defaultdict(list)
    for name, mod in model.named_modules():
        if isinstance(mod, _BlockLinear):
            groups[(type(mod).__name__, name.rsplit(".", 1)[-1], mod.in_features, mod.out_features)].append(mod)
    return dict(groups)


def layer_bytes(mod: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*mod.parameters(), *mod.buffers()))


@torch.inference_mode()
def time_group(mods: list[nn.Module], rows: int, reps: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Median seconds for one call of every layer in `mods` on `rows` random activation rows."""
    x = torch.randn(rows, mods[0].in_features).to(dtype)
    for mod in mods[:2]:
        mod(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for mod in mods:
            mod(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: nn.Module, rows: list[int], reps: int) -> list[dict]:
    out = []
    for (cls, name, k, n), mods in sorted(linear_groups(model).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        nbytes = sum(map(layer_bytes, mods))
        row = {"class": cls, "layer": name, "in": k, "out": n, "count": len(mods), "mb": round(nbytes / 1e6, 2),
               "by_rows": {}}
        for m in rows:
            s = time_group(mods, m, reps)
            row["by_rows"][str(m)] = {"ms": round(s * 1e3, 3), "gmac_s": round(m * k * n * len(mods) / s / 1e9, 1),
                                      "gb_s": round(nbytes / s / 1e9, 1)}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-coder-0.5b")
    ap.add_argument("--quantization", default="w4a8", choices=("w4a8", "w8a8"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from ssd.workers.loader import load_model
    from ssd.workers.models.hugepages import move_to_huge_pages

    model = load_model(args.model, quantization=args.quantization, progress=False).model
    move_to_huge_pages(model)
    rows = [int(r) for r in args.rows.split(",")]
    result = {"args": vars(args), "threads": {}}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        table = measure(model, rows, args.reps)
        result["threads"][str(threads)] = table
        print(f"\n{args.model} {args.quantization}, {threads} thread(s): ms per call of every layer of a kind "
              "(GMAC/s, GB/s)")
        print(f"{'class':<12} {'layer':<13} {'in x out':>13} {'n':>3} {'MB':>7} " +
              " ".join(f"{f'rows={m}':>26}" for m in rows))
        for r in table:
            cells = " ".join(f"{c['ms']:8.2f} ({c['gmac_s']:6.1f}, {c['gb_s']:5.1f})" for c in r["by_rows"].values())
            shape = f"{r['in']}x{r['out']}"
            print(f"{r['class']:<12} {r['layer']:<13} {shape:>13} {r['count']:>3} {r['mb']:7.1f} {cells}")
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" / f"linears-{args.model}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
