"""Modes compared prompt by prompt: every mode's engine stays up, and each prompt runs in every mode before
the next prompt starts, in a rotating order.

`bench.py` runs one mode over all prompts, then the next: on these shared machines the speed drifts by
10-30 % between such blocks (session 18), more than most policy changes move a ratio. Here each prompt's
decode rates in the modes are measured minutes apart at most, and the summary is paired: the ratio of
every mode's decode time to the first mode's on the same prompt (geometric mean over prompts), and the
ratio of the totals.

    python benchmarks/paired.py --modes sd,auto --placement b --raw-humaneval --max-tokens 96 \\
        --quantization w4a8 --draft-vocab 32768 --out results/paired.json

Greedy, batch 1; the outputs of every mode must be equal token for token (they are checked). A mode may
carry engine settings after `+`, to compare variants of one mode: `--modes ssd+candidates=quota,ssd`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench import add_model_args, as_fed, decode_part, placement_kwargs, prompt_sets  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402


def variant(label: str) -> tuple[str, dict]:
    """'ssd+candidates=quota+fanout=4+use_ray=false' -> ('ssd', {'candidates': 'quota', 'fanout': 4,
    'use_ray': False})."""
    mode, *settings = label.split("+")
    kw: dict = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"mode setting {item!r} in {label!r} is not key=value")
        if value.lower() in ("true", "false"):
            kw[key] = value.lower() == "true"
            continue
        if value.lower() == "none":
            kw[key] = None
            continue
        for cast in (int, float):
            try:
                kw[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            kw[key] = value
    return mode, kw


def rotation(modes: list[str], i: int) -> list[str]:
    """The order of the modes for prompt i: each mode goes first, second, ... equally often."""
    j = i % len(modes)
    return modes[j:] + modes[:j]


def rate_of(r: dict) -> float | None:
    """A mode's decode rate on one prompt; None where nothing was decoded after the first delivery (an answer
    that ends within its first round)."""
    return r["decode_tokens"] / r["decode_s"] if r["decode_tokens"] > 0 and r["decode_s"] > 0 else None


def summary(per_prompt: list[dict[str, dict]], base: str) -> dict[str, dict]:
    """Per mode: total decode tokens / seconds, and against `base` the geometric mean of the per-prompt
    ratios of decode rates (over the prompts where every mode decoded something: `rated_prompts`) and the
    ratio of the total rates."""
    def total_rate(m: str) -> float:
        secs = sum(p[m]["decode_s"] for p in per_prompt)
        return sum(p[m]["decode_tokens"] for p in per_prompt) / secs if secs > 0 else 0.0

    rated = [p for p in per_prompt if all(rate_of(r) is not None for r in p.values())]
    base_total = total_rate(base)
    out = {}
    for m in per_prompt[0]:
        logs = [math.log(rate_of(p[m]) / rate_of(p[base])) for p in rated]  # type: ignore[operator]
        out[m] = {"decode_tokens_per_s": round(total_rate(m), 2),
                  "vs_base_geomean": round(math.exp(sum(logs) / len(logs)), 3) if logs else None,
                  "rated_prompts": len(rated),
                  "vs_base_total": round(total_rate(m) / base_total, 3) if base_total > 0 else None}
        looked_up = sum(p[m].get("cache_hits", 0) + p[m].get("cache_misses", 0) for p in per_prompt)
        if looked_up:  # SSD modes: the share of outcome-cache lookups that hit
            out[m]["hit_rate"] = round(sum(p[m].get("cache_hits", 0) for p in per_prompt) / looked_up, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--modes", default="sd,auto", help="the first is the base of the ratios")
    ap.add_argument("--placement", default="b", choices=("a", "b"))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--n-humaneval", type=int, default=0)
    ap.add_argument("--n-mtbench", type=int, default=0)
    ap.add_argument("--raw-humaneval", action="store_true", help="HumanEval 10-15 as raw prompts")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    ap.add_argument("--out", default="results/paired.json")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    sets = prompt_sets(args)
    if not sets:
        ap.error("no prompts: give --n-humaneval, --n-mtbench or --raw-humaneval")
    cores = sorted(os.sched_getaffinity(0))
    extra = {"quantization": args.quantization}  # None (no option): unquantised, not the engine's "auto"
    if args.draft_vocab:
        extra["draft_vocab"] = args.draft_vocab
    import ray

    # Every mode's engine stays up: Ray must have room for all their actors' reservations (each worker
    # pins itself to its cores whatever Ray books).
    ray.init(num_cpus=len(cores) * len(modes), include_dashboard=False, log_to_driver=False, logging_level="warning")
    llms = {}
    try:
        for m in modes:
            mode, settings = variant(m)
            draft = None if mode in ("ar", "ngram") else args.draft
            llms[m] = LLM(target=args.target, draft=draft, mode=mode, dtype=args.dtype, max_batch=1, max_len=2048,
                          use_ray=True, **placement_kwargs(args.placement, mode, cores), **{**extra, **settings})
            warm = as_fed(llms[m].tokenizer, "warm-up", ["hello"])
            llms[m].generate(warm, SamplingParams(temperature=0, max_tokens=8))
        tok = llms[modes[0]].tokenizer
        per_prompt: list[dict[str, dict]] = []
        results: dict = {"args": vars(args), "prompts": []}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for r in range(args.repeats):
            for name, texts in sets.items():
                for i, text in enumerate(as_fed(tok, name, texts)):
                    row: dict[str, dict] = {}
                    for m in rotation(modes, len(per_prompt)):
                        before = llms[m].stats()["policy"]
                        o = llms[m].generate([text], SamplingParams(temperature=0, max_tokens=args.max_tokens))[0]
                        after = llms[m].stats()["policy"]
                        n, secs = decode_part(o)
                        row[m] = {"decode_tokens": n, "decode_s": secs,
                                  "token_ids": list(o.token_ids),
                                  "cache_hits": o.metrics.get("cache_hits", 0),
                                  "cache_misses": o.metrics.get("cache_misses", 0),
                                  "policy": {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}}
                    same = all(row[m]["token_ids"] == row[modes[0]]["token_ids"] for m in modes)
                    per_prompt.append(row)
                    results["prompts"].append({"set": name, "index": i, "repeat": r, "same_tokens": same, **row})
                    rates = "  ".join(f"{m} {rate_of(row[m]) or 0:6.2f}" for m in modes)
                    print(f"  {name} {i} (pass {r}): {rates} decode tok/s{'' if same else '  OUTPUTS DIFFER'}",
                          flush=True)
                    out.write_text(json.dumps(results, indent=1))  # so far: a failure later loses no prompt
        results["summary"] = summary(per_prompt, modes[0])
        results["engine_stats"] = {m: llms[m].stats() for m in modes}
        results["seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        for llm in llms.values():
            llm.shutdown()
        ray.shutdown()
    print(f"\n| mode | decode tok/s | vs {modes[0]} (geomean of prompts) | vs {modes[0]} (totals) | hit rate |")
    print("|---|---|---|---|---|")
    for m, s in results["summary"].items():
        print(f"| {m} | {s['decode_tokens_per_s']} | {s['vs_base_geomean']}x | {s['vs_base_total']}x "
              f"| {s.get('hit_rate', '')} |")
    for m, st in results["engine_stats"].items():
        if st["verify_price_error"]:  # the policy's modes: how far its verification prices were off
            errors = ", ".join(f"{w} {e:.1%}" for w, e in st["verify_price_error"].items())
            print(f"{m}: mean verification price error {errors}")
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(p["same_tokens"] for p in results["prompts"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
