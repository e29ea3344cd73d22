"""CPU kernels besides the GEMM (ssd/kernels/cpu): token-by-token attention vs its SDPA reference,
RMSNorm vs the torch module."""

import pytest
import torch

from ssd.kernels import cpu as qk
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
