"""Model-execution benchmark: one ModelRunner (no engine, no draft) per model x quantisation x threads.

For qwen-coder-1.5b and qwen-coder-0.5b it measures, side by side in one process:
  * AR decode: per-token latency (median over steps) and tokens/s, batch 1, after a ~200-token prompt;
  * scoring n = 1, 2, 4, 8, 16 new tokens in one forward over a ~200-token cache (what verifying
    K = n - 1 drafted tokens costs), and the ratio t(8) / t(1);
for quantization None (bf16 weights), "int8" and "int4" (weight-only, workers/models/quant.py) and
"w4a8" / "w8a8" / "w4a8-all" / "w4a8-g64" (int8 activations, AVX2 kernel: workers/models/blockquant.py), next to
transformers' own model code in bf16 over the very same tensors (workers/models/hf_export.py).
`--llama-cpp PATH` adds llama-bench (PATH = the llama-bench binary) on the same GGUF files.

On a GPU (`--device cuda`) the variants are bf16 with CUDA graphs, bf16 eager, int8 / int4 where
this torch has the CUDA kernels, and transformers; `--random-weights` builds each model with the
real one's shapes (SHAPES) and random weights, for a machine without the model files (speed does
not depend on the weights' values).

Measurements are interleaved round by round across variants, so a busy machine slows all of them
alike; medians are reported. Each row also gives the weights a decode step streams (MB/tok) and
the tokens/s that the probe's read rate would allow if nothing else cost time ("bound"). The probe (a
`sum` over 512 MiB on ordinary pages, once before the rounds) is not an upper bound: the weights sit on
huge pages and the memory's speed drifts, and decode has beaten it by up to 25 % (sessions 40 and 45).

    python benchmarks/runner.py --quick          # ~5 min on 2 cores
    python benchmarks/runner.py --threads 1,2 --decode-tokens 64 --reps 9
    python benchmarks/runner.py --device cuda --random-weights --modes bf16,bf16-eager,int8,int4
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ssd.kernels.sampling import argmax_last
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.config import ModelConfig
from ssd.workers.models.decoder import DecoderModel
from ssd.workers.models.dense import use_dense_kernels
from ssd.workers.models.hugepages import move_to_huge_pages
from ssd.workers.models.quant import cuda_kernel_available, quantize_model

MODELS = ("qwen-coder-1.5b", "qwen-coder-0.5b")
NS = (1, 2, 4, 8, 16)
CACHE = 200
_QWEN = dict(arch="qwen2", vocab_size=151936, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
             max_position_embeddings=32768, attention_bias=True)
# The real models' shapes (tests/test_loader_real.py checks them against the GGUF files).
SHAPES = {
    "qwen-coder-1.5b": dict(_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                            num_attention_heads=12, head_dim=128),
    "qwen-coder-0.5b": dict(_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                            num_attention_heads=14, head_dim=64),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth_gbs(device: torch.device, reps: int = 5) -> float:
    """Best-of-reps rate of summing a 512 MiB int64 tensor on `device` (CPU: torch's current threads), GB/s."""
    a = torch.ones(64 * 1024 * 1024, dtype=torch.int64, device=device)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        a.sum()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 8 / best / 1e9


def random_model(alias: str, device: torch.device) -> DecoderModel:
    """The real model's shapes with random bf16 weights (N(0, 0.02)), built on `device`."""
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderModel(ModelConfig(**SHAPES[alias])).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def weight_bytes_per_token(model) -> int:
    """Bytes a decode step must stream: every weight except the embedding table (one row is read)."""
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items()
               if not name.startswith("embed_tokens."))


class OurVariant:
    def __init__(self, model, label: str, cuda_graphs: bool = True) -> None:
        self.label, self.impl = label, "ssd"
        self.model = model
        self.weight_bytes = weight_bytes_per_token(model)
        self.device = model.embed_tokens.weight.device
        if self.device.type == "cpu":
            move_to_huge_pages(model)  # as every CPU worker does
        self.runner = ModelRunner(model, max_slots=1, max_len=CACHE + 256, device=self.device,
                                  cuda_graphs=cuda_graphs)
        self.slot = self.runner.allocate()
        self.runner.forward([self.slot], [[(i * 7919) % 5000 + 100 for i in range(CACHE)]], last_only=True)

    def score(self, n: int) -> float:
        t0 = time.perf_counter()
        self.runner.forward([self.slot], [[100 + i for i in range(n)]], last_only=n == 1)
        sync(self.device)
        dt = time.perf_counter() - t0
        self.runner.truncate(self.slot, CACHE)
        return dt

    def decode(self, steps: int) -> list[float]:
        ts, tok = [], 100
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = self.runner.forward([self.slot], [[tok]], last_only=True)
            tok = int(argmax_last(logits[0]))  # greedy as the engine takes it
            ts.append(time.perf_counter() - t0)
        self.runner.truncate(self.slot, CACHE)
        return ts


class HFVariant:
    """transformers' Qwen2 code, bf16, sharing our tensors; a DynamicCache cropped back after each call."""

    def __init__(self, model) -> None:
        from ssd.workers.models.hf_export import to_transformers

        self.label, self.impl = "bf16", "transformers"
        self.weight_bytes = weight_bytes_per_token(model)
        self.hf = to_transformers(model)
        self.device = model.embed_tokens.weight.device
        self.hf.to(self.device)
        from transformers import DynamicCache

        self.cache = DynamicCache()
        ids = torch.tensor([[(i * 7919) % 5000 + 100 for i in range(CACHE)]], device=self.device)
        with torch.inference_mode():
            self.hf(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    def _reset(self) -> None:
        extra = self.cache.get_seq_length() - CACHE
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5: a negative count removes that many tokens

    def _fwd(self, ids: list[int], keep: int) -> torch.Tensor:
        with torch.inference_mode():
            out = self.hf(input_ids=torch.tensor([ids], device=self.device), past_key_values=self.cache, use_cache=True,
                          logits_to_keep=keep)
        return out.logits

    def score(self, n: int) -> float:
        t0 = time.perf_counter()
        self._fwd([100 + i for i in range(n)], 1 if n == 1 else 0)
        sync(self.device)
        dt = time.perf_counter() - t0
        self._reset()
        return dt

    def decode(self, steps: int) -> list[float]:
        ts, tok = [], 100
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = int(self._fwd([tok], 1)[0, -1].argmax())
            ts.append(time.perf_counter() - t0)
        self._reset()
        return ts


def build_cuda_variants(alias: str, modes: list[str], with_hf: bool, random_weights: bool) -> list:
    dev = torch.device("cuda")
    if random_weights:
        base = random_model(alias, dev)
    else:
        from ssd.workers.loader import load_model

        base = load_model(alias, dtype=torch.bfloat16, progress=False).model.to(dev)
    variants = []
    if "bf16" in modes:
        variants.append(OurVariant(base, "bf16"))
    if "bf16-eager" in modes:
        variants.append(OurVariant(base, "bf16-eager", cuda_graphs=False))
    if with_hf:
        variants.append(HFVariant(base))
    for mode in ("int8", "int4"):
        if mode not in modes:
            continue
        if not cuda_kernel_available(mode):
            print(f"{alias}: no CUDA kernel for {mode} in torch {torch.__version__}; skipped", flush=True)
            continue
        variants.append(OurVariant(quantize_model(copy.deepcopy(base), mode), mode))
    return variants


def build_variants(alias: str, modes: list[str], with_hf: bool) -> list:
    from ssd.workers.loader import load_model

    variants = []
    base = load_model(alias, dtype=torch.bfloat16, progress=False).model
    if "bf16" in modes:  # bf16 weights through the dense C kernel (what the engine runs by default on CPU)
        m = load_model(alias, dtype=torch.bfloat16, progress=False).model
        variants.append(OurVariant(use_dense_kernels(m), "bf16"))
    if "bf16-torch" in modes:  # the same model through torch's F.linear (linear_kernel="torch")
        variants.append(OurVariant(base, "bf16-torch"))
    if with_hf:
        variants.append(HFVariant(base))
    for mode in modes:
        if mode in ("int8", "int4", "w4a8", "w8a8", "w4a8-all", "w4a8-g64"):
            m = load_model(alias, dtype=torch.bfloat16, quantization=mode, progress=False).model
            variants.append(OurVariant(m, mode))
        elif mode == "int4-all":  # every linear, lm_head included, int4 round-to-nearest from the bf16 weights
            m = load_model(alias, dtype=torch.bfloat16, progress=False).model
            variants.append(OurVariant(quantize_model(m, "int4", head="int4"), mode))
    return variants


def bench_model(alias: str, args) -> list[dict]:
    if args.device == "cuda":
        variants = build_cuda_variants(alias, args.modes, not args.no_transformers, args.random_weights)
    else:
        variants = build_variants(alias, args.modes, not args.no_transformers)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for v in variants:  # warm-up: allocator, rope table, OpenMP pool, graph captures
            for n in NS:
                v.score(n)
            v.decode(2)
        bw = read_bandwidth_gbs(torch.device(args.device))
        score = {v: {n: [] for n in NS} for v in variants}
        decode = {v: [] for v in variants}
        for _ in range(args.reps):
            for v in variants:
                for n in NS:
                    score[v][n].append(v.score(n))
                decode[v] += v.decode(max(1, args.decode_tokens // args.reps))
        for v in variants:
            ms = {n: statistics.median(score[v][n]) * 1e3 for n in NS}
            dec = statistics.median(decode[v]) * 1e3
            rows.append(dict(
                model=alias, impl=v.impl, quantization=v.label, threads=threads, device=args.device,
                decode_ms=round(dec, 2), tok_s=round(1e3 / dec, 2),
                score_ms={str(n): round(t, 2) for n, t in ms.items()},
                verify8_over_decode1=round(ms[8] / ms[1], 2),
                decode_min_ms=round(min(decode[v]) * 1e3, 2),
                # memory-bandwidth bound: weights streamed once per token at the measured read rate
                weight_mb=round(v.weight_bytes / 1e6, 1), read_gb_s=round(bw, 2),
                bandwidth_bound_tok_s=round(bw * 1e9 / v.weight_bytes, 2),
            ))
            print(fmt_row(rows[-1]), flush=True)
    del variants
    gc.collect()
    return rows


def llama_bench(path: str, alias: str, threads: list[int], n_gen: int) -> list[dict]:
    from ssd.workers.loader import resolve_alias

    rows = []
    for t in threads:
        cmd = [path, "-m", resolve_alias(alias), "-p", "0", "-n", str(n_gen), "-t", str(t), "-o", "json"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
            res = json.loads(out)[0]
            tok_s = float(res["avg_ts"])
            rows.append(dict(model=alias, impl="llama.cpp", quantization="gguf", threads=t,
                             decode_ms=round(1e3 / tok_s, 2), tok_s=round(tok_s, 2), score_ms={}))
        except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as e:
            rows.append(dict(model=alias, impl="llama.cpp", threads=t, error=str(e)[:300]))
        print(fmt_row(rows[-1]), flush=True)
    return rows


HEADER = (f"{'model':<16} {'impl':<12} {'quant':<10} {'thr':>3} {'ms/tok':>8} {'tok/s':>7} "
          + " ".join(f"{'n=' + str(n):>7}" for n in NS) + f" {'t8/t1':>6} {'MB/tok':>7} {'bound':>6}")


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<16} {r['impl']:<12} error: {r['error']}"
    sc = " ".join(f"{r['score_ms'].get(str(n), float('nan')):>7.1f}" for n in NS)
    ratio = r.get("verify8_over_decode1")
    return (f"{r['model']:<16} {r['impl']:<12} {r['quantization']:<10} {r['threads']:>3} {r['decode_ms']:>8.1f} "
            f"{r['tok_s']:>7.2f} {sc} {ratio if ratio is not None else '':>6} {r.get('weight_mb', ''):>7} "
            f"{r.get('bandwidth_bound_tok_s', ''):>6}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default="bf16,int8,int4,w4a8",
                    help="of bf16, bf16-torch, int8, int4, int4-all, w4a8, w8a8, w4a8-all, w4a8-g64 (cpu); "
                         "bf16, bf16-eager, int8, int4 (cuda)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--random-weights", action="store_true", help="the models' shapes with random weights")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7, help="rounds; each scores every n once per variant")
    ap.add_argument("--decode-tokens", type=int, default=42, help="decode steps per variant, over all rounds")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 12 decode steps")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--llama-cpp", metavar="PATH", help="llama-bench binary (not built by this project)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results" / "runner.json"))
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    args.threads = [int(t) for t in args.threads.split(",") if t]
    if args.quick:
        args.reps, args.decode_tokens = 3, 12
    max_threads = len(os.sched_getaffinity(0))
    args.threads = [t for t in args.threads if t <= max_threads] or [max_threads]
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device")
        args.threads = args.threads[-1:]  # host threads barely matter to GPU decode
    elif args.random_weights:
        ap.error("--random-weights is for --device cuda (on CPU the real models are installed)")

    print(HEADER)
    rows: list[dict] = []
    for alias in args.models:
        rows += bench_model(alias, args)
        if args.llama_cpp:
            rows += llama_bench(args.llama_cpp, alias, args.threads, 32)
    result = dict(
        machine=dict(cpu=platform.processor() or platform.machine(), cores=max_threads,
                     gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                     cpu_capability=torch.backends.cpu.get_cpu_capability(), torch=torch.__version__,
                     python=sys.version.split()[0], loadavg_at_end=[round(x, 2) for x in os.getloadavg()]),
        settings=dict(cache_tokens=CACHE, ns=list(NS), reps=args.reps, decode_tokens=args.decode_tokens,
                      device=args.device, random_weights=args.random_weights),
        rows=rows,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
