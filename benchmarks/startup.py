"""How long `LLM(...)` takes to come up on the real pair, and where the time goes.

    python benchmarks/startup.py --modes auto,sd --out results/startup.json

Per mode: the whole `LLM(...)` call with the workers as Ray actors (target on the first core, draft on the
last, as `auto` runs in placement b), the part spent starting the actors and loading the models in them
(`place_workers`), and the part spent on the auto-configuration's latencies (`cached_autoconfigure`): first
measured (a fresh store, as on a first start), then a second `LLM(...)` that finds them stored and only
re-times one forward of each worker (ssd/autoconfig_cache.py; it measures again if those moved by over 15 %).
Then each model's load (GGUF read, repack into the kernels' tiles, huge pages) in this process at 1 and 2
threads. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import ssd.build as build
import ssd.launch.placement as placement
from ssd import LLM
from ssd.workers.loader import load_model


def timed(module: object, name: str, spent: dict[str, float]) -> None:
    """Wrap module.name so that each call's seconds are recorded under `name`."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = time.perf_counter() - t0

    setattr(module, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--modes", default="auto")
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--out", default="results/startup.json")
    args = ap.parse_args(argv)
    import ray

    cores = sorted(os.sched_getaffinity(0))
    spent: dict[str, float] = {}
    os.environ["SSD_AUTOCONFIG_CACHE"] = tempfile.mkdtemp(prefix="ssd-autoconfig-")  # the first start measures
    timed(build, "cached_autoconfigure", spent)  # build_engine looks both up at call time
    timed(placement, "place_workers", spent)
    ray.init(num_cpus=len(cores), include_dashboard=False, log_to_driver=False, logging_level="warning")
    rows: dict[str, dict[str, float]] = {}
    try:
        for mode in args.modes.split(","):
            rows[mode] = {}
            for start in ("", "reused_"):
                spent.clear()
                t0 = time.perf_counter()
                llm = LLM(target=args.target, draft=args.draft, mode=mode, max_batch=1, max_len=2048, use_ray=True,
                          target_cores=[cores[0]], draft_cores=[cores[-1]], quantization=args.quantization,
                          draft_vocab=args.draft_vocab)
                rows[mode].update({f"{start}llm_s": time.perf_counter() - t0,
                                   **{f"{start}{k}_s": v for k, v in spent.items()}})
                llm.shutdown()
    finally:
        ray.shutdown()
    loads: dict[str, dict[int, float]] = {}
    for model in (args.target, args.draft):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            load_model(model, dtype=torch.bfloat16, quantization=args.quantization, progress=False)
            loads.setdefault(model, {})[threads] = time.perf_counter() - t0
    print("| mode | start | LLM(...) s | actors + loading s | auto-configuration s |\n|---|---|---|---|---|")
    for mode, r in rows.items():
        for start, label in (("", "first (measured)"), ("reused_", "again (stored)")):
            print(f"| {mode} | {label} | {r[start + 'llm_s']:.1f} | {r.get(start + 'place_workers_s', 0):.1f} | "
                  f"{r.get(start + 'cached_autoconfigure_s', 0):.1f} |")
    print("\n| model | load s, 1 thread | load s, 2 threads |\n|---|---|---|")
    for model, by_threads in loads.items():
        print(f"| {model} | {by_threads[1]:.1f} | {by_threads[2]:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "modes": rows, "load_s": loads}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
