"""Dense fp32/bf16 linears through the AVX2 kernel (ssd.kernels.cpu.linear_dense, workers/models/dense.py):
kernel vs the fp32 F.linear reference, bitwise row independence, odd shapes, bad input, and the
model-level swap (tied head stays tied, fused projections, greedy output == the reference path)."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import greedy_tokens, random_model

from ssd import LLM, SamplingParams
from ssd.kernels import cpu as qk
from ssd.workers.models.dense import DenseLinear, apply_linear_kernel, use_dense_kernels
from ssd.workers.models.quant import reference_mode

pytestmark = pytest.mark.skipif(not qk.available(), reason=f"CPU kernels: {qk.unavailable_reason()}")

SHAPES = [(1, 64, 32), (3, 40, 48), (8, 100, 200), (17, 257, 130), (2, 8, 7)]  # (M, N, K): tails in N, K and M


def operands(m, n, k, wdtype, xdtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(wdtype)
    x = torch.randn(m, k, generator=g).to(xdtype)
    b = torch.randn(n, generator=g).to(wdtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["x32", "x16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_fp32_reference(shape, wdtype, xdtype, bias):
    x, w, b = operands(*shape, wdtype, xdtype, bias)
    got = qk.linear_dense(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == xdtype and got.shape == want.shape
    if xdtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of the fp32 result to bf16
        torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
def test_rows_are_independent_bitwise(threads, wdtype):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, b = operands(13, 300, 272, wdtype, torch.bfloat16, True, seed=1)
        full = qk.linear_dense(x, w, b)
        for lo, hi in [(0, 1), (5, 6), (12, 13), (2, 9), (0, 3), (4, 12)]:
            assert torch.equal(qk.linear_dense(x[lo:hi].contiguous(), w, b), full[lo:hi]), (lo, hi)
    finally:
        torch.set_num_threads(old)


def test_bad_input_is_a_clear_error():
    x, w, _ = operands(2, 16, 32, torch.bfloat16, torch.bfloat16, False)
    with pytest.raises(ValueError, match="do not match"):
        qk.linear_dense(x[:, :16].contiguous(), w)
    with pytest.raises(ValueError, match="fp32/bf16"):
        qk.linear_dense(x.half(), w)
    with pytest.raises(ValueError, match="contiguous"):
        qk.linear_dense(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="bias"):
        qk.linear_dense(x, w, torch.zeros(16))


def tiny(dtype=torch.bfloat16, tie=False):
    model = random_model(vocab=256, hidden=128, heads=4, kv_heads=2, layers=2, seed=5, scale=4.0)
    if tie:  # as Qwen2.5-0.5B/1.5B: the head is the embedding table
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype)


def test_model_swap_keeps_weights_shared_and_fuses():
    model = tiny(tie=True)
    head = model.lm_head.weight
    use_dense_kernels(model)
    assert isinstance(model.lm_head, DenseLinear) and model.lm_head.weight is head
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # tied head stays tied
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, DenseLinear) and attn.q_proj is None
    assert isinstance(mlp.gate_up_proj, DenseLinear) and mlp.gate_proj is None
    assert model.batch_invariant and model.linear_kernel == "dense"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_greedy_matches_reference_path_and_torch_model():
    base = tiny(torch.float32)
    prompt = list(range(3, 15))
    want = greedy_tokens(base, prompt, 24)  # torch F.linear, unfused
    model = use_dense_kernels(tiny(torch.float32))
    assert greedy_tokens(model, prompt, 24) == want
    with reference_mode(model):
        assert greedy_tokens(model, prompt, 24) == want


def test_apply_linear_kernel_choices():
    assert isinstance(apply_linear_kernel(tiny(), "auto").lm_head, DenseLinear)
    assert isinstance(apply_linear_kernel(tiny(), "torch").lm_head, torch.nn.Linear)
    with pytest.raises(ValueError, match="linear_kernel"):
        apply_linear_kernel(tiny(), "fast")
    with pytest.raises(RuntimeError, match="float16"):
        apply_linear_kernel(tiny(torch.float16), "dense")


def test_engine_uses_the_dense_kernel_on_a_copy():
    target = tiny()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(target=target, mode="ar", max_len=128) as llm:
        dense = llm.generate([1, 2, 3], sp)[0].token_ids
    assert isinstance(target.lm_head, torch.nn.Linear)  # the caller's module is not converted
    with LLM(target=target, mode="ar", max_len=128, linear_kernel="torch") as llm:
        plain = llm.generate([1, 2, 3], sp)[0].token_ids
    assert len(dense) == 8 and dense == plain
    with pytest.raises(ValueError, match="linear_kernel"):
        LLM(target=target, linear_kernel="fast")
