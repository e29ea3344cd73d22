"""The CPU kernel's builds side by side: ms per block-quantised GEMM for each build this CPU can run
(`ssd.kernels.cpu.supported_isas()`: avx2, and AVX-VNNI where present), on the real models' layer
shapes, 1 to 8 activation rows (decode = 1, verifying K drafted tokens = K + 1).

Builds are called alternately in one process on the same packed weights and activations (medians of
`--reps` calls; the ratio is avx2 over the build the kernels pick here), and each row says whether
the builds' outputs are bit-identical. The weights are random (speed does not depend on their
values) and small enough to stay in cache, so this measures the kernel's arithmetic, not the memory
stream a whole decode step is bound by.

    python benchmarks/kernel_builds.py [--threads 1] [--reps 41]

Writes results/kernel_builds.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from ssd.kernels import cpu as qk
from ssd.workers.models.blockquant import W4A8Linear, W5A8Linear, W6A8Linear, W8A8Linear

# (label, layer class, N, K): the 1.5B's gate_up (q4), down (q6) and qkv (q4); the 0.5B's gate_up (q5)
# and a q8 square.
SHAPES = [
    ("1.5B gate_up q4", W4A8Linear, 17920, 1536),
    ("1.5B down q6", W6A8Linear, 1536, 8960),
    ("1.5B qkv q4", W4A8Linear, 2048, 1536),
    ("0.5B gate_up q5", W5A8Linear, 9728, 896),
    ("q8 1536x1536", W8A8Linear, 1536, 1536),
]
ROWS = (1, 2, 4, 8)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results" / "kernel_builds.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    builds = qk.supported_isas()
    libs = {name: qk.load(name) for name in builds}
    g = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{cpu_name()}, {args.threads} thread(s); builds: {', '.join(builds)}")
    print(f"{'layer':<18} {'M':>2} " + " ".join(f"{b:>11}" for b in builds) + f" {'avx2/' + builds[0]:>13}  same bits")
    for label, cls, n, k in SHAPES:
        lin = cls.from_float(torch.randn(n, k, generator=g), None, torch.float32)
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            times: dict[str, list[float]] = {b: [] for b in builds}
            outs: dict[str, torch.Tensor] = {}
            for _ in range(args.reps):
                for b, lib in libs.items():
                    qk._lib = lambda lib=lib: lib  # the layer calls whichever build _lib returns
                    t0 = time.perf_counter()
                    outs[b] = lin(x)
                    times[b].append(time.perf_counter() - t0)
            ms = {b: statistics.median(t) * 1e3 for b, t in times.items()}
            same = all(torch.equal(outs[b], outs["avx2"]) for b in builds)
            ratio = ms["avx2"] / ms[builds[0]]  # the baseline over the build the kernels use here
            rows_out.append(dict(layer=label, m=m, ms={b: round(v, 4) for b, v in ms.items()},
                                 avx2_over_default=round(ratio, 3), same_bits=same))
            print(f"{label:<18} {m:>2} " + " ".join(f"{ms[b]:>9.3f}ms" for b in builds) + f" {ratio:>12.2f}x  {same}")
    Path(args.out).write_text(json.dumps(dict(cpu=cpu_name(), threads=args.threads, builds=builds, rows=rows_out),
                                         indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
