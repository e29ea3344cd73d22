"""CPU kernels besides the GEMM (ssd/kernels/cpu): token-by-token attention vs its SDPA reference,
RMSNorm vs the torch module."""

import pytest
import torch

from ssd.kernels import cpu as qk
from ssd.kernels.sampling import argmax_last
from ssd.workers.models.decoder import RMSNorm

pytestmark = pytest.mark.skipif(not qk.available(), reason=f"CPU kernels: {qk.unavailable_reason()}")


def case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(3, 2, 80, 64, generator=g).to(dtype)  # [S, Hkv, max_len, hd]
    vc = torch.randn(3, 2, 80, 64, generator=g).to(dtype)
    q = torch.randn(5, 14, 64, generator=g).to(dtype)  # GQA: 7 query heads per KV head
    rows = [(0, 0, 1, 10), (0, 1, 2, 80), (0, 2, 0, torch.tensor([0, 3, 5, 9])), (1, 0, 1, 1), (1, 1, 0, 33)]
    return q, kc, vc, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dtype):
    q, kc, vc, rows = case(dtype)
    plan = qk.RowPlan.from_rows(rows)
    got, want = qk.attend_rows(q, kc, vc, plan), qk.ref_attend_rows(q, kc, vc, plan)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_token_alone_gives_the_same_bits(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kc, vc, rows = case(torch.bfloat16, seed=1)
        full = qk.attend_rows(q, kc, vc, qk.RowPlan.from_rows(rows))
        for j, row in enumerate(rows):
            assert torch.equal(qk.attend_rows(q[j : j + 1], kc, vc, qk.RowPlan.from_rows([row])), full[j : j + 1])
    finally:
        torch.set_num_threads(old)


def verification_case(seed: int, hd: int = 128):
    """A verification's 8 tokens of one slot (keys 0..120+i, sharing a job), a tree token and another slot."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(2, 2, 160, hd, generator=g).bfloat16()
    vc = torch.randn(2, 2, 160, hd, generator=g).bfloat16()
    rows = [(0, i, 1, 121 + i) for i in range(8)] + [(1, 0, 1, torch.tensor([0, 7, 50, 129])), (2, 0, 0, 40)]
    q = torch.randn(len(rows), 12, hd, generator=g).bfloat16()
    return q, kc, vc, rows


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_sharing_converted_keys_give_their_own_bits(threads):
    """Rows of one slot share a job (keys and values converted once): each still gets the bits it gets
    alone, at every thread count (which decides how rows group)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kc, vc, rows = verification_case(seed=4)
        full = qk.attend_rows(q, kc, vc, qk.RowPlan.from_rows(rows))
        for j, row in enumerate(rows):
            assert torch.equal(qk.attend_rows(q[j : j + 1], kc, vc, qk.RowPlan.from_rows([row])), full[j : j + 1])
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(full.float(), qk.ref_attend_rows(q, kc, vc, qk.RowPlan.from_rows(rows)).float(),
                               rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("build", [name for name in qk.ISA_FLAGS if name != "avx2"])
def test_attention_builds_give_the_avx2_bits(build, monkeypatch):
    """The AVX-512 build sums p * v in 16-lane vectors: the same operation per element as avx2's 8 lanes."""
    if build not in qk.supported_isas():
        pytest.skip(f"this CPU cannot run the {build} build")
    q, kc, vc, rows = verification_case(seed=5)
    plan = qk.RowPlan.from_rows(rows)
    outs = []
    for name in ("avx2", build):
        lib = qk.load(name)
        monkeypatch.setattr(qk, "_lib", lambda lib=lib: lib)
        outs.append(qk.attend_rows(q, kc, vc, plan))
    assert torch.equal(outs[0], outs[1])


def test_strided_queries_and_bad_input():
    q, kc, vc, rows = case(torch.float32, seed=2)
    plan = qk.RowPlan.from_rows(rows)
    wide = torch.cat([q, torch.randn(5, 4, 64)], dim=1)[:, :14]  # rows strided like a slice of fused q|k
    assert torch.equal(qk.attend_rows(wide, kc, vc, plan), qk.attend_rows(q, kc, vc, plan))
    with pytest.raises(ValueError, match="attend_rows"):
        qk.attend_rows(q.bfloat16(), kc, vc, plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_module_and_is_row_independent(dtype):
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    want = norm(x)
    norm.use_cpu_kernel = True
    got = norm(x)
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # fp32 sum order only (then one bf16 rounding)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(torch.cat([norm(x[i : i + 1]) for i in range(7)]), got)


def test_rmsnorm_refuses_what_it_cannot_read():
    """The kernel reads fp32 or bf16: an fp16 tensor (or a weight of another dtype or size) had been read and
    written as fp32, past the end of its buffer. The module takes torch's formula for fp16."""
    x = torch.randn(4, 96)
    for bad_x, bad_w in [(x.half(), torch.ones(96).half()), (x, torch.ones(96).bfloat16()), (x, torch.ones(95)),
                         (x.t().contiguous().t(), torch.ones(4))]:
        with pytest.raises(ValueError, match="rmsnorm"):
            qk.rmsnorm(bad_x, bad_w, 1e-6)
    norm = RMSNorm(96, 1e-6).half()
    norm.use_cpu_kernel = True
    assert norm(x.half()).dtype == torch.float16
    from tiny_models import random_model

    from ssd.workers.models.quant import quantize_model

    with pytest.raises(ValueError, match="float32 or bfloat16 model, not torch.float16"):
        quantize_model(random_model(vocab=32, hidden=64, heads=2, kv_heads=1).half(), "w8a8")


@pytest.mark.parametrize("v", [1, 7, 32, 33, 100, 32769, 151936])
def test_argmax_rows_is_torchs_argmax(v):
    """The first maximum of each row, as torch.argmax: random rows, rows of many ties, all -inf, 3-d input;
    a row holding a NaN is torch's (NaN ranks highest)."""
    g = torch.Generator().manual_seed(v)
    cases = [torch.randn(5, v, generator=g), torch.randint(0, 3, (5, v), generator=g).float(),
             torch.full((2, v), float("-inf")), torch.randn(2, 3, v, generator=g)]
    nan = torch.randn(4, v, generator=g)
    nan[1, v // 2] = float("nan")
    nan[3, -1] = float("nan")
    for x in [*cases, nan]:
        assert torch.equal(qk.argmax_rows(x), x.argmax(-1))
        assert torch.equal(argmax_last(x), x.argmax(-1))
    ties = torch.zeros(3, v)
    ties[:, v // 3 :] = 1.0  # every later column ties the first maximum
    assert qk.argmax_rows(ties).tolist() == [v // 3] * 3


def test_argmax_last_takes_torch_where_the_kernel_cannot_and_bad_input():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    for other in (x.bfloat16(), x.t(), x.double()):  # not contiguous fp32: torch.argmax
        assert torch.equal(argmax_last(other), other.argmax(-1))
    for bad in (x.bfloat16(), x.t(), torch.zeros(3, 0)):
        with pytest.raises(ValueError, match="argmax_rows"):
            qk.argmax_rows(bad)
