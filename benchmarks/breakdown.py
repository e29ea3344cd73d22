"""Where a decode step's time goes on the CPU fast path: the C kernel calls (linears, attention, norms)
versus everything else (Python and small torch ops), for one model and quantisation.

    python benchmarks/breakdown.py --model qwen-coder-0.5b --quantization w4a8

Wraps the `ssd.kernels.cpu` entry points with timers, decodes single tokens (or scores `--tokens N`
at once, as a verification does) over a 200-token cache and prints milliseconds per step; writes
results/breakdown-<model>-<quantization>[-n<N>][-v<V>[-full]].json. `--draft-vocab V` restricts the output
layer as a draft's `draft_vocab` does; `--full-vocab` then asks for the whole vocabulary's logits, as an SSD
glue row with `candidate_vocab="full"`.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from ssd.kernels import cpu as cpu_kernels
from ssd.workers.loader import load_model
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.dense import use_dense_kernels
from ssd.workers.models.hugepages import move_to_huge_pages
from ssd.workers.models.vocab_subset import draft_vocab_ids, restrict_head

KERNELS = ("decoder_layers", "linear", "linear_dense", "attend_rows", "rmsnorm", "silu_mul")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-coder-0.5b")
    ap.add_argument("--quantization", default="w4a8", choices=("w4a8", "w8a8", "bf16"),
                    help="bf16: unquantised weights through the dense kernel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens scored per step: 1 = a decode step, K + 1 = verifying K drafted tokens")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="restrict the output layer to the first N token ids (+ eos), as a draft's draft_vocab")
    ap.add_argument("--full-vocab", action="store_true",
                    help="with --draft-vocab: the whole vocabulary's logits (an SSD glue row, candidate_vocab=full)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: results/breakdown-<model>-<quantization>[-n<N>][-v<V>[-full]].json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    quant = None if args.quantization == "bf16" else args.quantization
    model = load_model(args.model, dtype=torch.bfloat16, quantization=quant, progress=False).model
    if quant is None:
        use_dense_kernels(model)
    if args.draft_vocab:
        eos = list(model.config.eos_token_ids)
        restrict_head(model, draft_vocab_ids(model.config.vocab_size, args.draft_vocab, eos))
    elif args.full_vocab:
        ap.error("--full-vocab needs --draft-vocab")
    move_to_huge_pages(model)  # as every CPU worker does
    runner = ModelRunner(model, max_slots=1, max_len=512)
    slot = runner.allocate()
    runner.forward([slot], [[(i * 7919) % 5000 + 100 for i in range(200)]], last_only=True)

    spent: collections.Counter[str] = collections.Counter()
    for name in KERNELS:
        fn = getattr(cpu_kernels, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            spent[_name] += time.perf_counter() - t0
            return out

        setattr(cpu_kernels, name, timed)  # the model code calls cpu_kernels.<name> at run time

    def step() -> None:
        runner.forward([slot], [[100 + i for i in range(args.tokens)]], last_only=args.tokens == 1,
                       full_vocab=args.full_vocab)
        runner.truncate(slot, 200)

    for _ in range(3):
        step()
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    total = (time.perf_counter() - t0) / args.steps * 1e3
    per = {k: spent[k] / args.steps * 1e3 for k in KERNELS}
    rest = total - sum(per.values())
    what = "decode step" if args.tokens == 1 else f"{args.tokens}-token verification"
    print(f"{args.model} {args.quantization} {args.threads} threads: {total:.1f} ms per {what}")
    for k, v in [*per.items(), ("everything else", rest)]:
        print(f"  {k:<16} {v:7.1f} ms  {100 * v / total:5.1f} %")
    tag = ("" if args.tokens == 1 else f"-n{args.tokens}") + (f"-v{args.draft_vocab}" if args.draft_vocab else "") + (
        "-full" if args.full_vocab else "")
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" /
               f"breakdown-{args.model}-{args.quantization}{tag}.json")
    out.write_text(json.dumps(dict(args=vars(args), step_ms=round(total, 2),
                                   ms={**{k: round(v, 2) for k, v in per.items()}, "rest": round(rest, 2)}), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
