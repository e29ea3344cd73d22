"""llama.cpp on the very prompts of bench.py, in the same run (`bench.py --llama-cpp DIR`).

DIR holds a llama.cpp build's binaries; nothing in this project builds or vendors llama.cpp. Three
modes, each the tool llama.cpp ships for it, greedy, `max_tokens` new tokens per prompt:
  ar     llama-completion (plain decoding)
  ngram  llama-lookup (n-gram speculation from the context, its default draft length)
  draft  llama-speculative-simple (the draft model, up to 8 drafted tokens)
Flags as of llama.cpp 0c1e570 (older builds name the draft length --draft-max).
Rates come from each tool's own timers: decode_tokens_per_s leaves prompt processing out (as
bench.py's own decode rate does); tokens_per_s counts it in. Except for llama-speculative-simple: its decode
timer starts before its first round, which decodes the prompt's last token on the target and (in the builds
measured here) prefills the whole prompt on the draft model, so its decode rate counts that work in and reads
low (by ~5-8 % on HumanEval prompts, an estimate from a 0.5B prefill of ~140 tokens against ~39 s of decode;
not measured). Both speculative tools also run a few tokens past `-n` (they stop on the round after it).
On the Intel Xeon with AMX (sessions 13 and 50, llama.cpp 0c1e570), a `-DGGML_NATIVE=ON` build's AMX path crashed
llama-completion and llama-lookup in prompt processing (SIGSEGV in ggml_backend_amx_mul_mat; llama-bench's decode
ran): build without it (`-mno-amx-tile -mno-amx-int8 -mno-amx-bf16` in CMAKE_C_FLAGS and CMAKE_CXX_FLAGS),
as the error then says.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

_SEGFAULT_HINT = (" (a segmentation fault: where llama.cpp was built with AMX, a build without it, -mno-amx-tile "
                  "-mno-amx-int8 -mno-amx-bf16 in CMAKE_C_FLAGS and CMAKE_CXX_FLAGS, ran)")

TOOLS = {"ar": "llama-completion", "ngram": "llama-lookup", "draft": "llama-speculative-simple"}

# llama-lookup / llama-speculative-simple: "encoded  N tokens in  S seconds" and "decoded  N tokens in  S seconds".
_CODED = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
# llama-completion (common_perf_print): "prompt eval time = X ms / N tokens" and "eval time = X ms / N runs".
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")


def command(bin_dir: str | Path, mode: str, target: str, draft: str, prompt: str, max_tokens: int,
            threads: int) -> list[str]:
    # The prompt goes as an argument, verbatim: `-f` drops a final newline and escapes are on by default.
    tool = str(Path(bin_dir) / TOOLS[mode])
    common = ["-m", target, "-p", prompt, "--no-escape", "-n", str(max_tokens), "-t", str(threads), "--temp", "0",
              "--seed", "0", "-c", "4096"]
    if mode == "ar":
        return [tool, *common, "-no-cnv"]
    if mode == "ngram":
        return [tool, *common]
    return [tool, *common, "-md", draft, "-td", str(threads), "--spec-type", "draft-simple", "--spec-draft-n-max", "8"]


def parse(mode: str, log: str) -> dict:
    """tokens (generated), decode_tokens and seconds (the decode rate's numerator and denominator),
    prompt_seconds and, for the speculative tools, drafted / accepted."""
    if mode == "ar":
        prompt, decode = _PROMPT_EVAL.findall(log), _EVAL.findall(log)
        if not prompt or not decode:
            raise ValueError(f"no llama.cpp timings in the output of {TOOLS[mode]}:\n{log[-1500:]}")
        # The prompt's batch yields the first token; each later token costs one eval run.
        ms, runs = decode[-1]
        return {"tokens": int(runs) + 1, "decode_tokens": int(runs), "seconds": float(ms) / 1e3,
                "prompt_seconds": float(prompt[-1][0]) / 1e3}
    coded = {kind: (int(n), float(s)) for kind, n, s in _CODED.findall(log)}
    if "decoded" not in coded or "encoded" not in coded:
        raise ValueError(f"no llama.cpp timings in the output of {TOOLS[mode]}:\n{log[-1500:]}")
    n, seconds = coded["decoded"]
    # The first token comes from the prompt's logits (no decode cost): left out of the rate, as in bench.py.
    out = {"tokens": n, "decode_tokens": n - 1, "seconds": seconds, "prompt_seconds": coded["encoded"][1]}
    accepted, drafted = _ACCEPT.findall(log), _DRAFTED.findall(log)
    if accepted and drafted:
        out["drafted"], out["accepted"] = int(drafted[-1]), int(accepted[-1])
    return out


def run(bin_dir: str | Path, mode: str, target: str, draft: str, prompts: dict[str, list[str]], max_tokens: int,
        threads: int) -> dict[str, dict]:
    """{prompt set: row} with bench.py's row keys (tokens, seconds, tokens_per_s, decode_tokens_per_s)."""
    if mode not in TOOLS:
        raise ValueError(f"llama.cpp mode {mode!r}: expected one of {', '.join(TOOLS)}")
    if not (Path(bin_dir) / TOOLS[mode]).is_file():
        raise FileNotFoundError(f"{Path(bin_dir) / TOOLS[mode]} not found (build llama.cpp's {TOOLS[mode]})")
    results: dict[str, dict] = {}
    for name, texts in prompts.items():
        tokens = decode_tokens = drafted = accepted = 0
        decode_s = prompt_s = 0.0
        for text in texts:
            cmd = command(bin_dir, mode, target, draft, text, max_tokens, threads)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                hint = _SEGFAULT_HINT if proc.returncode == -signal.SIGSEGV else ""
                raise RuntimeError(f"{cmd[0]} exited {proc.returncode}{hint}:\n{proc.stderr[-1500:]}")
            got = parse(mode, proc.stdout + proc.stderr)
            tokens += got["tokens"]
            decode_tokens += got["decode_tokens"]
            decode_s += got["seconds"]
            prompt_s += got["prompt_seconds"]
            drafted += got.get("drafted", 0)
            accepted += got.get("accepted", 0)
        row = {"tokens": tokens, "seconds": round(decode_s + prompt_s, 3),
               "tokens_per_s": round(tokens / (decode_s + prompt_s), 2),
               "decode_tokens_per_s": round(decode_tokens / decode_s, 2)}
        if drafted:
            row["acceptance_rate"] = round(accepted / drafted, 3)
        results[name] = row
        print(f"  llama.cpp {mode:6s} threads={threads} {name:13s} "
              f"{row['decode_tokens_per_s']:6.2f} decode tok/s", flush=True)
    return results
