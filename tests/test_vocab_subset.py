"""A draft restricted to part of the vocabulary: the kept rows' logits are the full head's, the rest are
-inf, and SD/SSD stay exact (greedy == AR; chi-square under sampling in test_sd_exact/test_ssd_exact)."""

import pytest
import torch
from tiny_models import GREEDY, PROMPTS, random_model

from ssd import LLM, SamplingParams
from ssd.kernels import cpu as qk
from ssd.workers.models.blockquant import W4A8Linear, W4G64A8Linear, W5A8Linear, W6A8Linear, W8A8Linear
from ssd.workers.models.quant import Int8Linear
from ssd.workers.models.vocab_subset import SubsetHead, draft_vocab_ids, head_rows, restrict_head

KEEP = torch.tensor([0, 1, 2, 5, 8, 13, 21, 34, 40, 47])


def _heads():
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    heads = {"nn.Linear": torch.nn.Linear(64, 48), "int8": Int8Linear.from_float(w, b)}
    with torch.no_grad():
        heads["nn.Linear"].weight.copy_(w)
        heads["nn.Linear"].bias.copy_(b)
    if qk.available():
        for cls in (W4A8Linear, W4G64A8Linear, W5A8Linear, W6A8Linear, W8A8Linear):
            heads[cls.__name__] = cls.from_float(w, b, torch.float32)
    return heads


@pytest.mark.parametrize("name", list(_heads()))
def test_kept_rows_give_the_full_heads_logits(name):
    head = _heads()[name]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    full = head(x)
    restricted = SubsetHead(head_rows(head, KEEP), KEEP, 48, head)
    sub = restricted(x)  # [5, 48]
    assert torch.equal(restricted.full(x), full)
    assert sub.shape == full.shape
    if name == "nn.Linear":  # F.linear's summation order may depend on the number of rows
        torch.testing.assert_close(sub[:, KEEP], full[:, KEEP])
    else:  # row-independent kernels: the same bits
        assert torch.equal(sub[:, KEEP], full[:, KEEP])
    dropped = torch.ones(48, dtype=torch.bool)
    dropped[KEEP] = False
    assert torch.isneginf(sub[:, dropped]).all()


def test_a_dense_heads_kept_rows_carry_no_autograd_history():
    """head_rows of a DenseLinear (its weight a Parameter) is a plain buffer: the restricted draft can be copied."""
    import copy

    from ssd.workers.models.dense import DenseLinear

    w = torch.nn.Parameter(torch.randn(48, 64))
    rows = head_rows(DenseLinear(w, None), KEEP)
    assert not any(t.requires_grad for t in rows.state_dict().values())
    copy.deepcopy(SubsetHead(rows, KEEP, 48, DenseLinear(w, None)))


def test_draft_vocab_ids_and_bad_input():
    assert draft_vocab_ids(100, 4, [99, 500]).tolist() == [0, 1, 2, 3, 99]  # eos kept, out-of-range dropped
    model = random_model(vocab=40, layers=1, seed=4)
    with pytest.raises(ValueError, match="sorted, unique"):
        restrict_head(model, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="sorted, unique"):
        restrict_head(model, torch.tensor([1, 40]))
    restrict_head(model, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="already restricted"):
        restrict_head(model, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="draft_vocab"):
        LLM(target=model, draft=model, draft_vocab=0)


@pytest.mark.parametrize("mode", ["sd", "ssd", "auto"])
def test_restricted_draft_greedy_equals_ar(models, ar_outputs, mode):
    """Half the vocabulary: drafts miss more often, the output is still AR's. The caller's draft module is
    left untouched (the worker restricts a copy)."""
    draft = models[1]
    head = draft.lm_head
    with LLM(target=models[0], draft=draft, mode=mode, k=3, fanout=8, draft_vocab=20, dtype="float32", max_batch=3,
             max_len=128) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        st = llm.stats()
    assert [o.token_ids for o in outs] == ar_outputs
    assert draft.lm_head is head
    if mode != "auto":
        assert st["drafted_tokens"] > 0


@pytest.mark.parametrize("candidate_vocab", ["full", "draft"])
def test_outcomes_outside_the_draft_vocab_are_still_predicted(models, candidate_vocab):
    """draft == target restricted to half the vocabulary, greedy, one candidate per k: the target rejects
    every draft token its argmax is not among the kept ids, and its correction is the draft's whole-vocabulary
    argmax. With candidate_vocab="full" SSD ranks the candidates over the whole vocabulary, so every outcome
    is a hit; with "draft" (the ids the draft proposes) it misses such corrections outside the context."""
    target = models[0]
    k = 3
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(target=target, mode="ar", dtype="float32", max_batch=1, max_len=128) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    with LLM(target=target, draft=target, mode="ssd", backup="neural", k=k, fanout=[1] * (k + 1),
             draft_vocab=20, candidate_vocab=candidate_vocab, dtype="float32", max_batch=1, max_len=128) as llm:
        outs = [llm.generate([p], sp)[0] for p in PROMPTS]
        st = llm.stats()
    assert [o.token_ids for o in outs] == want
    assert sum(t >= 20 for o in outs for t in o.token_ids) >= 5  # corrections outside the kept ids occur
    short = sum(n for kk, n in st["cache_hits_per_k"].items() if int(kk) < k)  # rounds that rejected a token
    misses = sum(st["cache_misses_per_k"].values())
    if candidate_vocab == "full":
        assert misses == 0 and short >= 5, st
    else:
        assert misses >= 5, st


def test_candidate_vocab_is_checked(models):
    with pytest.raises(ValueError, match="candidate_vocab"):
        LLM(target=models[0], draft=models[0], candidate_vocab="kept")


@pytest.mark.parametrize("name", list(_heads()))
def test_row_extras_give_each_row_its_own_context(name):
    """set_row_extras: row b also produces its own extra ids, with the full layer's logits there, and
    stays -inf at the other rows' extras; 3-d inputs broadcast over positions; clearing restores."""
    head = _heads()[name]
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))  # [B, n, D]
    restricted = SubsetHead(head_rows(head, KEEP), KEEP, 48, head)
    plain = restricted(x)
    full = head(x)
    restricted.set_row_extras([[30, 2, 44], [31]])  # 2 is kept already: ignored
    got = restricted(x)
    close = torch.equal if name != "nn.Linear" else (lambda a, b: torch.allclose(a, b, atol=1e-6))
    assert close(got[0, :, [30, 44]], full[0, :, [30, 44]]) and close(got[1, :, 31], full[1, :, 31])
    assert torch.isneginf(got[0, :, 31]).all() and torch.isneginf(got[1, :, [30, 44]]).all()
    others = torch.ones(48, dtype=torch.bool)
    others[[30, 31, 44]] = False
    assert torch.equal(got[:, :, others], plain[:, :, others])
    restricted.set_row_extras(None)
    assert torch.equal(restricted(x), plain)
    with pytest.raises(ValueError, match="extra token ids"):
        restricted.set_row_extras([[48]])
    restricted.set_row_extras([[30]])
    with pytest.raises(ValueError, match="extras for 1 rows"):
        restricted(x)


@pytest.mark.parametrize("name", list(_heads()))
def test_compact_logits_are_the_rows_on_their_columns(name):
    """compact(x) = forward(x) at columns() (the kept ids and the current extras, ascending), in fp32; every
    id off those columns is -inf in forward. Ascending columns: argmax on them is the whole row's argmax."""
    head = _heads()[name]
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3))  # [B, n, D]
    restricted = SubsetHead(head_rows(head, KEEP), KEEP, 48, head)
    for extras in (None, [[30, 2, 44], [31]], [[], [45, 3]]):
        restricted.set_row_extras(extras)
        cols, got, whole = restricted.columns(), restricted.compact(x), restricted(x).float()
        want_cols = sorted({*KEEP.tolist(), *(t for ids in extras or [] for t in ids)})
        assert cols.tolist() == want_cols
        assert got.dtype == torch.float32 and got.shape == (2, 3, len(want_cols))
        assert torch.equal(got, whole[..., cols])
        off = torch.ones(48, dtype=torch.bool)
        off[cols] = False
        assert torch.isneginf(whole[..., off]).all()
        assert torch.equal(cols[got.argmax(-1)], whole.argmax(-1))


@pytest.mark.parametrize("context", [True, False])
def test_a_restricted_draft_proposes_its_own_context(models, context):
    """draft == target, restricted to ids < 20: with its context it also proposes the ids >= 20 of its
    prompt and outputs, and its greedy tokens are the whole layer's argmax over kept ids + context."""
    from ssd.workers.draft_worker import DraftWorker
    from ssd.workers.messages import SamplingSpec

    target = models[0]
    prompt = [25, 3, 33, 7, 25, 3]  # ids above the kept 20 in the prompt
    w = DraftWorker(target, dtype="float32", max_slots=1, max_len=128, draft_vocab=20, context_vocab=context)
    ref = DraftWorker(target, dtype="float32", max_slots=1, max_len=128)
    w.add(0, prompt, SamplingSpec(temperature=0))
    ref.add(0, prompt, SamplingSpec(temperature=0))
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[:20] = True
    if context:
        allowed[[25, 33]] = True
    assert w.dseqs[0].context == ({25, 33} if context else set())
    for _ in range(6):
        x = w.propose([(0, 1)])[0][0].tokens[0]
        slot = ref.dseqs[0].slot
        logits = ref.runner.forward([slot], [ref._sync(ref.dseqs[0])], last_only=True)[0]  # [V]
        ref.dseqs[0].base = ref.runner.kv.lengths[slot]
        assert x == int(torch.where(allowed, logits, torch.tensor(float("-inf"))).argmax())
        nxt = int(logits.argmax())  # commit the target's token (AR), which may widen the context
        w.commit(0, [nxt])
        ref.commit(0, [nxt])
        if context and nxt >= 20:
            allowed[nxt] = True
    assert w.dseqs[0].context == ({int(t) for t in torch.nonzero(allowed[20:]).flatten() + 20} if context else set())
