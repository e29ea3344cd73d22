"""Our decoder + KV cache vs transformers' own model code on tiny random configs."""

import pytest
import torch
from tiny_models import hf_model, ours_from_hf, random_model

from ssd.workers.model_runner import ModelRunner

ARCHS = ["llama", "qwen2", "qwen3"]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [n, V]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_prefill_and_decode_match_transformers(arch, dtype, tol):
    hf = hf_model(arch).to(dtype)
    ours = ours_from_hf(hf, dtype)
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)  # [12, V]
    runner = ModelRunner(ours, max_slots=2, max_len=64)
    slot = runner.allocate()
    pre = runner.forward([slot], [ids[:7]])[0]  # prefill 7
    torch.testing.assert_close(pre, ref[:7], atol=tol, rtol=tol)
    for i in range(7, 12):  # decode one at a time; the prefix is read from the cache
        step = runner.forward([slot], [[ids[i]]])[0, 0]
        torch.testing.assert_close(step, ref[i], atol=tol, rtol=tol)
    assert runner.length(slot) == 12


@pytest.mark.parametrize("arch", ARCHS)
def test_multi_token_scoring_equals_one_by_one(arch):
    ours = ours_from_hf(hf_model(arch))
    runner = ModelRunner(ours, max_slots=2, max_len=64)
    a, b = runner.allocate(), runner.allocate()
    prompt = [3, 5, 7, 11, 13]
    new = [17, 19, 23, 29]
    runner.forward([a], [prompt])
    runner.forward([b], [prompt])
    block = runner.forward([a], [new])[0]  # [4, V]
    singles = torch.stack([runner.forward([b], [[t]])[0, 0] for t in new])
    torch.testing.assert_close(block, singles, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_equals_separate(arch):
    ours = ours_from_hf(hf_model(arch))
    runner = ModelRunner(ours, max_slots=4, max_len=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    slots = [runner.allocate() for _ in prompts]
    batched = runner.forward(slots, prompts)  # [3, 6, V]
    new = [[11, 12], [13], [14, 15, 16]]
    batched2 = runner.forward(slots, new)
    for i, (p, nw) in enumerate(zip(prompts, new)):
        hf = ours_from_hf(hf_model(arch))
        solo = ModelRunner(hf, max_slots=1, max_len=64)
        s = solo.allocate()
        ref = solo.forward([s], [p])[0]
        torch.testing.assert_close(batched[i, : len(p)], ref, atol=1e-5, rtol=1e-5)
        ref2 = solo.forward([s], [nw])[0]
        torch.testing.assert_close(batched2[i, : len(nw)], ref2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_mask_equals_each_branch(arch):
    ours = ours_from_hf(hf_model(arch))
    runner = ModelRunner(ours, max_slots=4, max_len=64)
    prompt = [2, 4, 6, 8]
    # tree: 0:a(root child) 1:b(child of 0) 2:c(child of 0) 3:d(root child) 4:e(child of 3) 5:f(child of 1)
    toks = [30, 31, 32, 33, 34, 35]
    parents = [-1, 0, 0, -1, 3, 1]
    paths = {0: [30], 1: [30, 31], 2: [30, 32], 3: [33], 4: [33, 34], 5: [30, 31, 35]}
    t = runner.allocate()
    runner.forward([t], [prompt])
    tree_logits = runner.forward([t], [toks], parents=[parents])[0]  # [6, V]
    for node, path in paths.items():
        s = runner.allocate()
        runner.forward([s], [prompt])
        ref = runner.forward([s], [path])[0, -1]
        torch.testing.assert_close(tree_logits[node], ref, atol=1e-5, rtol=1e-5)
        runner.free(s)
    # keep the accepted path 0 -> 1 -> 5, then decoding continues as if only that path was fed
    runner.keep(t, len(prompt), [0, 1, 5])
    after = runner.forward([t], [[9]])[0, 0]
    s = runner.allocate()
    ref = runner.forward([s], [prompt + [30, 31, 35, 9]])[0, -1]
    torch.testing.assert_close(after, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_then_redecode_equals_never_decoded(arch):
    ours = ours_from_hf(hf_model(arch))
    runner = ModelRunner(ours, max_slots=2, max_len=64)
    s = runner.allocate()
    runner.forward([s], [[1, 2, 3, 4]])
    runner.forward([s], [[50, 51, 52]])  # rejected draft
    runner.truncate(s, 4)
    got = runner.forward([s], [[7, 8]])[0]
    r = runner.allocate()
    ref = runner.forward([r], [[1, 2, 3, 4, 7, 8]])[0, 4:]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_slots_are_reused_and_capacity_checked():
    ours = ours_from_hf(hf_model("qwen2"))
    runner = ModelRunner(ours, max_slots=1, max_len=8)
    s = runner.allocate()
    with pytest.raises(RuntimeError, match="full"):
        runner.allocate()
    with pytest.raises(ValueError, match="exceed"):
        runner.forward([s], [list(range(9))])
    runner.free(s)
    assert runner.allocate() == s


def test_tree_grown_over_several_forwards_equals_branches():
    """The SSD draft's pattern: a cached chain, branches off it, extended one step per forward."""
    ours = ours_from_hf(hf_model("qwen3"))
    runner = ModelRunner(ours, max_slots=4, max_len=64)
    prompt, chain = [2, 4, 6, 8], [10, 11, 12]
    s = runner.allocate()
    runner.forward([s], [prompt + chain])
    runner.open_tree(s, len(prompt))  # chain nodes 0, 1, 2
    # branches: off the prefix (k=0), off chain node 1 (k=2); then extend both by one token
    step1 = runner.forward([s], [[20, 21]], parents=[[-1, 1]])[0]
    step2 = runner.forward([s], [[30, 31]], parents=[[3, 4]])[0]
    r = runner.allocate()
    for got, path in [
        (step1[0], [20]), (step1[1], [10, 11, 21]), (step2[0], [20, 30]), (step2[1], [10, 11, 21, 31])
    ]:
        runner.truncate(r, 0)
        ref = runner.forward([r], [prompt + path])[0, -1]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # accept branch 2 (chain 0, 1 then nodes 4, 6): continuing equals a plain prefix
    runner.keep(s, len(prompt), [0, 1, 4, 6])
    after = runner.forward([s], [[40]])[0, 0]
    runner.truncate(r, 0)
    ref = runner.forward([r], [prompt + [10, 11, 21, 31, 40]])[0, -1]
    torch.testing.assert_close(after, ref, atol=1e-5, rtol=1e-5)


def test_rope_frequencies_stay_fp32_when_the_model_is_cast():
    """An in-memory model cast to bf16 (as the workers do) keeps fp32 RoPE frequencies: rounded to bf16 they
    would be a whole radian off by position ~1000."""
    from ssd.workers.models.decoder import rope_inv_freq

    model = random_model(vocab=32, hidden=256, heads=2, kv_heads=2).to(torch.bfloat16)
    assert model.inv_freq.dtype == torch.float32
    assert torch.equal(model.inv_freq, rope_inv_freq(model.config))
