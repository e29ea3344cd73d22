"""Host time per forward and per draft call on the CPU fast path: wall time minus the time spent inside the C
kernels (every `ssd.kernels.cpu` entry point the models call), i.e. Python, torch glue and output handling.

    python benchmarks/host_overhead.py --out results/host_overhead.json

Target (1.5B, whole vocabulary): a decode step and a verification of 6 tokens (forward + `verify_greedy`, as
the target worker's AR and SD rounds) over a ~200-token cache. Draft (0.5B, `--draft-vocab` kept ids plus its context,
as SSD runs it): a `DraftWorker`'s SD proposal of K tokens, SSD speculation (ranked, budget B, K steps) and a
miss's resolution (a just-in-time proposal), on a HumanEval prompt that grows round by round; then greedy argmax
of logits rows, torch's against the C kernel. Prints a table of medians and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import humaneval  # noqa: E402

from ssd.kernels import cpu as cpu_kernels  # noqa: E402
from ssd.kernels.verify import verify_greedy  # noqa: E402
from ssd.workers.draft_worker import DraftWorker, SpecRequest  # noqa: E402
from ssd.workers.loader import load_model  # noqa: E402
from ssd.workers.messages import SamplingSpec  # noqa: E402
from ssd.workers.model_runner import ModelRunner  # noqa: E402
from ssd.workers.models.hugepages import move_to_huge_pages  # noqa: E402

# The model's kernels; everything else (Python, torch glue, argmax and sampling, the output layer's scatter) is host.
KERNELS = ("decoder_layers", "linear", "linear_dense", "attend_rows", "rmsnorm", "silu_mul")


class KernelClock:
    """Seconds spent inside the given functions of `module` (wrapped in place; the model code looks them up
    on the module at call time). `since(mark)`: kernel seconds since `mark = clock.total`."""

    def __init__(self, module: ModuleType, names: tuple[str, ...]) -> None:
        self.total = 0.0
        for name in names:
            if hasattr(module, name):
                setattr(module, name, self._timed(getattr(module, name)))

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        return timed

    def since(self, mark: float) -> float:
        return self.total - mark


def measure(clock: KernelClock, calls: dict[str, Callable[[], object]], iters: int, warmup: int = 3) -> dict:
    """Median wall / kernel / host milliseconds per call of each callable, the callables taking turns."""
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for it in range(warmup + iters):
        for name, call in calls.items():
            mark, t0 = clock.total, time.perf_counter()
            call()
            wall, kern = time.perf_counter() - t0, clock.since(mark)
            if it >= warmup:
                got[name].append((wall, kern))
    out = {}
    for name, pairs in got.items():
        wall = statistics.median(w for w, _ in pairs) * 1e3
        kern = statistics.median(k for _, k in pairs) * 1e3
        host = statistics.median(w - k for w, k in pairs) * 1e3
        out[name] = {"wall_ms": round(wall, 2), "kernel_ms": round(kern, 2), "host_ms": round(host, 2)}
    return out


def target_calls(alias: str) -> dict[str, Callable[[], object]]:
    model = load_model(alias, dtype=torch.bfloat16, quantization="w4a8", progress=False).model
    move_to_huge_pages(model)
    runner = ModelRunner(model, max_slots=1, max_len=512)
    slot = runner.allocate()
    runner.forward([slot], [[(i * 7919) % 5000 + 100 for i in range(200)]], last_only=True)
    draft = torch.tensor([[101, 102, 103, 104, 105]])

    def decode() -> None:  # as an AR round: a verification of no drafted tokens
        logits = runner.forward([slot], [[100]])  # [1, 1, V]
        verify_greedy(draft[:, :0], torch.tensor([0]), logits).tokens.tolist()
        runner.truncate(slot, 200)

    def verify6() -> None:
        logits = runner.forward([slot], [[100, *draft[0].tolist()]])  # [1, 6, V]
        verify_greedy(draft, torch.tensor([5]), logits).tokens.tolist()
        runner.truncate(slot, 200)

    return {"target decode (1 token)": decode, "target verify (6 tokens)": verify6}


def draft_calls(alias: str, draft_vocab: int, k: int, budget: int) -> dict[str, Callable[[], object]]:
    w = DraftWorker(alias, quantization="w4a8", max_slots=1, max_len=4096, draft_vocab=draft_vocab, ranked=True)
    w.add(0, w.tokenizer.encode(humaneval(1)[0]), SamplingSpec(temperature=0))
    state = {"round": 0, "x": []}

    def propose() -> None:
        state["x"] = w.propose([(0, k)])[0][0].tokens

    def speculate() -> None:
        state["round"] += 1
        fanout = [0] * k + [budget]
        w.speculate([SpecRequest(seq_id=0, round_id=state["round"], tokens=state["x"], fanout=fanout,
                                 next_fanout=fanout, k_next=k)])

    def resolve_miss() -> None:  # 3 accepted, then the draft's own x_4 as the correction: never a candidate
        x = state["x"]
        w.resolve([(0, 3, [*x[:3], x[3]], k)], neural_backup=True)

    return {f"draft SD propose (K={k})": propose, f"draft SSD speculate (K={k}, B={budget})": speculate,
            "draft resolve, a miss (propose again)": resolve_miss}


def argmax_times(reps: int = 200) -> dict:
    """Microseconds per greedy argmax of fp32 logits rows: torch.argmax against the C kernel (argmax_rows)."""
    out = {}
    for rows, v in ((1, 151936), (6, 151936), (16, 32800)):
        x = torch.randn(rows, v, generator=torch.Generator().manual_seed(rows))
        got = {}
        for name, fn in (("torch", lambda t: t.argmax(-1)), ("argmax_rows", cpu_kernels.argmax_rows)):
            fn(x)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x)
            got[name + "_us"] = round((time.perf_counter() - t0) / reps * 1e6, 1)
        out[f"{rows} x {v}"] = got
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default=None, help="JSON path (default: results/host_overhead.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = KernelClock(cpu_kernels, KERNELS)
    rows = measure(clock, target_calls(args.target), args.iters)
    rows |= measure(clock, draft_calls(args.draft, args.draft_vocab, args.k, args.budget), args.iters)
    print(f"{'call':<40} {'wall ms':>8} {'kernels ms':>11} {'host ms':>8}")
    for name, r in rows.items():
        print(f"{name:<40} {r['wall_ms']:8.2f} {r['kernel_ms']:11.2f} {r['host_ms']:8.2f}")
    argmax = argmax_times() if hasattr(cpu_kernels, "argmax_rows") else {}
    for shape, r in argmax.items():
        print(f"greedy argmax of {shape} fp32: torch {r['torch_us']:.1f} us, argmax_rows {r['argmax_rows_us']:.1f} us")
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" / "host_overhead.json")
    out.write_text(json.dumps(dict(args=vars(args), rows=rows, argmax=argmax), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
