"""The same mode with its workers in this process (`use_ray=False`) and as Ray actors, side by side; over Ray
with the per-round calls on the actors' Unix-socket channel (`ray`, the default) and on Ray's own calls
(`ray-calls`, `ray_channel=False`).

    python benchmarks/layouts.py --mode sd --quantization w4a8 --draft-vocab 32768 --out results/layouts.json

Raw HumanEval 10-15 (the shared docs' reference prompts), greedy (or seeded sampling at `--temperature`),
`--max-tokens` each, both cores: the target
and the draft on both for sd / ar, target on the first and draft on the second for ssd / auto (over Ray, `auto`
then lends cores; in one process it does not). The layouts alternate `--rounds` times, each a fresh engine that
runs a warm-up request and then `--passes` passes over the prompts; the last pass counts. Per layout: decode
tok/s, and per round the coordinator's seconds waiting on the draft (drafts) and on the target (verifications),
which include each call's trip between processes where there is one. Outputs must be equal across layouts
(bit-exact kernels; sampling seeded per prompt). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import decode_part  # noqa: E402
from prompts import humaneval_raw  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402


def placement(mode: str, cores: list[int]) -> dict[str, list[int]]:
    """SSD and `auto`: the target on the first core, the draft on the second; the others share all cores."""
    if mode in ("ssd", "auto"):
        return {"target_cores": cores[:1], "draft_cores": cores[1:2]}
    return {"target_cores": cores, "draft_cores": cores}


def summarize(runs: dict[str, list[dict]]) -> tuple[dict[str, dict[str, float]], bool]:
    """Per layout the medians over its engines, and whether every engine gave the same outputs."""
    same = len({json.dumps(r["token_ids"]) for rs in runs.values() for r in rs}) == 1
    keys = ("decode_tokens_per_s", "draft_ms_per_round", "verify_ms_per_round")
    return {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}, same


LAYOUTS = {"in-process": {"use_ray": False}, "ray": {"use_ray": True, "ray_channel": True},
           "ray-calls": {"use_ray": True, "ray_channel": False}}


def run(args: argparse.Namespace, layout: str) -> dict:
    draft = None if args.mode == "ar" else args.draft
    llm = LLM(target=args.target, draft=draft, mode=args.mode, dtype="bfloat16", quantization=args.quantization,
              draft_vocab=args.draft_vocab, max_len=2048, **LAYOUTS[layout],
              **placement(args.mode, sorted(os.sched_getaffinity(0))))
    try:
        prompts = humaneval_raw(6, 10)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))
        for _ in range(args.passes):
            before = llm.stats()
            # Seeded per prompt: sampled outputs must match across layouts too.
            outs = [llm.generate([p], SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                     seed=i))[0] for i, p in enumerate(prompts)]
        after = llm.stats()
        tokens, seconds = map(sum, zip(*(decode_part(o) for o in outs), strict=True))
        rounds = after["rounds"] - before["rounds"]
        return {
            "decode_tokens_per_s": round(tokens / seconds, 2),
            "rounds": rounds,
            "draft_ms_per_round": round(1e3 * (after["draft_s"] - before["draft_s"]) / rounds, 2),
            "verify_ms_per_round": round(1e3 * (after["verify_s"] - before["verify_s"]) / rounds, 2),
            "policy": {k: v - before["policy"].get(k, 0) for k, v in after["policy"].items()},
            "token_ids": [list(o.token_ids) for o in outs],
        }
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="sd", choices=("ar", "sd", "ssd", "auto"))
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling (q crosses every round)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", type=lambda v: v.split(","), default=list(LAYOUTS),
                    help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--out", default="results/layouts.json")
    args = ap.parse_args(argv)
    if not args.layouts or any(n not in LAYOUTS for n in args.layouts):
        ap.error(f"--layouts takes names from {', '.join(LAYOUTS)}")
    if args.passes < 1 or args.rounds < 1:
        ap.error("--passes and --rounds must be at least 1")
    runs: dict[str, list[dict]] = {name: [] for name in args.layouts}
    for _ in range(args.rounds):
        for name in runs:
            r = run(args, name)
            runs[name].append(r)
            print(f"  {name:10s} {r['decode_tokens_per_s']:6.2f} decode tok/s, {r['rounds']} rounds, per round "
                  f"drafts {r['draft_ms_per_round']} ms, verifications {r['verify_ms_per_round']} ms", flush=True)
    summary, same = summarize(runs)
    print(f"\n{args.mode}, {args.quantization}: medians of {args.rounds} engines per layout; outputs equal: {same}")
    print("| layout | decode tok/s | drafts ms / round | verifications ms / round |")
    print("|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['decode_tokens_per_s']:.2f} | {s['draft_ms_per_round']:.2f} | "
              f"{s['verify_ms_per_round']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "outputs_equal": same, "runs": {
        name: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for name, rs in runs.items()}},
        indent=1))
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
