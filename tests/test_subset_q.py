"""A restricted draft's q on its own columns (workers/subset_q.py): the same distribution as the whole row."""

import pytest
import torch
from tiny_models import random_model

from ssd.kernels.sampling import filter_logits, saguaro_probs
from ssd.workers.draft_worker import DraftWorker
from ssd.workers.messages import SamplingSpec
from ssd.workers.subset_q import SubsetQ, dense_q, stack_q, write_q

V = 50


def test_stack_slice_and_write():
    cols = torch.tensor([1, 4, 7])
    rows = [(torch.tensor([0.5, 0.25, 0.25]), cols), (torch.tensor([0.0, 1.0, 0.0]), cols)]
    q = stack_q(rows, V)
    assert isinstance(q, SubsetQ) and q.shape == (2, V)
    dense = q.dense()  # [2, V]
    assert dense[0, 1] == 0.5 and dense[0, 4] == 0.25 and dense[1, 4] == 1.0 and dense.sum() == 2.0
    assert torch.equal(q[1:].dense(), dense[1:])
    out = torch.zeros(3, V)
    write_q(out[:2], q)
    assert torch.equal(out[:2], dense) and not out[2].any()
    write_q(out[:2], dense * 2)  # a whole [K, V] q is copied as is
    assert torch.equal(out[:2], dense * 2)
    assert torch.equal(dense_q(dense), dense)
    with pytest.raises(TypeError, match="row slices"):
        q[0]
    full = [(torch.rand(V), None) for _ in range(3)]
    assert torch.equal(stack_q(full, V), torch.stack([r for r, _ in full]))
    assert stack_q([], V) is None


def test_rows_on_different_columns_go_onto_their_union():
    """A batch's columns hold every row's context ids: one row's may change as other rows finish drafting."""
    a, b = torch.tensor([2, 5, 9]), torch.tensor([2, 5, 30, 41])
    qa, qb = torch.tensor([0.2, 0.3, 0.5]), torch.tensor([0.1, 0.1, 0.4, 0.4])
    q = stack_q([(qa, a), (qb, b)], V)
    assert q.cols.tolist() == [2, 5, 9, 30, 41]
    want = torch.zeros(2, V)
    want[0, a], want[1, b] = qa, qb
    assert torch.equal(q.dense(), want)


@pytest.mark.parametrize("saguaro", [False, True])
def test_columns_give_the_whole_rows_distribution(saguaro):
    """filter_logits / saguaro_probs on a row's columns equal the whole row's with -inf elsewhere."""
    g = torch.Generator().manual_seed(0)
    cols = torch.sort(torch.randperm(V, generator=g)[:20]).values
    compact = torch.randn(3, 20, generator=g) * 3  # [B, C]
    full = torch.full((3, V), float("-inf")).index_copy_(-1, cols, compact)  # [B, V]
    temp, top_k, top_p = torch.tensor([0.7, 1.0, 1.3]), torch.tensor([0, 5, 30]), torch.tensor([0.9, 1.0, 0.8])
    if saguaro:
        fo = torch.tensor([2, 3, 1])
        got = saguaro_probs(compact, temp, top_k, top_p, fo, 0.4)
        want = saguaro_probs(full, temp, top_k, top_p, fo, 0.4)
    else:
        got, want = filter_logits(compact, temp, top_k, top_p), filter_logits(full, temp, top_k, top_p)
    assert torch.allclose(SubsetQ(got, cols, V).dense(), want, atol=1e-7)


def test_restricted_draft_sends_its_columns(models):
    """A draft_vocab draft's sampled propose returns a SubsetQ over its kept ids (plus the row's context ids),
    its tokens among them; an unrestricted draft a whole [K, V] q."""
    target, _ = models
    vocab = target.config.vocab_size
    for draft_vocab, kind in ((24, SubsetQ), (None, torch.Tensor)):
        w = DraftWorker(random_model(vocab=vocab, layers=1, seed=4), dtype="float32", max_slots=1, max_len=64,
                        draft_vocab=draft_vocab)
        w.add(0, [3, 1, 4, 1, 5], SamplingSpec(temperature=1.0, seed=1))
        drafts, qs = w.propose([(0, 4)])
        q = qs[0]
        assert isinstance(q, kind) and tuple(q.shape) == (4, vocab)
        dense = dense_q(q)
        assert torch.allclose(dense.sum(-1), torch.ones(4), atol=1e-5)
        assert all(dense[i, t] > 0 for i, t in enumerate(drafts[0].tokens))
        if draft_vocab is not None:
            assert q.values.shape[1] < vocab and set(range(24)) <= set(q.cols.tolist())
