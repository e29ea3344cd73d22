"""Where an engine round's time goes: `LLM.generate` per mode under cProfile (each thread) against the forward alone.

The model has a real model's shapes and random bf16 weights (`runner.random_model`), so it runs where the real
files are not (a lent GPU); draft == target, so SD / SSD accept every draft token. For each mode it prints the
wall time per round and per token, the time the mode spent waiting on the target and on drafts, and the
functions with the most own time (cProfile's tottime: host work, and on CUDA the waits inside
`.item()` / `.tolist()` / `synchronize`). The "forward" row is one graphed (CUDA) or plain (CPU) decode step of
the same model through `ModelRunner`, timed alone: what a round of AR could cost with no engine around it.

    python benchmarks/engine_profile.py --device cuda --model qwen-coder-1.5b --out results/gpu/engine_profile.json
    python benchmarks/engine_profile.py --device cpu --model tiny --modes ar
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from runner import random_model  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402
from ssd.kernels.sampling import argmax_last  # noqa: E402
from ssd.workers.model_runner import ModelRunner  # noqa: E402


def build(alias: str, device: torch.device):
    if alias == "tiny":
        from tiny_models import random_model as tiny

        return tiny(vocab=512, hidden=64, heads=4, kv_heads=2, layers=2).to(device=device, dtype=torch.bfloat16)
    return random_model(alias, device)


def prompt_ids(model, n: int = 200) -> list[int]:
    span = min(5000, model.config.vocab_size - 100)
    return [(i * 7919) % span + 100 for i in range(n)]


def forward_ms(model, device: torch.device, steps: int = 50) -> float:
    """Median ms of one greedy decode step (forward + argmax read back; CUDA graphs on CUDA) over a 200-token
    cache, the runner alone."""
    runner = ModelRunner(model, max_slots=1, max_len=512, device=device, cuda_graphs=device.type == "cuda")
    slot = runner.allocate()
    runner.forward([slot], [prompt_ids(model)], last_only=True)
    times, tok = [], 100
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = int(argmax_last(runner.forward([slot], [[tok]], last_only=True)[0]))
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def top(prof: cProfile.Profile, n: int) -> list[dict]:
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(dict(function=f"{Path(file).name}:{line}({fn})", calls=nc, tottime_s=round(tt, 4),
                         cumtime_s=round(ct, 4)))
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen-coder-1.5b", help="an alias of runner.SHAPES, or 'tiny'")
    ap.add_argument("--modes", default="ar,sd,ssd")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=None,
                    help="tokens of the untimed generation first (default: --tokens, so every graph is captured)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    model = build(args.model, device)
    result: dict = dict(device=str(device), model=args.model, tokens=args.tokens, warmup_tokens=args.warmup_tokens,
                        k=args.k, forward_ms=round(forward_ms(model, device), 3), modes={})
    print(f"forward alone: {result['forward_ms']} ms per decode step")
    prompt = [prompt_ids(model)]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for mode in args.modes.split(","):
        with LLM(target=model, draft=None if mode == "ar" else model, mode=mode, k=args.k, device=str(device),
                 dtype="bfloat16", max_batch=1, max_len=512, use_ray=False) as llm:
            # Warm-up as long as the timed run by default: graphs are captured on a shape's first use.
            warm = args.tokens if args.warmup_tokens is None else args.warmup_tokens
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=warm, ignore_eos=True))
            before = llm.stats()
            # Python 3.12's cProfile (sys.monitoring) sees every thread with one profiler and allows no second;
            # before, a profiler sees its own thread: one for the coordinator (this one) and one per worker.
            per_thread = sys.version_info < (3, 12)
            profs = {"coordinator" if per_thread else "all": cProfile.Profile()}
            handles = llm._handles if per_thread else []
            for h in handles:
                profs[h.name] = cProfile.Profile()
                h._pool.submit(profs[h.name].enable).result()
            t0 = time.perf_counter()
            next(iter(profs.values())).enable()
            toks = llm.generate(prompt, sp)[0].token_ids
            next(iter(profs.values())).disable()
            wall = time.perf_counter() - t0
            for h in handles:
                h._pool.submit(profs[h.name].disable).result()
            st = llm.stats()
        rounds = st["rounds"] - before["rounds"]
        row = dict(tokens=len(toks), rounds=rounds, wall_s=round(wall, 4),
                   ms_per_round=round(1e3 * wall / rounds, 3), ms_per_token=round(1e3 * wall / len(toks), 3),
                   verify_ms_per_round=round(1e3 * (st["verify_s"] - before["verify_s"]) / rounds, 3),
                   draft_ms_per_round=round(1e3 * (st["draft_s"] - before["draft_s"]) / rounds, 3),
                   top={name: top(prof, args.top) for name, prof in profs.items()})
        result["modes"][mode] = row
        print(f"\n== {mode}: {row['tokens']} tokens, {rounds} rounds, {row['ms_per_round']} ms/round, "
              f"{row['ms_per_token']} ms/token; waiting on the target {row['verify_ms_per_round']} ms/round, "
              f"on drafts {row['draft_ms_per_round']} (under cProfile)")
        for name, rows in row["top"].items():
            print(f"  -- {name} thread")
            for r in rows:
                print(f"  {r['tottime_s']:8.4f} s own  {r['cumtime_s']:8.4f} s cum  {r['calls']:7d}  {r['function']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
