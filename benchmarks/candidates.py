"""Hit rates of SSD's candidate selections, replayed on real outputs: quotas (F_k per k from the geometric
fan-out) against ranking (the B likeliest outcomes, workers/ranking.py), for draft lengths K and budgets B.

    python benchmarks/candidates.py --from results/bench_w4a8_s21_half_a.json --quantization w4a8 \\
        --draft-vocab 32768 --out results/candidates.json

Takes the AR outputs (greedy, so every lossless mode emits them) of a `bench.py` run and replays greedy SD
rounds with the real draft: x_1..x_K are the draft's greedy tokens, k the accepted length and t* the target's
next token. The draft's distributions after each accepted prefix come from one forward over the whole
output; after a rejected token the draft continues on its own tokens, as in a live round. Each selection
then prepares its candidates from those distributions exactly as DraftWorker.speculate does, and a round
hits when (k, t*) is among them. The acceptance estimates both selections learn online (the quotas' a, the
ranking's g) start from the engine's priors for every prompt set.

Two ceilings come with them: `known k`, the hit rate if the draft knew how many tokens the target accepts and
spent all B candidates on that k (the top B of q_k without x_{k+1}), and `top`, the share of rounds whose t*
is among the RANK_TOP tokens kept of q_k at all. Ranking's gap to the first is the cost of not knowing k;
the second bounds every selection over the kept tokens, whatever the budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench import as_fed, prompt_sets  # noqa: E402

from ssd.fanout import FanoutPlanner  # noqa: E402
from ssd.workers.draft_worker import DraftWorker  # noqa: E402
from ssd.workers.ranking import AcceptanceByConfidence, Top, confidences, ranked_outcomes  # noqa: E402

SELECTIONS = ("quota", "ranked", "known_k")


class Replay:
    """One prompt + output in the draft's cache: the draft's greedy tokens and distributions along it.

    A restricted draft (draft_vocab) proposes from its kept ids plus the sequence's context, the prompt and
    the tokens emitted before the round (draft_vocab_context), as DraftWorker does."""

    def __init__(self, w: DraftWorker, prompt: list[int], out: list[int], context: bool = True) -> None:
        self.w, self.prompt, self.out, self.context = w, prompt, out, context
        self.slot = w.runner.allocate()
        logits = w.runner.forward([self.slot], [prompt + out], full_vocab=True)[0]  # [n, V]
        self.logits = logits[len(prompt) - 1: -1]  # [len(out), V]: after prompt + out[:j]
        self.keep = getattr(w.model.lm_head, "keep", None)
        self.cached = len(out)  # true output tokens in the cache

    def columns(self, p: int) -> torch.Tensor | None:
        """The ids the draft may propose in the round at output position p (None: all)."""
        if self.keep is None:
            return None
        kept = set(self.keep.tolist())
        extra = sorted({t for t in self.prompt + self.out[:p] if t not in kept}) if self.context else []
        return torch.cat([self.keep, torch.tensor(extra, dtype=torch.long)])

    def round(self, p: int, K: int) -> tuple[list[int], list[Top], list[Top], int]:
        """The greedy round from output position p: (x_1..x_K, whole-vocabulary tops of q_0..q_K, the
        drafting layer's tops of q_0..q_K, k accepted); fewer tops where the output ends first."""
        n, cols = len(self.out), self.columns(p)

        def greedy(row: torch.Tensor) -> int:
            return int(row.argmax()) if cols is None else int(cols[row.index_select(-1, cols).argmax()])

        rows: list[torch.Tensor] = []  # q_0, q_1, ...: logits after each prefix of the round
        x: list[int] = []
        while len(x) < K and p + len(x) < n:
            rows.append(self.logits[p + len(x)])
            x.append(greedy(rows[-1]))
            if x[-1] != self.out[p + len(x) - 1]:
                break
        k = next((i for i, t in enumerate(x) if t != self.out[p + i]), len(x))
        if k == len(x) and p + k < n:  # all accepted: q_K on the true prefix
            rows.append(self.logits[p + k])
        elif k < len(x):  # x_{k+1} is rejected: the draft drafts on from its own token
            self._cache_upto(p + k)
            while True:
                rows.append(self.w.runner.forward([self.slot], [[x[-1]]], full_vocab=True)[0, 0])
                if len(x) == K:
                    break
                x.append(greedy(rows[-1]))
            self.w.runner.truncate(self.slot, len(self.prompt) + p + k)  # the draft's own tokens out again
        stacked = torch.stack(rows)  # [<= K + 1, V]
        drafting = self.w._tops(stacked if cols is None else stacked.index_select(-1, cols), cols)
        return x, self.w._tops(stacked), drafting, k

    def _cache_upto(self, j: int) -> None:
        """The cache holds prompt + out[:j] (re-feeds true tokens a previous round's own tokens replaced)."""
        if self.cached < j:
            self.w.runner.forward([self.slot], [self.out[self.cached: j]], last_only=True)
        self.w.runner.truncate(self.slot, len(self.prompt) + j)
        self.cached = j

    def close(self) -> None:
        self.w.runner.free(self.slot)


def quota_candidates(x: list[int], tops: list[Top], fanout: list[int]) -> set[tuple[int, int]]:
    """DraftWorker.speculate's quota rule: the top F_k tokens of q_k, without x_{k+1}."""
    cands = set()
    for k, (ids, _) in enumerate(tops):
        f = fanout[k] if k < len(fanout) else 0
        ids = [t for t in ids if k >= len(x) or t != x[k]]
        cands.update((k, t) for t in ids[:f])
    return cands


def known_k_candidates(x: list[int], tops: list[Top], k: int, budget: int) -> set[tuple[int, int]]:
    """The ceiling selection: all `budget` candidates on the true accepted length k, i.e. the quota rule with
    F_k = budget and no other k."""
    return quota_candidates(x, tops, [0] * k + [budget])


def replay_set(w: DraftWorker, pairs: list[tuple[list[int], list[int]]], K: int, budgets: list[int],
               context: bool = True, candidate_vocab: str = "draft") -> dict:
    hits = {b: dict.fromkeys(SELECTIONS, 0) for b in budgets}
    rounds = emitted = in_top = 0
    planners = {b: FanoutPlanner(K=K, B=b) for b in budgets}
    accept = {b: AcceptanceByConfidence() for b in budgets}
    for seq_id, (prompt, out) in enumerate(pairs):
        rp = Replay(w, prompt, out, context)
        p = 0
        while p < len(out):
            x, tops, drafting, k = rp.round(p, K)
            if p + k >= len(out):
                break
            t_star = out[p + k]
            rounds += 1
            # as DraftWorker.speculate: quotas from the glue's rows, ranking from the distributions x_1..x_K
            # were drafted from and the glue's row for k = K; glue rows on the whole vocabulary or the
            # drafting ids (candidate_vocab)
            glue = tops if candidate_vocab == "full" else drafting
            ranked_tops = drafting[:K] + glue[K:]
            if len(tops) == K + 1:
                in_top += t_star in ranked_tops[k][0]
            for b in budgets:
                if len(tops) == K + 1:
                    fo = planners[b].plan(seq_id, "primary")
                    hit = (k, t_star) in quota_candidates(x, glue, fo)
                    planners[b].observe_hit(fo[k], hit)
                    hits[b]["quota"] += hit
                    hits[b]["ranked"] += (k, t_star) in ranked_outcomes(x, ranked_tops, b, accept[b].rate)
                    hits[b]["known_k"] += (k, t_star) in known_k_candidates(x, ranked_tops, k, b)
                    accept[b].observe(confidences(x, ranked_tops), k)
                planners[b].observe_round(seq_id, "primary", len(x), k)
            emitted += k + 1
            p += k + 1
        rp.close()
    rates = {str(b): {m: round(h / max(rounds, 1), 3) for m, h in hits[b].items()} for b in budgets}
    return {"rounds": rounds, "tau": round(emitted / max(rounds, 1), 3), "top": round(in_top / max(rounds, 1), 3),
            **rates}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", required=True, help="a bench.py JSON with an AR run (its outputs)")
    ap.add_argument("--draft", default="qwen-coder-0.5b")
    ap.add_argument("--quantization", default="w4a8")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--k", default="2,3,4")
    ap.add_argument("--budgets", default="1,2,3,4,6,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-context", action="store_true",
                    help="the restricted draft proposes its kept ids only (draft_vocab_context=False)")
    ap.add_argument("--candidate-vocab", choices=("draft", "full"), default="draft",
                    help="the ids the glue rows rank candidates over, as the engine's candidate_vocab")
    ap.add_argument("--out", default="results/candidates.json")
    args = ap.parse_args(argv)
    src = json.loads(Path(args.source).read_text())
    ar = next(r for r in src["runs"] if r["mode"] == "ar" and r["batch"] == 1 and r["temperature"] == 0)
    w = DraftWorker(args.draft, dtype="bfloat16", max_slots=1, max_len=4096, num_threads=args.threads,
                    quantization=args.quantization, draft_vocab=args.draft_vocab or None)
    texts = prompt_sets(argparse.Namespace(**src["args"]))
    ks, budgets = [int(v) for v in args.k.split(",")], [int(v) for v in args.budgets.split(",")]
    results: dict = {"args": vars(args), "sets": {}}
    print("| set | K | rounds | tau | " + " | ".join(f"B={b} quota / ranked / known k" for b in budgets) + " | top |")
    print("|---|---|---|---|" + "---|" * (len(budgets) + 1))
    for name, prompts in texts.items():
        outs = ar["prompts"][name]["token_ids"]
        pairs = [(w.tokenizer.encode(t), o) for t, o in zip(as_fed(w.tokenizer, name, prompts), outs, strict=True)]
        results["sets"][name] = {}
        for K in ks:
            r = replay_set(w, pairs, K, budgets, context=not args.no_context, candidate_vocab=args.candidate_vocab)
            results["sets"][name][str(K)] = r
            cells = " | ".join(f"{r[str(b)]['quota']:.2f} / **{r[str(b)]['ranked']:.2f}** / {r[str(b)]['known_k']:.2f}"
                               for b in budgets)
            print(f"| {name} | {K} | {r['rounds']} | {r['tau']} | {cells} | {r['top']:.2f} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
