"""Weights copied into huge-page memory (workers/models/hugepages.py): same values, aligned, kept alive,
ties kept, and a layer computes the same bits from the copy."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from ssd.workers.models import hugepages
from ssd.workers.models.blockquant import W4A8Linear
from ssd.workers.models.hugepages import HUGE_PAGE, huge_page_copy, move_to_huge_pages

needs_thp = pytest.mark.skipif(not hugepages.available(), reason=f"transparent huge pages: {hugepages.thp_mode()}")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int16, torch.uint8, torch.float32])
def test_copy_has_the_same_bits_on_a_huge_page_boundary(dtype):
    src = (torch.randn(1500, 1000, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)  # 1.5-6 MB
    out = huge_page_copy(src)
    assert out.dtype == src.dtype and out.shape == src.shape and out.is_contiguous()
    assert out.data_ptr() % HUGE_PAGE == 0 and out.data_ptr() != src.data_ptr()
    assert torch.equal(out, src)


@needs_thp
def test_copy_outlives_every_other_reference():
    want = torch.arange(3 << 20, dtype=torch.uint8)
    out = huge_page_copy(want.clone())
    gc.collect()  # only the tensor now holds the mapping
    out.add_(1)
    assert torch.equal(out, want + 1)


def test_rejects_a_non_cpu_tensor():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to make a non-CPU tensor")
    with pytest.raises(ValueError, match="CPU"):
        huge_page_copy(torch.zeros(4, device="cuda"))


@needs_thp
def test_move_keeps_ties_and_skips_small_tensors():
    big, small = nn.Linear(1024, 1024, bias=True), nn.Linear(8, 8)
    tied = nn.Linear(1024, 1024, bias=False)
    tied.weight = big.weight  # one parameter in two modules
    model = nn.ModuleList([big, small, tied])
    model.register_buffer("table", torch.arange(1 << 20, dtype=torch.int32))  # 4 MB
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small_ptr, bias_ptr = small.weight.data_ptr(), big.bias.data_ptr()
    param = big.weight
    moved = move_to_huge_pages(model)
    assert moved == 1024 * 1024 * 4 + (1 << 20) * 4  # the shared weight once, the buffer; not the rest
    assert big.weight is param and tied.weight is big.weight  # same Parameter objects, still tied
    assert big.weight.data_ptr() % HUGE_PAGE == 0 and model.table.data_ptr() % HUGE_PAGE == 0
    assert small.weight.data_ptr() == small_ptr and big.bias.data_ptr() == bias_ptr
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@needs_thp
def test_quantised_layer_gives_the_same_bits_from_huge_pages():
    g = torch.Generator().manual_seed(1)
    lin = W4A8Linear.from_float(torch.randn(8192, 1024, generator=g), None, torch.float32)  # 4 MB of codes
    x = torch.randn(3, 1024, generator=g)
    want = lin(x)
    assert move_to_huge_pages(lin) > 0
    assert lin.qweight.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(lin(x), want)


def test_nothing_moves_without_thp(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    layer = nn.Linear(1024, 1024)
    ptr = layer.weight.data_ptr()
    assert move_to_huge_pages(layer) == 0 and layer.weight.data_ptr() == ptr


def test_thp_mode_reads_the_bracketed_setting(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "_THP_SETTING", setting)
    assert hugepages.thp_mode() == "madvise"
    monkeypatch.setattr(hugepages, "_THP_SETTING", tmp_path / "absent")
    assert hugepages.thp_mode() == "unavailable"
