"""Time to first token of `auto` at placement b (target and draft one core each; the target borrows the
draft's core where it idles) with the target's prefill split at `Mode.prefill_cut` (the rest on both
cores once the draft has prefilled) against the whole prompt on the target's own core, alternating
per prompt in one process.

    python benchmarks/prefill_split.py --out results/prefill_split.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from prompts import humaneval, mtbench  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="results/prefill_split.json")
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    llm = LLM(target=args.target, draft=args.draft, mode="auto", quantization=args.quantization,
              draft_vocab=args.draft_vocab, max_batch=1, max_len=2048, use_ray=True,
              target_cores=cores[:1], draft_cores=cores[-1:])
    try:
        mode, tok = llm.engine.mode, llm.tokenizer
        assert tok is not None
        split_cut = mode.prefill_cut
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in humaneval(2) + mtbench(2)]
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        rows: list[dict] = []
        for rep in range(args.reps):
            for i, p in enumerate(prompts):
                for variant in ("split", "whole") if (rep + i) % 2 == 0 else ("whole", "split"):
                    mode.prefill_cut = split_cut if variant == "split" else (lambda n: None)
                    n = len(tok.encode(p))
                    cut = split_cut(n)
                    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=args.max_tokens))[0]
                    rows.append({"variant": variant, "prompt": i, "prompt_tokens": n, "cut": cut,
                                 "ttft_s": round(o.metrics["ttft_s"], 3), "latency_s": round(o.metrics["latency_s"], 3),
                                 "tokens": len(o.token_ids)})
                    print(rows[-1], flush=True)
        mode.prefill_cut = split_cut
    finally:
        llm.shutdown()
    summary = {}
    print("\n| prefill | mean TTFT s | TTFT, prompts >= 100 tokens | tok/s incl. prefill |\n|---|---|---|---|")
    for v in ("whole", "split"):
        rs = [r for r in rows if r["variant"] == v]
        long_rs = [r["ttft_s"] for r in rs if r["prompt_tokens"] >= 100]
        summary[v] = {"ttft_s": round(statistics.mean(r["ttft_s"] for r in rs), 3),
                      "ttft_long_s": round(statistics.mean(long_rs), 3) if long_rs else None,
                      "tokens_per_s": round(sum(r["tokens"] for r in rs) / sum(r["latency_s"] for r in rs), 2)}
        print(f"| {v} | {summary[v]['ttft_s']} | {summary[v]['ttft_long_s']} | {summary[v]['tokens_per_s']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
