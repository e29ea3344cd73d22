"""End-to-end decoding benchmark on the real qwen-coder pair: AR, SD, n-gram SD, SSD, auto.

Prints a table and writes JSON. Two placements side by side (2-core machine):
  a  paper-style: the target on one core for every mode; SSD's draft on the second core
  b  same total cores for all: AR/SD/n-gram use both cores; SSD splits them target / draft, and
     auto lends the draft's core to the target in rounds where the draft idles (AR, SD, n-gram)
Optionally transformers' own generate() and assisted generate() on the same weights, dtype and
thread count, measured in the same run (--transformers), and llama.cpp's plain, n-gram and
draft-model decoding on the same GGUF files and prompts, all cores (--llama-cpp DIR, see llama_cpp.py).

    python benchmarks/bench.py --quick
    python benchmarks/bench.py --modes ar,sd,ngram,ssd,auto --n-humaneval 20 --n-mtbench 20
    python benchmarks/bench.py --modes ar,auto --placements b --raw-humaneval --quantization w4a8 --draft-vocab 32768 \
        --llama-cpp ~/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import llama_cpp  # noqa: E402
from prompts import humaneval, humaneval_raw, mtbench  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402


def placement_kwargs(placement: str, mode: str, cores: list[int]) -> dict:
    c0, c1 = cores[0], cores[-1]
    if placement == "a":
        if mode in ("ssd", "auto"):  # the target keeps to its core even where the draft idles
            return dict(target_cores=[c0], draft_cores=[c1], core_loans=False)
        return dict(target_cores=[c0], draft_cores=[c0])
    if mode in ("ssd", "auto"):  # auto: the target borrows the draft's core in rounds the draft idles
        return dict(target_cores=[c0], draft_cores=[c1])
    return dict(target_cores=cores, draft_cores=cores)


def decode_part(out) -> tuple[int, float]:
    """(tokens, seconds) of an output's decode: everything after the first delivery. Prefill (slow,
    compute-bound on CPU) is excluded, and so is the rest of the first round, whose tokens arrive with the
    first one (AR decodes `ar_steps` tokens a call, SD emits its first accepted draft): counting them over
    the time after it would overstate the rate by ~3-8 % at 96-128 tokens."""
    m = out.metrics
    return len(out.token_ids) - m["first_tokens"], m["latency_s"] - m["ttft_s"]


def as_fed(tok, name: str, texts: list[str]) -> list[str]:
    """The prompt texts as every system here is fed them: the raw HumanEval set as is, the rest chat-templated."""
    if name == "humaneval_raw":
        return texts
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def split_delta(before: dict, after: dict) -> dict:
    """One run's share of an engine's cumulative {key: {"hits": h, "misses": m}} split (stats' cache_by_*)."""
    delta = {k: {w: v[w] - before.get(k, {}).get(w, 0) for w in ("hits", "misses")} for k, v in after.items()}
    return {k: v for k, v in delta.items() if v["hits"] or v["misses"]}


def run_mode(args, mode: str, placement: str, prompts: dict[str, list[str]], temperature: float, batch: int) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    kw = placement_kwargs(placement, mode, cores)
    draft = None if mode in ("ar", "ngram") else args.draft
    extra = {"quantization": args.quantization}  # None (no option): unquantised, not the engine's "auto"
    if args.draft_quantization:
        extra["draft_quantization"] = None if args.draft_quantization == "none" else args.draft_quantization
    if args.draft_vocab:
        extra["draft_vocab"] = args.draft_vocab
    llm = LLM(target=args.target, draft=draft, mode=mode, dtype=args.dtype, k=args.k, max_batch=max(batch, 1),
              max_len=2048, use_ray=True, **kw, **extra)
    try:
        llm.generate(as_fed(llm.tokenizer, "warm-up", ["hello"]), SamplingParams(temperature=0, max_tokens=8))
        rows = {}
        for name, texts in prompts.items():
            ps = as_fed(llm.tokenizer, name, texts)
            sp = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=i) for i in range(len(ps))]
            before = llm.stats()
            t0 = time.perf_counter()
            outs = []
            for i in range(0, len(ps), batch):
                outs += llm.generate(ps[i : i + batch], sp[i : i + batch])
            dt = time.perf_counter() - t0
            after = llm.stats()
            toks = sum(len(o.token_ids) for o in outs)
            dec_n, dec_t = map(sum, zip(*(decode_part(o) for o in outs), strict=True))
            rounds = after["sequence_rounds"] - before["sequence_rounds"]  # tau: tokens per round of a sequence
            drafted = after["drafted_tokens"] - before["drafted_tokens"]
            acc = after["accepted_tokens"] - before["accepted_tokens"]
            hits = {k: after["cache_hits_per_k"].get(k, 0) - before["cache_hits_per_k"].get(k, 0)
                    for k in after["cache_hits_per_k"]}
            misses = {k: after["cache_misses_per_k"].get(k, 0) - before["cache_misses_per_k"].get(k, 0)
                      for k in after["cache_misses_per_k"]}
            nh, nm = sum(hits.values()), sum(misses.values())
            split = {key: split_delta(before[key], after[key]) for key in ("cache_by_source", "cache_by_budget")}
            policy = {k: v - before["policy"].get(k, 0) for k, v in after["policy"].items()}
            rows[name] = {
                "tokens": toks, "seconds": round(dt, 3), "tokens_per_s": round(toks / dt, 2),
                "decode_tokens_per_s": round(dec_n / dec_t, 2) if dec_t > 0 else None,
                "ttft_s": round(sum(o.metrics["ttft_s"] for o in outs) / len(outs), 3),
                "tau": round(toks / rounds, 3) if rounds else None,
                "acceptance_rate": round(acc / drafted, 3) if drafted else None,
                "cache_hit_rate": round(nh / (nh + nm), 3) if nh + nm else None,
                "hits_per_k": hits, "misses_per_k": misses, "by_source": split["cache_by_source"],
                "by_budget": split["cache_by_budget"], "policy": policy, "k": after["k"],
                "token_ids": [list(o.token_ids) for o in outs],
            }
            print(f"  {mode:6s} placement={placement} T={temperature} b={batch} {name:13s} "
                  f"{rows[name]['tokens_per_s']:6.2f} tok/s (decode {rows[name]['decode_tokens_per_s']}, "
                  f"ttft {rows[name]['ttft_s']} s) "
                  f"tau={rows[name]['tau']} "
                  f"hit={rows[name]['cache_hit_rate']} policy={policy}", flush=True)
        return rows
    finally:
        llm.shutdown()


def run_transformers(args, prompts: dict[str, list[str]], threads: int, assisted: bool) -> dict:
    import torch

    from ssd.workers.loader import load_model
    from ssd.workers.models.hf_export import to_transformers

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if args.dtype.startswith("b") else torch.float32
    target = load_model(args.target, dtype=dtype, progress=False)
    hf = to_transformers(target.model)
    hf_draft = to_transformers(load_model(args.draft, dtype=dtype, progress=False).model) if assisted else None
    tok = target.tokenizer
    rows = {}
    for name, texts in prompts.items():
        ps = as_fed(tok, name, texts)
        toks, t0 = 0, time.perf_counter()
        for p in ps:
            ids = torch.tensor([tok.encode(p)])
            kw = {"assistant_model": hf_draft} if assisted else {}
            with torch.inference_mode():
                out = hf.generate(ids, max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0,
                                  eos_token_id=tok.eos_token_ids, **kw)
            toks += out.shape[1] - ids.shape[1]
        dt = time.perf_counter() - t0
        rows[name] = {"tokens": toks, "seconds": round(dt, 3), "tokens_per_s": round(toks / dt, 2)}
        label = "hf-assisted" if assisted else "hf-ar"
        print(f"  {label:11s} threads={threads} {name:13s} {rows[name]['tokens_per_s']:6.2f} tok/s", flush=True)
    return rows


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The target / draft pair and how it is stored (shared with paired.py)."""
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, type=lambda v: None if v == "none" else v,
                    help="the target's (default: none, unquantised; 'auto': the engine's default)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="the draft proposes only the first N token ids")


def prompt_sets(args: argparse.Namespace) -> dict[str, list[str]]:
    """The prompt sets asked for (--n-humaneval, --n-mtbench, --raw-humaneval), by name."""
    sets: dict[str, list[str]] = {}
    if args.n_humaneval:
        sets["humaneval"] = humaneval(args.n_humaneval)
    if args.n_mtbench:
        sets["mtbench"] = mtbench(args.n_mtbench)
    if args.raw_humaneval:
        sets["humaneval_raw"] = humaneval_raw(6, start=10)
    return sets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--draft-quantization", default=None,
                    help="the draft's own (default: the engine's 'auto', w4a8-g64 under w4a8)")
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--modes", default="ar,sd,ngram,ssd,auto")
    ap.add_argument("--placements", default="a,b")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-humaneval", type=int, default=20)
    ap.add_argument("--n-mtbench", type=int, default=20)
    ap.add_argument("--raw-humaneval", action="store_true", help="HumanEval 10-15 as raw prompts (llama.cpp setting)")
    ap.add_argument("--transformers", action="store_true", help="also run transformers generate / assisted")
    ap.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp binaries (not built by this project): adds "
                    "its modes at placement b, on the same GGUF files and prompts")
    ap.add_argument("--llama-cpp-modes", default="ar,ngram,draft", help=f"of {', '.join(llama_cpp.TOOLS)}")
    ap.add_argument("--quick", action="store_true", help="3 HumanEval + 2 MT-Bench prompts, 64 tokens")
    ap.add_argument("--out", default="results/bench.json")
    args = ap.parse_args(argv)
    if args.llama_cpp and "b" not in args.placements.split(","):
        ap.error("--llama-cpp runs llama.cpp on all cores, next to placement b: add b to --placements")
    if args.quick:
        args.n_humaneval, args.n_mtbench, args.max_tokens = 3, 2, 64
    prompts = prompt_sets(args)
    results: dict = {"args": vars(args), "runs": []}
    for placement in args.placements.split(","):
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                for mode in args.modes.split(","):
                    rows = run_mode(args, mode, placement, prompts, temperature, batch)
                    results["runs"].append({"system": "ssd", "mode": mode, "placement": placement,
                                            "temperature": temperature, "batch": batch, "prompts": rows})
                    mark_same_as_ar(results)
                    save(results, args.out)  # a later failure loses nothing measured
        if args.llama_cpp and placement == "b":
            from ssd.workers.loader import resolve_alias

            cores = len(os.sched_getaffinity(0))
            texts = llama_cpp_prompts(args, prompts)
            for mode in args.llama_cpp_modes.split(","):
                run = {"system": "llama.cpp", "mode": mode, "placement": placement, "temperature": 0.0, "batch": 1,
                       "prompts": {}}
                try:
                    run["prompts"] = llama_cpp.run(args.llama_cpp, mode, resolve_alias(args.target),
                                                   resolve_alias(args.draft), texts, args.max_tokens, cores)
                except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:  # keep what ran
                    run["error"] = str(e)[-2000:]
                    print(f"  llama.cpp {mode}: failed: {run['error']}", flush=True)
                results["runs"].append(run)
                save(results, args.out)
        if args.transformers:
            threads = 1 if placement == "a" else len(os.sched_getaffinity(0))
            for assisted in (False, True):
                rows = run_transformers(args, prompts, threads, assisted)
                results["runs"].append({"system": "transformers", "mode": "assisted" if assisted else "ar",
                                        "placement": placement, "temperature": 0.0, "batch": 1, "prompts": rows})
    print_table(results)
    save(results, args.out)
    print(f"wrote {args.out}")
    return 0


def mark_same_as_ar(results: dict) -> None:
    """Greedy runs: how many outputs equal our AR's at the same placement, token for token (any batch size:
    the rows are batch-invariant). Every greedy mode should give all of them; the table shows it."""
    ar = {(r["placement"], name): row["token_ids"] for r in results["runs"]
          if r["system"] == "ssd" and r["mode"] == "ar" and r["temperature"] == 0
          for name, row in r["prompts"].items()}
    for r in results["runs"]:
        if r["system"] != "ssd" or r["mode"] == "ar" or r["temperature"] != 0:
            continue
        for name, row in r["prompts"].items():
            ref = ar.get((r["placement"], name))
            if ref is not None:
                same = sum(a == b for a, b in zip(row["token_ids"], ref, strict=True))
                row["same_as_ar"] = f"{same}/{len(ref)}"


def save(results: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=1))


def llama_cpp_prompts(args, prompts: dict[str, list[str]]) -> dict[str, list[str]]:
    """The prompt texts as bench.py's own runs feed them (chat-templated except the raw HumanEval set)."""
    import gguf

    from ssd.workers.loader import Tokenizer, resolve_alias

    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve_alias(args.target)))
    return {name: as_fed(tok, name, texts) for name, texts in prompts.items()}


def print_table(results: dict) -> None:
    # Speedups against the same system's AR in the same setting: on total tokens/s (prefill included,
    # the only rate transformers' generate() gives) and on the decode rate (ssd only).
    print("\n| system | mode | placement | T | batch | prompts | tok/s | speedup vs AR | decode tok/s "
          "| speedup vs AR (decode) | tau | accept | hit rate | = AR | policy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base: dict[tuple, tuple[float, float | None]] = {}
    for r in results["runs"]:
        for name, row in r["prompts"].items():
            if r["mode"] == "ar":
                key = (r["system"], r["placement"], r["temperature"], r["batch"], name)
                base[key] = (row["tokens_per_s"], row.get("decode_tokens_per_s"))
    for r in results["runs"]:
        for name, row in r["prompts"].items():
            ar_tot, ar_dec = base.get((r["system"], r["placement"], r["temperature"], r["batch"], name), (None, None))
            dec = row.get("decode_tokens_per_s")
            sp_tot = f"{row['tokens_per_s'] / ar_tot:.2f}x" if ar_tot else "-"
            sp_dec = f"{dec / ar_dec:.2f}x" if dec and ar_dec else "-"
            cells = [r["system"], r["mode"], r["placement"], r["temperature"], r["batch"], name,
                     f"{row['tokens_per_s']:.2f}", sp_tot, dec or "-", sp_dec, row.get("tau") or "-",
                     row.get("acceptance_rate") or "-", row.get("cache_hit_rate") or "-", row.get("same_as_ar", "-"),
                     row.get("policy") or "-"]
            print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
