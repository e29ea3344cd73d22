"""This checkout's CPU kernels against another version's, alternated in one process on one real model.

Sequential runs of `benchmarks/runner.py` on two commits drift by 5-10 % on a shared machine, more than
most kernel changes. Here both kernel libraries are loaded at once (the base built from `--base`: a git
revision of this repository, or a `kernels/cpu` folder of another checkout) and every round times the
same forwards with one and then the other, in alternating order, on the same weights and KV cache.

    python benchmarks/kernel_ab.py --base HEAD~1 --model qwen-coder-1.5b --threads 1,2
    python benchmarks/kernel_ab.py --base main --layers q4,q6 --rows 1,8

`--layers FORMATS` times random layers of those block formats instead of a model (each call runs `--count`
layers of `--shape` K,N, streamed from memory in huge pages as a model's are): ms per call and GMAC/s of each
version by row count, what tells which format a change helps.

`--attention` times the attention kernel alone (`attend_rows`, one call per layer of `--model`'s head shapes, bf16
cache of `--context` keys, `--rows` consecutive tokens of one sequence as a verification block has them).

`--caller thread` times the forwards from a second thread while the main thread, which loaded the model, keeps
its own OpenMP team: how an in-process worker (ssd/handles.py LocalHandle) runs.

Prints ms per forward (median) for each (threads, n) and the ratio new / base, t(8) / t(1) of each,
and whether both give the same logits (they must, unless the change alters the numerics on purpose);
writes results/kernel_ab-<model>.json (--layers: kernel_ab-layers.json; --attention: kernel_ab-attention-<model>.json)
unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from alternate import Variant, alternate, prefilled, report  # noqa: E402
from runner import SHAPES  # noqa: E402

from ssd.kernels import cpu as qk  # noqa: E402
from ssd.workers.loader import load_model  # noqa: E402
from ssd.workers.models.blockquant import W4A8Linear, W5A8Linear, W6A8Linear, W8A8Linear  # noqa: E402
from ssd.workers.models.hugepages import move_to_huge_pages  # noqa: E402

LAYERS = {"q4": W4A8Linear, "q5": W5A8Linear, "q6": W6A8Linear, "q8": W8A8Linear}


ROOT = Path(__file__).resolve().parent.parent


def base_library(base: str) -> object:
    """This CPU's best build of the kernel sources in folder `base`, or else at git revision `base`."""
    folder = Path(base)
    if folder.is_dir():
        if not (folder / qk.SOURCES[0]).is_file():
            raise SystemExit(f"kernel_ab: --base {base} has no {qk.SOURCES[0]}")
        return qk.load(qk.isa(), folder)
    rel = Path(qk.__file__).parent.relative_to(ROOT).as_posix()
    with tempfile.TemporaryDirectory() as tmp:
        for name in (*qk.SOURCES, *qk.HEADERS):
            proc = subprocess.run(["git", "-C", str(ROOT), "show", f"{base}:{rel}/{name}"], capture_output=True)
            if proc.returncode != 0:
                raise SystemExit(f"kernel_ab: --base {base!r} is neither a folder nor a revision with {rel}/{name}: "
                                 f"{proc.stderr.decode().strip()}")
            (Path(tmp) / name).write_bytes(proc.stdout)
        return qk.load(qk.isa(), Path(tmp))


def timed_alternately(libs: dict[str, object], call, rounds: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median ms of `call()` on each library, the libraries alternated round by round (4 calls per turn, the first
    untimed), and each library's last output."""
    spent: dict[str, list[float]] = {name: [] for name in libs}
    outs = {}
    try:
        for r in range(rounds):
            for name in list(libs) if r % 2 == 0 else list(libs)[::-1]:
                qk.use(libs[name])
                for rep in range(4):
                    t0 = time.perf_counter()
                    outs[name] = call()
                    if rep > 0:
                        spent[name].append(time.perf_counter() - t0)
    finally:
        qk.use(None)
    return {name: statistics.median(t) * 1e3 for name, t in spent.items()}, outs


@torch.inference_mode()
def layers_ab(libs: dict[str, object], formats: list[str], k: int, n: int, count: int, rows: list[int],
              rounds: int) -> list[dict]:
    """Median ms per call of `count` random [n, k] layers of each format on each library, rows by rows,
    alternated as `alternate` does, and whether each library's outputs have the first's bits."""
    g = torch.Generator().manual_seed(0)
    table = []
    for fmt in formats:
        mods = [LAYERS[fmt].from_float(torch.randn(n, k, generator=g) * 0.02, None, torch.bfloat16)
                for _ in range(count)]
        for mod in mods:
            move_to_huge_pages(mod)
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            ms, outs = timed_alternately(libs, lambda x=x, mods=mods: torch.cat([mod(x) for mod in mods], dim=1),
                                         rounds)
            first = next(iter(libs))
            table.append(dict(format=fmt, rows=m, ms={lib: round(t, 3) for lib, t in ms.items()},
                              gmac_s={lib: round(m * k * n * count / t / 1e6, 1) for lib, t in ms.items()},
                              same_bits={lib: bool(torch.equal(outs[first], o)) for lib, o in outs.items()}))
    return table


def attention_ab(libs: dict[str, object], heads: int, kv_heads: int, head_dim: int, layers: int, context: int,
                 rows: list[int], rounds: int) -> list[dict]:
    """Median ms of `layers` attend_rows calls on each library for R tokens of one sequence (token i sees
    context + i + 1 keys), R in rows, alternated; whether each library's outputs have the first's bits."""
    g = torch.Generator().manual_seed(0)
    max_len = context + max(rows) + 1
    kc = torch.randn(1, kv_heads, max_len, head_dim, generator=g).bfloat16()
    vc = torch.randn(1, kv_heads, max_len, head_dim, generator=g).bfloat16()
    table = []
    for m in rows:
        q = torch.randn(m, heads, head_dim, generator=g).bfloat16()
        plan = qk.RowPlan.from_rows([(0, i, 0, context + i + 1) for i in range(m)])

        def call(q=q, plan=plan) -> torch.Tensor:
            for _ in range(layers):
                out = qk.attend_rows(q, kc, vc, plan)
            return out

        ms, outs = timed_alternately(libs, call, rounds)
        first = next(iter(libs))
        table.append(dict(rows=m, ms={name: round(t, 3) for name, t in ms.items()},
                          same_bits={name: bool(torch.equal(outs[first], o)) for name, o in outs.items()}))
    return table


def main_attention(args: argparse.Namespace, libs: dict[str, object], threads: list[int]) -> int:
    if args.model not in SHAPES:
        raise SystemExit(f"kernel_ab: --attention: --model must be one of {', '.join(SHAPES)}")
    shape = SHAPES[args.model]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, layers = shape["head_dim"], shape["num_hidden_layers"]
    rows = [int(r) for r in args.rows.split(",")]
    result = {}
    for t in threads:
        torch.set_num_threads(t)
        table = attention_ab(libs, heads, kv_heads, head_dim, layers, args.context, rows, args.rounds)
        result[str(t)] = table
        print(f"{args.model} attention ({heads} heads, {kv_heads} KV heads, head_dim {head_dim}), {layers} calls over "
              f"{args.context}+ keys, {qk.isa()} build, {t} thread(s), ms (median of {3 * args.rounds}); "
              "* = new's bits differ from base's")
        print(f"{'rows':>4} {'base':>8} {'new':>8} {'new/base':>9}")
        for r in table:
            mark = "" if r["same_bits"]["new"] else " *"
            print(f"{r['rows']:>4} {r['ms']['base']:8.3f} {r['ms']['new']:8.3f} "
                  f"{r['ms']['new'] / r['ms']['base']:9.3f}{mark}")
    out = Path(args.out or ROOT / "results" / f"kernel_ab-attention-{args.model}.json")
    out.write_text(json.dumps(dict(args=vars(args), isa=qk.isa(), threads=result), indent=1))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision, or kernels/cpu folder of another checkout")
    ap.add_argument("--model", default="qwen-coder-1.5b")
    ap.add_argument("--quantization", default="w4a8", choices=("w4a8", "w8a8"))
    ap.add_argument("--threads", default="2")
    ap.add_argument("--tokens", default="1,8", help="tokens scored per forward (1 = decode, K + 1 = verify K)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--caller", default="main", choices=("main", "thread"),
                    help="thread: from a second thread, the main thread's OpenMP team still there (in-process workers)")
    ap.add_argument("--layers", default=None, help="random layers of these formats (e.g. q4,q6) instead of a model")
    ap.add_argument("--shape", default="8960,1536", help="--layers: K,N of each layer")
    ap.add_argument("--count", type=int, default=6, help="--layers: layers per call")
    ap.add_argument("--rows", default="1,4,8,16", help="--layers: activation rows per call; --attention: tokens")
    ap.add_argument("--attention", action="store_true", help="the attention kernel alone, --model's head shapes")
    ap.add_argument("--context", type=int, default=200, help="--attention: keys before the first token")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    ns = [int(n) for n in args.tokens.split(",")]
    libs = {"base": base_library(args.base), "new": qk.load(qk.isa())}
    if args.layers:
        return main_layers(args, libs, threads)
    if args.attention:
        return main_attention(args, libs, threads)

    model = load_model(args.model, dtype=torch.bfloat16, quantization=args.quantization, progress=False).model
    move_to_huge_pages(model)  # as every CPU worker does
    shared = prefilled(model, max(ns))

    variants = {name: Variant(shared.runner, shared.slot, enter=lambda lib=lib: qk.use(lib))
                for name, lib in libs.items()}
    if args.caller == "thread":
        with ThreadPoolExecutor(1) as pool:
            spent, logits = pool.submit(alternate, variants, threads, ns, args.rounds).result()
    else:
        spent, logits = alternate(variants, threads, ns, args.rounds)
    qk.use(None)
    caller = "a second thread" if args.caller == "thread" else "the main thread"
    print(f"{args.model} {args.quantization}, {qk.isa()} build, called from {caller}, "
          f"ms per forward (median of {3 * args.rounds})")
    rows, same = report(spent, logits, "base", "new", threads, ns)
    out = Path(args.out or ROOT / "results" / f"kernel_ab-{args.model}.json")
    out.write_text(json.dumps(dict(args=vars(args), isa=qk.isa(), rows=rows, same_logits=same), indent=1))
    print(f"wrote {out}")
    return 0


def main_layers(args: argparse.Namespace, libs: dict[str, object], threads: list[int]) -> int:
    formats = args.layers.split(",")
    if bad := set(formats) - set(LAYERS):
        raise SystemExit(f"kernel_ab: --layers: unknown {', '.join(sorted(bad))}; one of {', '.join(LAYERS)}")
    k, n = (int(v) for v in args.shape.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    result = {}
    for t in threads:
        torch.set_num_threads(t)
        table = layers_ab(libs, formats, k, n, args.count, rows, args.rounds)
        result[str(t)] = table
        print(f"{args.count} random {k}x{n} layers per call, {qk.isa()} build, {t} thread(s), ms per call "
              f"(median of {3 * args.rounds}); GMAC/s; * = new's bits differ from base's")
        print(f"{'format':>6} {'rows':>4} {'base':>8} {'new':>8} {'new/base':>9} {'base':>7} {'new':>7}")
        for r in table:
            mark = "" if r["same_bits"]["new"] else " *"
            print(f"{r['format']:>6} {r['rows']:>4} {r['ms']['base']:8.3f} {r['ms']['new']:8.3f} "
                  f"{r['ms']['new'] / r['ms']['base']:9.3f} {r['gmac_s']['base']:7.1f} {r['gmac_s']['new']:7.1f}{mark}")
    out = Path(args.out or ROOT / "results" / "kernel_ab-layers.json")
    out.write_text(json.dumps(dict(args=vars(args), isa=qk.isa(), threads=result), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
