"""`python -m ssd.demo`: the embedded default end to end.

Streams answers to a few sample prompts from the qwen-coder-1.5b target (qwen-coder-0.5b draft),
with tokens/s, then runs the same prompts through every mode and prints them side by side.
"""

from __future__ import annotations

import argparse
import sys
import time

from ssd import LLM, SamplingParams

SAMPLE_PROMPTS = [
    "Write a Python function `is_prime(n)` that checks whether n is prime.",
    "Explain in two sentences what a KV cache is in a transformer.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
]
MODES = ["ar", "sd", "ngram", "ssd", "auto"]


def chat(llm: LLM, text: str) -> str:
    assert llm.tokenizer is not None
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="qwen-coder-1.5b")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="default: the engine's ('auto': w4a8 for the qwen-coder "
                    "GGUFs on CPU); 'none': unquantised")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    extra = {"quantization": None if args.quantization == "none" else args.quantization} if args.quantization else {}
    results: dict[str, list[tuple[float, float]]] = {}
    first = True
    for mode in modes:
        print(f"\n=== mode {mode} ===", flush=True)
        with LLM(target=args.target, draft=None if mode in ("ar", "ngram") else args.draft, mode=mode,
                 dtype=args.dtype, max_batch=1, **extra) as llm:
            llm.generate([chat(llm, "Hi")], SamplingParams(temperature=0, max_tokens=4))  # warm-up
            for text in SAMPLE_PROMPTS:
                prompt = chat(llm, text)
                t0 = time.perf_counter()
                if first:
                    print(f"\n>>> {text}\n", flush=True)
                    for piece in llm.stream(prompt, sp):
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                    out = llm.last_stream_output
                else:
                    out = llm.generate([prompt], sp)[0]
                dt = time.perf_counter() - t0
                tps = len(out.token_ids) / dt
                results.setdefault(mode, []).append((tps, out.metrics["tau"]))
                print(f"\n[{mode}] {len(out.token_ids)} tokens in {dt:.2f}s = {tps:.1f} tokens/s, "
                      f"tau {out.metrics['tau']:.2f}", flush=True)
            first = False
    print("\n| mode | " + " | ".join(f"prompt {i + 1} tok/s" for i in range(len(SAMPLE_PROMPTS))) + " | mean |")
    print("|---|" + "---|" * (len(SAMPLE_PROMPTS) + 1))
    for mode, rows in results.items():
        mean = sum(r[0] for r in rows) / len(rows)
        print(f"| {mode} | " + " | ".join(f"{r[0]:.1f}" for r in rows) + f" | {mean:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
