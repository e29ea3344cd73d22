"""DraftWorker: owns the draft model. Proposes K tokens (plain SD) and, for SSD, prepares the next
speculation for each likely verification outcome while the target verifies (`speculate`), then
hands out the prepared one on a hit (`resolve`).

Per sequence the worker keeps the committed tokens it has not cached yet (`todo`) and the
speculative tokens it fed while drafting (`spec_fed`); the next call keeps the cached ones that
were committed, rolls back the rest and feeds what is missing, so a rejection never recomputes
the prefix.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ssd.cache.outcome_cache import CacheEntry, OutcomeCache
from ssd.kernels.sampling import argmax_last, filter_logits, saguaro_probs, sample_from_probs
from ssd.workers.base import ModelWorker
from ssd.workers.messages import Draft, SamplingSpec
from ssd.workers.models.decoder import DecoderModel
from ssd.workers.models.vocab_subset import SubsetHead, draft_vocab_ids, restrict_head
from ssd.workers.ngram import NgramIndex
from ssd.workers.ranking import RANK_TOP, AcceptanceByConfidence, Top, confidences, ranked_outcomes
from ssd.workers.seq_state import make_generator, uniforms
from ssd.workers.subset_q import QDraft, QRow, stack_q

CANDIDATE_VOCABS = ("draft", "full")
FEED_AHEAD_LAG = 2  # committed tokens a feed-ahead commit may leave uncached
LOOKAHEAD_BRANCHES = 2  # speculate's branches per sequence that feed lookahead guesses (rows cost time there)
LOOKAHEAD_TREE_MIN_N = 2  # ... and only after a suffix match this long (1-token matches: ~19 % right, 2: ~53 %)
LOOKAHEAD_EXTEND = 2  # a branch may end up to this many times `lookahead` tokens past k_next


@dataclass
class DraftSeq:
    seq_id: int
    slot: int
    spec: SamplingSpec
    gen: torch.Generator
    last: int  # last committed token
    base: int = 0  # committed tokens in the KV cache
    todo: list[int] = field(default_factory=list)  # committed, not cached
    spec_fed: list[int] = field(default_factory=list)  # speculative tokens cached after `base`
    region_start: int = -1  # SSD: cache position of x_1 in the open tree region
    round_id: int = -1
    # Ranked candidates (greedy rows): the tokens last drafted here after the committed ones and the top of
    # the distribution each was drafted from (tops[j]: after x_0..x_j, over the ids the draft can propose),
    # so speculate needs no glue rows to rank outcomes before x_K; and the confidences c_k = q_k(x_{k+1})
    # of the speculation awaiting resolve, which calibrate g (workers/ranking.py).
    drafted: list[int] = field(default_factory=list)
    tops: list[Top] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    # A gated plain draft (propose with stop_below) awaiting its verification: its tokens and confidences,
    # which calibrate g too once commit() learns how many were accepted
    proposed: list[int] = field(default_factory=list)
    proposed_conf: list[float] = field(default_factory=list)
    context: set[int] = field(default_factory=set)  # prompt and committed tokens (a restricted draft adds them)
    history: list[int] = field(default_factory=list)  # prompt and committed tokens, for lookahead guesses
    ngrams: NgramIndex = field(default_factory=NgramIndex)


@dataclass
class SpecRequest:
    """Prepare round T+1 for one sequence while the target verifies `tokens` (round T)."""

    seq_id: int
    round_id: int
    tokens: list[int]  # x_1..x_K being verified
    fanout: list[int]  # F_0..F_K: candidate t* per accepted length k
    next_fanout: list[int]  # F'_0..F'_K of round T+1, for Saguaro sampling of the branches
    k_next: int  # draft length of round T+1


@dataclass
class Resolution:
    seq_id: int
    hit: bool
    draft: Draft | None  # the next speculation (None: miss without a neural backup)
    q: QDraft | None


class DraftWorker(ModelWorker):
    salt = 2

    def __init__(
        self, *args, saguaro_c: float = 1.0, draft_vocab: int | None = None, ranked: bool = False,
        context_vocab: bool = True, candidate_vocab: str = "draft", lookahead: int = 3, **kwargs,
    ) -> None:
        if candidate_vocab not in CANDIDATE_VOCABS:
            raise ValueError(f"candidate_vocab must be one of {', '.join(CANDIDATE_VOCABS)}, got {candidate_vocab!r}")
        self.draft_vocab = draft_vocab  # read by load_model, which the base class calls
        super().__init__(*args, **kwargs)
        self.dseqs: dict[int, DraftSeq] = {}
        self.cache = OutcomeCache()
        self.saguaro_c = saguaro_c
        # ranked: greedy rows spend speculate's budget on the outcomes the draft finds likeliest
        # (workers/ranking.py) instead of F_k per accepted length k
        self.ranked = ranked
        self.acceptance = AcceptanceByConfidence()
        # context_vocab: a restricted output layer also produces each sequence's own prompt and output
        # tokens (SubsetHead.set_row_extras), except under CUDA graphs, whose captured head is fixed.
        head = getattr(self.model, "lm_head", None)
        self._subset = head if isinstance(head, SubsetHead) else None
        self._context = context_vocab and self._subset is not None and self.runner.graphs is None
        # candidate_vocab: the ids speculate's glue rows rank the candidates t* over, for a restricted
        # layer: "draft", the ids the draft proposes (kept + context); "full", the whole vocabulary, which
        # also predicts target tokens outside them for one full output-layer row per round (the 0.5B on
        # one core: a one-token glue forward of 17.4 ms instead of 11.4, benchmarks/breakdown.py).
        self._full_candidates = candidate_vocab == "full"
        # lookahead: greedy drafts also feed up to this many tokens guessed by prompt lookup (NgramIndex) after
        # the token they feed; each guess equal to the draft's own argmax is a token drafted without a forward
        # of its own (the same tokens and bits as drafting one by one: the CPU layers are batch invariant)
        if not (isinstance(lookahead, int) and lookahead >= 0):
            raise ValueError(f"lookahead must be an integer >= 0, got {lookahead!r}")
        self.lookahead = lookahead
        self.lookahead_stats = {"forwards": 0, "guessed": 0, "accepted": 0}
        self._guess_runs = [0.0, 0.0]  # lookahead guesses agreed with, and runs of guesses cut short (decayed)
        self.gate_stats = {"drafts": 0, "stopped": 0}  # gated drafts, and those stopped short of their k
        self.last_propose_s = 0.0
        self.last_speculate_s = 0.0

    def load_model(
        self, model: str | DecoderModel, dtype: torch.dtype, device: str, quantization: str | None
    ) -> tuple[DecoderModel, object | None]:
        """The draft model; with `draft_vocab`, its output layer keeps only the first `draft_vocab` token
        ids and the end-of-sequence ids (q = 0 for the rest: still lossless, see vocab_subset.py)."""
        built, tokenizer = super().load_model(model, dtype, device, quantization)
        if self.draft_vocab is not None and self.draft_vocab < built.config.vocab_size:
            if built is model:  # a caller's module: restrict a copy
                built = copy.deepcopy(built)
            keep = draft_vocab_ids(built.config.vocab_size, self.draft_vocab, list(built.config.eos_token_ids))
            restrict_head(built, keep)
        return built, tokenizer

    # -- sequences ---------------------------------------------------------------------------
    def add(self, seq_id: int, prompt_ids: list[int], spec: SamplingSpec) -> None:
        """Prefill all but the last prompt token now: fed lazily, the prompt would land in the first
        round, on the critical path; the engine runs this beside the target's own prefill."""
        if seq_id in self.dseqs:
            raise ValueError(f"sequence {seq_id} already added")
        slot = self.prefilled_slot(prompt_ids)
        self.dseqs[seq_id] = DraftSeq(
            seq_id=seq_id, slot=slot, spec=spec, gen=make_generator(spec.seed, self.salt),
            last=prompt_ids[-1], base=len(prompt_ids) - 1, todo=[prompt_ids[-1]],
        )
        self._see(self.dseqs[seq_id], prompt_ids)

    def remove(self, seq_id: int) -> None:
        st = self.dseqs.pop(seq_id, None)
        self.cache.drop(seq_id)
        if st is not None:
            self.runner.free(st.slot)

    def commit(self, seq_id: int, tokens: list[int], feed_ahead: bool = False) -> None:
        """Tokens the target emitted for this sequence (accepted drafts + correction/bonus).

        feed_ahead: for rounds that leave the draft's device idle (SSD's AR and n-gram rounds): once more
        than FEED_AHEAD_LAG tokens wait, cache all but the last (whose distribution the next draft call
        needs). Fed lazily, a run of such rounds lands as one long catch-up in the next speculation; the lag
        lets a switch back feed its few tokens in the forward it runs anyway. Not for plain SD, whose next
        call drafts at once.
        """
        st = self.dseqs[seq_id]
        self._close_region(st)
        st.drafted, st.tops = [], []
        if st.proposed_conf:
            accepted = 0
            while accepted < min(len(st.proposed), len(tokens)) and st.proposed[accepted] == tokens[accepted]:
                accepted += 1
            self.acceptance.observe(st.proposed_conf, accepted)
        st.proposed, st.proposed_conf = [], []
        self._see(st, tokens)
        st.todo.extend(tokens)
        st.last = tokens[-1]
        if feed_ahead:
            todo = self._sync(st)
            if len(todo) > FEED_AHEAD_LAG:
                self.runner.forward([st.slot], [todo[:-1]], last_only=True)
                st.base += len(todo) - 1
                todo = todo[-1:]
            st.todo = todo  # what is not cached yet: the next call feeds it

    def _see(self, st: DraftSeq, tokens: list[int]) -> None:
        st.history.extend(tokens)
        if self._context:
            st.context.update(t for t in tokens if t not in self._subset.kept_ids)

    def _forward(
        self, states: list[DraftSeq], tokens: list[list[int]], **kw
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """runner.forward for these sequences' drafting rows: (logits, cols). A restricted layer (with their
        context as extra ids) gives its logits on its own columns only, [..., C], cols [C] their token ids
        (ascending); a whole layer [..., V] and None."""
        slots = [st.slot for st in states]
        if self._subset is None:
            return self.runner.forward(slots, tokens, **kw), None
        if self.runner.graphs is not None:  # the captured head gives whole rows: -inf off the kept ids
            return self.runner.forward(slots, tokens, **kw).index_select(-1, self._subset.keep), self._subset.keep
        if self._context:
            extras = [sorted(st.context) for st in states]
            at = kw.get("logits_at")
            if at is not None:  # one logits row per index
                extras = [e for e, a in zip(extras, at) for _ in a]
            self._subset.set_row_extras(extras)
        try:
            return self.runner.forward(slots, tokens, compact=True, **kw), self._subset.columns()
        finally:
            self._subset.set_row_extras(None)

    def _close_region(self, st: DraftSeq) -> None:
        """Drop an SSD tree region that no resolve() consumed (the policy switched modes)."""
        if st.region_start >= 0:
            self.runner.truncate(st.slot, st.base)
            st.spec_fed = []
            st.region_start = -1
            st.confidence = []
            self.cache.drop(st.seq_id)

    def _sync(self, st: DraftSeq) -> list[int]:
        """Keep cached speculative tokens that got committed; return the committed tokens to feed.

        Never returns an empty list: the last committed token is rolled back and re-fed if needed,
        because the caller needs the distribution that follows it.
        """
        m = 0
        while m < min(len(st.spec_fed), len(st.todo)) and st.spec_fed[m] == st.todo[m]:
            m += 1
        st.base += m
        todo, st.todo, st.spec_fed = st.todo[m:], [], []
        if not todo:
            st.base -= 1
            todo = [st.last]
        self.runner.truncate(st.slot, st.base)
        return todo

    # -- sampling ----------------------------------------------------------------------------
    def _sample(
        self, logits: torch.Tensor, states: list[DraftSeq], fanout: list[int] | None, cols: torch.Tensor | None = None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Sample one token per row of logits [B, V] (or [B, C] at token ids `cols`); returns (tokens, q [B, V]
        (or [B, C] at `cols`: zero at every other id) the exact sampling distribution).

        With Saguaro (C < 1) and a fan-out, rows sample from sigma_{F,C}; verification uses this q.
        An all-greedy batch takes the argmax (what sampling the greedy one-hot gives) and no q.
        """
        specs = [s.spec for s in states]
        if all(s.greedy for s in specs):
            best = argmax_last(logits.float())  # [B]; ascending cols keep ties on the lowest id
            return (best if cols is None else cols[best]).tolist(), None
        dev = logits.device
        # On columns `cols` the filters and Saguaro's top-F see what they would on the whole row, whose other
        # logits are -inf (ascending ids keep ties on the lowest id), and the cumulative sum is the same.
        temp = torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=dev)
        top_k = torch.tensor([s.top_k for s in specs], dtype=torch.long, device=dev)
        top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=dev)
        probs = filter_logits(logits, temp, top_k, top_p)  # [B, V]
        if fanout is not None and self.saguaro_c < 1.0 and any(not s.greedy for s in specs):
            sampled = temp > 0  # greedy rows keep their argmax one-hot
            fo = torch.tensor(fanout, dtype=torch.long, device=dev)
            sag = saguaro_probs(logits, temp, top_k, top_p, fo, self.saguaro_c)
            probs = torch.where(sampled[:, None], sag, probs)
        u = torch.cat([uniforms(s.gen, 1) for s in states])  # [B] host generators, per request
        picked = sample_from_probs(probs, u)  # [B] column indices
        return (picked if cols is None else cols[picked]).tolist(), probs

    # -- plain SD ----------------------------------------------------------------------------
    def propose(
        self, requests: list[tuple[int, int]], fanout: list[list[int]] | None = None, borrow: bool = False,
        stop_below: float = 0.0,
    ) -> tuple[list[Draft], list[QDraft | None]]:
        """Draft k tokens for each (seq_id, k). Returns drafts and, for sampled rows, q [k, V] (a restricted
        draft's as a SubsetQ of its columns).

        fanout[b] (optional, SSD) is the next round's F_0..F_K, used for Saguaro sampling. `borrow`: also
        compute on the target's cores (`spare_cores`), which the coordinator asks for only while the
        target waits for this draft. `stop_below` > 0: greedy rows draft at most k tokens and stop early
        once another forward is worth less than that many expected accepted tokens (`_worth`).
        """
        with self._cores(borrow):
            return self._propose(requests, fanout, stop_below)

    def _worth(self, reach: float, c_last: float, guesses: int) -> float:
        """Expected tokens that a gated greedy row's next forward adds to what the target accepts: they
        count only if every token drafted before them is accepted (`reach`), and the draft's confidence in
        its last token predicts the next ones' (runs of sure tokens: code, copied text). The forward drafts
        one token plus those of its `guesses` lookahead guesses the draft agrees with (each with the
        conditional rate seen so far); the caller prices a forward in such tokens (`stop_below`)."""
        g = self.acceptance.rate(c_last)
        h = (self._guess_runs[0] + 1.0) / (self._guess_runs[0] + self._guess_runs[1] + 2.0)
        return reach * sum(g ** (i + 1) * h ** i for i in range(guesses + 1))

    @staticmethod
    def _confidences(logits: torch.Tensor) -> list[float]:
        """Each row's largest probability: a greedy draft's confidence in the token it drafts. [R, V or C]"""
        lg = logits.float()
        return (lg.amax(-1) - torch.logsumexp(lg, -1)).exp().tolist()

    def _propose(
        self, requests: list[tuple[int, int]], fanout: list[list[int]] | None, stop_below: float = 0.0
    ) -> tuple[list[Draft], list[QDraft | None]]:
        t0 = time.perf_counter()
        states = [self.dseqs[sid] for sid, _ in requests]
        for st in states:
            self._close_region(st)
        ks = [k for _, k in requests]
        feeds = [self._sync(st) for st in states]
        for st in states:
            st.drafted, st.tops, st.proposed, st.proposed_conf = [], [], [], []
        gated = [stop_below > 0 and st.spec.greedy for st in states]
        reach = [1.0] * len(requests)  # P(every token drafted so far is accepted), per gated row
        c_last = [1.0] * len(requests)  # the draft's confidence in its last token
        stop = [False] * len(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        qs: list[list[QRow]] = [[] for _ in requests]
        active = [b for b in range(len(requests)) if ks[b] > 0]
        for b in range(len(requests)):
            if ks[b] == 0:  # nothing drafted: feed lazily next time
                states[b].todo = feeds[b]
        step = 0
        while active:
            blocks, guesses = [], []
            for b in list(active):
                blk = feeds[b] if step == 0 else [tokens[b][-1]]
                g = self._guesses(states[b], tokens[b], ks[b] - len(tokens[b]) - 1)
                if step > 0 and gated[b] and self._worth(reach[b], c_last[b], len(g)) < stop_below:
                    stop[b] = True
                    active.remove(b)
                    continue
                blocks.append(blk + g)
                guesses.append(g)
            if not active:
                break
            # Logits after the fed token and after each guess: rows first[i] .. first[i] + len(guesses[i])
            at = [list(range(len(blk) - len(g) - 1, len(blk))) for blk, g in zip(blocks, guesses)]
            first = [sum(len(a) for a in at[:i]) for i in range(len(at))]
            logits, cols = self._forward([states[b] for b in active], blocks, logits_at=at)  # [R, V or C]
            self.lookahead_stats["forwards"] += 1
            for b, blk, g in zip(active, blocks, guesses):
                if step == 0:
                    states[b].base += len(blk) - len(g)
                else:
                    states[b].spec_fed.append(blk[0])
            fo = None if fanout is None else [fanout[b][min(step, len(fanout[b]) - 1)] for b in active]
            new, probs = self._sample(logits[first], [states[b] for b in active], fo, cols)
            best = self._argmaxes(logits, cols) if any(guesses) else []
            conf = self._confidences(logits) if any(gated[b] for b in active) else []
            for row, b in enumerate(active):
                st, g, r0 = states[b], guesses[row], first[row]
                took = 0  # guesses equal to the draft's own next token: drafted and already cached
                while took < len(g) and best[r0 + took] == g[took]:
                    took += 1
                drafted = [new[row], *best[r0 + 1 : r0 + 1 + took]]
                if self.ranked and st.spec.greedy:
                    st.tops.extend(self._tops(logits[r0 : r0 + took + 1], cols))
                tokens[b].extend(drafted)
                if not st.spec.greedy:
                    qs[b].append((probs[row], cols))
                if g:
                    st.spec_fed.extend(g[:took])
                    if took < len(g):  # the rejected guesses' keys go
                        self.runner.truncate(st.slot, st.base + len(st.spec_fed))
                    self.lookahead_stats["guessed"] += len(g)
                    self.lookahead_stats["accepted"] += took
                if g:
                    runs = self._guess_runs
                    runs[0], runs[1] = 0.99 * runs[0] + took, 0.99 * runs[1] + (took < len(g))
                if gated[b]:
                    cs = conf[r0 : r0 + took + 1]
                    st.proposed_conf.extend(cs)
                    for c in cs:
                        reach[b] *= self.acceptance.rate(c)
                    c_last[b] = cs[-1]
            step += 1
            active = [b for b in active if len(tokens[b]) < ks[b]]
        drafts, q_out = [], []
        for b, (sid, _) in enumerate(requests):
            greedy = states[b].spec.greedy
            if states[b].tops:
                states[b].drafted = list(tokens[b])
            if gated[b]:
                states[b].proposed = list(tokens[b])
            drafts.append(Draft(seq_id=sid, tokens=tokens[b], q_kind="none" if greedy else "dist"))
            q_out.append(stack_q(qs[b], self.config.vocab_size))
        self.last_propose_s = time.perf_counter() - t0
        self.gate_stats["drafts"] += sum(gated)
        self.gate_stats["stopped"] += sum(stop)
        return drafts, q_out

    def _guesses(self, st: DraftSeq, drafted: list[int], room: int) -> list[int]:
        """Lookahead guesses for a greedy row that may draft `room` more tokens after the next one."""
        if self.lookahead <= 0 or room <= 0 or not st.spec.greedy:
            return []
        return st.ngrams.match(st.history, drafted, min(room, self.lookahead))[0]

    def _branch_guesses(self, st: DraftSeq, r: SpecRequest, branches: list[tuple[int, int]], ys: list[list[int]],
                        live: list[int], next_node: int) -> dict[int, list[int]]:
        """Lookahead guesses for a greedy row's live branches: up to LOOKAHEAD_BRANCHES of them, the most
        accepted tokens (largest k) first, the branch ending at most LOOKAHEAD_EXTEND x `lookahead` past k_next,
        and within the cache."""
        if self.lookahead <= 0 or not st.spec.greedy:
            return {}
        # Cache positions left once every live branch's remaining regular nodes (one per step) have theirs
        room_left = self.runner.max_len - 1 - (st.region_start + next_node + sum(r.k_next - len(ys[j]) for j in live))
        out: dict[int, list[int]] = {}
        for j in sorted(live, key=lambda j: -branches[j][0])[:LOOKAHEAD_BRANCHES]:
            k, t = branches[j]
            room = min(self.lookahead, r.k_next + LOOKAHEAD_EXTEND * self.lookahead - len(ys[j]) - 1, room_left)
            if room <= 0:
                continue
            g, n = st.ngrams.match(st.history, [*r.tokens[:k], t, *ys[j]], room)  # after the branch's pending token
            if n >= LOOKAHEAD_TREE_MIN_N:
                out[j] = g
                room_left -= len(g)
        return out

    @staticmethod
    def _argmaxes(logits: torch.Tensor, cols: torch.Tensor | None) -> list[int]:
        """Each row's greedy token: logits [R, V] (or [R, C] at token ids cols)."""
        best = argmax_last(logits.float())  # [R]; ascending cols keep ties on the lowest id
        return (best if cols is None else cols[best]).tolist()

    # -- SSD ---------------------------------------------------------------------------------
    def speculate(self, requests: list[SpecRequest]) -> dict:
        """While the target verifies x_1..x_K: fill the outcome cache for every likely (k, t*).

        Returns {"seconds", "branches", "drafts", "fanout"}: "drafts" lists [seq_id, k, t*, y] for the greedy
        rows, so the coordinator can find a hit's next draft itself (sampled rows' q stays here, for resolve);
        "fanout" lists [seq_id, candidates per k] for the rows that ranked their candidates.

        1. glue: one forward over [committed tail, x_1..x_K] gives the draft's distribution after
           each accepted prefix x_1..x_k (k = 0..K); only from the first k with F_k > 0 when x_1..x_K
           were drafted here and are still cached (see `_glue`);
        2. candidates t* for each k: the top-F_k tokens of it, excluding x_{k+1} (a rejected token
           can never be the correction); greedy rows of a `ranked` worker instead take the sum(F_k)
           likeliest outcomes (k, t*) overall (`ranked_outcomes`), ranking those before x_K from the
           distributions they were drafted from, so the glue feeds x_K alone;
        3. all branches x_1..x_k, t* are decoded K steps together, one batched tree-masked forward
           per step, sharing the prefix KV.
        """
        t0 = time.perf_counter()
        states = [self.dseqs[r.seq_id] for r in requests]
        for st in states:
            self._close_region(st)
            st.proposed, st.proposed_conf = [], []  # resolve observes this speculation's confidences instead
        ranked = [self.ranked and st.spec.greedy for st in states]
        # Ranked rows rank outcomes before x_K from the tops kept when x_1..x_K were drafted here.
        from_tops = [rk and self._has_tops(st, r) for rk, st, r in zip(ranked, states, requests)]
        glues = [self._glue(st, r, self._first_needed(r, rk, ft))
                 for st, r, rk, ft in zip(states, requests, ranked, from_tops)]
        # The candidates are predictions, not drafts: whichever ids they are ranked over, no q changes.
        glue_tokens = [g for g, _, _ in glues]
        cols: torch.Tensor | None = None  # the token id of each logits column (None: every id)
        if self._full_candidates:
            logits = self.runner.forward([st.slot for st in states], glue_tokens, full_vocab=True)  # [B, n, V]
        else:
            logits, cols = self._forward(states, glue_tokens)  # [B, n, V or C]
        branches: list[list[tuple[int, int]]] = []  # per row: (k, t*)
        for b, (st, r) in enumerate(zip(states, requests)):
            _, committed, first = glues[b]
            st.base += committed
            st.region_start = st.base
            st.round_id = r.round_id
            self.runner.open_tree(st.slot, st.base)  # x_1..x_K become region nodes 0..K-1
            K = len(r.tokens)
            if ranked[b]:
                # [V] rows: the draft's distribution after x_1..x_k is logits[b, first + k]
                tops = st.tops[:K] if from_tops[b] else self._tops(logits[b, first: first + K], cols)
                tops.extend(self._tops(logits[b, first + K: first + K + 1], cols))
                branches.append(ranked_outcomes(r.tokens, tops, sum(r.fanout), self.acceptance.rate))
                st.drafted, st.tops, st.confidence = [], [], confidences(r.tokens, tops)
                continue
            cands = []
            for k in range(K + 1):
                f = r.fanout[k] if k < len(r.fanout) else 0
                if f <= 0:
                    continue
                dist = logits[b, first + k]  # [V or C]: the draft's distribution after x_1..x_k
                top = torch.topk(dist, min(f + 1, dist.shape[-1])).indices
                top = (top if cols is None else cols[top]).tolist()
                if k < K:
                    top = [t for t in top if t != r.tokens[k]]
                cands.extend((k, t) for t in top[:f])
            branches.append(cands)

        # Branch decoding: node ids in each row's tree region; chain x_1..x_K are nodes 0..K-1. Each step feeds
        # every branch still short of k_next tokens its pending token (t*, then its last drafted one), greedy
        # rows' likeliest branches also lookahead guesses after it (each one the draft agrees with is a token
        # more, so such a branch may end up to `lookahead` tokens beyond k_next: a longer next draft).
        rows = [b for b in range(len(requests)) if branches[b] and requests[b].k_next > 0]
        next_node = {b: len(requests[b].tokens) for b in rows}
        paths = {b: [[*range(k)] for k, _ in branches[b]] for b in rows}  # each branch's fed nodes
        ys: dict[int, list[list[int]]] = {b: [[] for _ in branches[b]] for b in rows}
        qs: dict[int, list[list[QRow]]] = {b: [[] for _ in branches[b]] for b in rows}
        tops_y: dict[int, list[list[Top]]] = {b: [[] for _ in branches[b]] for b in rows if ranked[b]}
        step = 0
        while True:
            active = [b for b in rows if any(len(y) < requests[b].k_next for y in ys[b])]
            if not active:
                break
            toks, pars, fed = [], [], []  # fed[row]: (branch, its first index in the row, its guesses)
            for b in active:
                r, st = requests[b], states[b]
                live = [j for j, y in enumerate(ys[b]) if len(y) < r.k_next]
                guesses = self._branch_guesses(st, r, branches[b], ys[b], live, next_node[b])
                tb, pb, fb = [], [], []
                for j in live:
                    g = guesses.get(j, [])
                    fb.append((j, len(tb), g))
                    pb.append(paths[b][j][-1] if paths[b][j] else -1)
                    pb.extend(next_node[b] + len(tb) + i for i in range(len(g)))  # a chain after the token
                    tb.extend([ys[b][j][-1] if ys[b][j] else branches[b][j][1], *g])  # pending: last drafted, or t*
                toks.append(tb)
                pars.append(pb)
                fed.append(fb)
            out, cols = self._forward([states[b] for b in active], toks, parents=pars)  # [B, n, V or C]
            # One batched sampling call over every branch's pending token of every row.
            firsts = [out[row, i] for row, fb in enumerate(fed) for _, i, _ in fb]
            flat_states = [states[b] for b, fb in zip(active, fed) for _ in fb]
            flat_fo = []
            for b, fb in zip(active, fed):
                fo = requests[b].next_fanout
                flat_fo.extend([fo[min(step, len(fo) - 1)] if fo else 0] * len(fb))
            new, probs = self._sample(torch.stack(firsts), flat_states, flat_fo if any(flat_fo) else None, cols)
            i = 0
            for row, (b, fb) in enumerate(zip(active, fed)):
                for j, r0, g in fb:
                    took = 0
                    if g:  # greedy: the guesses the draft's own argmax agrees with, in order
                        best = self._argmaxes(out[row, r0 : r0 + len(g) + 1], cols)  # best[0] is new[i]
                        while took < len(g) and best[took] == g[took]:
                            took += 1
                        self.lookahead_stats["guessed"] += len(g)
                        self.lookahead_stats["accepted"] += took
                        drafted = best[: took + 1]
                    else:
                        drafted = [new[i]]
                    paths[b][j].extend(next_node[b] + r0 + d for d in range(took + 1))
                    ys[b][j].extend(drafted)
                    if b in tops_y:  # the next round's tops, should this branch be the outcome
                        tops_y[b][j].extend(self._tops(out[row, r0 : r0 + took + 1], cols))
                    if not states[b].spec.greedy:
                        qs[b][j].append((probs[i], cols))
                    i += 1
                next_node[b] += len(toks[row])
            self.lookahead_stats["forwards"] += 1
            step += 1
        shipped: list[list] = []  # greedy rows' next drafts: [seq_id, k, t*, y], for the coordinator to look up
        for b, r in enumerate(requests):
            entries: dict[tuple[int, int], CacheEntry] = {}
            for j, (k, t) in enumerate(branches[b]):
                if b in ys:
                    y = ys[b][j]
                    q = stack_q(qs[b][j], self.config.vocab_size)
                    path = paths[b][j]  # x_1..x_k, t*, y_1..y_{m-1} (the last drafted token y_m not fed)
                else:  # k_next == 0: nothing to draft next round, the hit only saves the sync
                    y, q, path = [], None, [*range(k)]
                tops = tops_y[b][j] if b in tops_y else None
                entries[(k, t)] = CacheEntry(tokens=y, q=q, path=path, tops=tops)
                if states[b].spec.greedy:
                    shipped.append([r.seq_id, k, t, list(y)])
            self.cache.fill(r.seq_id, r.round_id, entries)
        self.last_speculate_s = time.perf_counter() - t0
        # Ranked rows: [seq_id, candidates per k] (the coordinator's statistics)
        fanout = [[r.seq_id, [sum(k == j for k, _ in branches[b]) for j in range(len(r.tokens) + 1)]]
                  for b, r in enumerate(requests) if ranked[b]]
        return {"seconds": self.last_speculate_s, "branches": sum(len(c) for c in branches), "drafts": shipped,
                "fanout": fanout}

    @staticmethod
    def _tops(logits: torch.Tensor, cols: torch.Tensor | None = None) -> list[Top]:
        """The RANK_TOP likeliest tokens of each row of logits [n, V] (or [n, C] at token ids `cols`, a
        restricted layer's columns) and their probabilities."""
        lg = logits.float()
        top_l, top_i = lg.topk(min(RANK_TOP, lg.shape[-1]), -1)  # [n, RANK_TOP]
        probs = (top_l - torch.logsumexp(lg, -1, keepdim=True)).exp()
        if cols is not None:
            top_i = cols[top_i]
        return list(zip(top_i.tolist(), probs.tolist()))

    @staticmethod
    def _has_tops(st: DraftSeq, r: SpecRequest) -> bool:
        K = len(r.tokens)
        return K > 0 and len(st.tops) >= K and st.drafted[:K] == r.tokens

    @staticmethod
    def _first_needed(r: SpecRequest, ranked: bool, from_tops: bool) -> int:
        """The first k whose distribution speculate needs from the glue: ranked rows need every k
        (only k = K when the tops of x_1..x_K are kept), the others the first k with F_k > 0."""
        K = len(r.tokens)
        if ranked:
            return K if from_tops else 0
        return min((k for k in range(K + 1) if k < len(r.fanout) and r.fanout[k] > 0), default=K)

    def _glue(self, st: DraftSeq, r: SpecRequest, first_needed: int) -> tuple[list[int], int, int]:
        """What speculate feeds for one sequence: (tokens, how many of them are committed, index of
        the distribution after x_0 = the last committed token; after x_k it is that index + k).

        Distributions are needed only from k = first_needed on. After drafting x_1..x_K here
        (propose, or a hit), x_1..x_{K-1} are still cached: feeding x_k..x_K from that k on costs
        one row instead of K + 1 when only k = K is needed, as on a cache hit at a high acceptance rate.
        """
        j = first_needed - 1
        if j >= 0 and not st.todo and st.spec_fed[:j] == r.tokens[:j]:  # x_1..x_j still cached
            self.runner.truncate(st.slot, st.base + j)  # keep x_1..x_j, re-feed from x_{j+1}
            st.spec_fed = []
            return r.tokens[j:], 0, -1 - j
        feeds = self._sync(st)
        return feeds + r.tokens, len(feeds), len(feeds) - 1

    def resolve(
        self,
        outcomes: list[tuple],
        neural_backup: bool,
        fanout: list[list[int]] | None = None,
        borrow: bool = False,
    ) -> list[Resolution]:
        """For each (seq_id, k accepted, emitted tokens, k_next[, k_max]): take the prepared speculation on a
        hit (at least k_next tokens; up to k_max, default k_next, where lookahead drafted more); on a miss,
        draft just-in-time if neural_backup (on the target's cores too if `borrow`: the target has verified
        and waits), else leave it to a fast backup."""
        res: list[Resolution] = []
        misses: list[tuple[int, int]] = []
        for seq_id, k, emitted, k_next, *more in outcomes:
            k_max = more[0] if more else k_next
            st = self.dseqs[seq_id]
            if st.region_start >= 0:  # else commit() below sees the tokens
                self._see(st, emitted)
            if st.confidence:
                self.acceptance.observe(st.confidence, k)
            st.drafted, st.tops, st.confidence = [], [], []
            start = st.region_start
            if start < 0:  # no speculation was prepared (first round, or after a plain SD round)
                self.commit(seq_id, emitted)
                res.append(Resolution(seq_id, False, None, None))
                misses.append((seq_id, k_next))
                continue
            entry = self.cache.lookup(seq_id, st.round_id, k, emitted[-1], min_len=k_next)
            st.region_start = -1
            st.last = emitted[-1]
            if entry is not None:
                # Keep x_1..x_k, t*, y_1..y_{K-1}: exactly the state after drafting y normally.
                self.runner.keep(st.slot, start, entry.path)
                if len(entry.path) > k:
                    st.base = start + k + 1
                    st.spec_fed = entry.tokens[: len(entry.path) - k - 1]
                    st.todo = []
                else:  # an entry drafted nothing (k_next 0): t* was never fed
                    st.base, st.spec_fed, st.todo = start + k, [], [emitted[-1]]
                y = entry.tokens[:k_max]
                if entry.tops:
                    st.drafted, st.tops = list(y), entry.tops[: len(y)]
                q = entry.q[: len(y)] if entry.q is not None and y else None
                kind = "none" if st.spec.greedy else "dist"
                res.append(Resolution(seq_id, True, Draft(seq_id=seq_id, tokens=y, q_kind=kind), q))
                continue
            self.runner.truncate(st.slot, start + k)  # x_1..x_k were accepted: keep their KV
            st.base = start + k
            st.spec_fed = []
            st.todo = [emitted[-1]]
            res.append(Resolution(seq_id, False, None, None))
            misses.append((seq_id, k_next))
        if neural_backup and misses:
            idx = {sid: i for i, (sid, _) in enumerate(misses)}
            fo = None if fanout is None else [fanout[i] for i, r in enumerate(res) if not r.hit]
            drafts, qs = self.propose(misses, fo, borrow)
            for r in res:
                if not r.hit:
                    i = idx[r.seq_id]
                    r.draft, r.q = drafts[i], qs[i]
        return res

    def cache_stats(self) -> dict:
        return {"hits": dict(self.cache.hits), "misses": dict(self.cache.misses)}
