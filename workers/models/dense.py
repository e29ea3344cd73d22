"""Unquantised (fp32 / bf16) linears run by the AVX2 dense kernel (``ssd.kernels.cpu.linear_dense``).

torch's CPU GEMMs pick different blockings for different row counts, so a token scored in a K+1
block does not get the bits it gets when decoded alone, and bf16 matmuls on AVX2 machines (no native
bf16) are slow: verifying 8 tokens costs ~6x one decode step. The dense kernel reads the weights as
stored (bf16 stays bf16: nothing is quantised), accumulates in fp32 in a fixed order per output and
gives every row the same bits whatever the number of rows — the same batch invariance as the
quantised layers, so greedy SD/SSD reproduce AR exactly on bf16 weights too.

`use_dense_kernels(model)` swaps every `nn.Linear` of a CPU model for a `DenseLinear` that shares
its weight tensor (a tied head stays tied), fuses q/k/v and gate/up, turns on the RMSNorm and
attention kernels and marks the model batch invariant. `ref_forward` (fp32 `F.linear`) is the
reference the kernel is tested against.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ssd.kernels import cpu as cpu_kernels
from ssd.workers.models.quant import _QuantLinear, fuse_projections

log = logging.getLogger("ssd.dense")

LINEAR_KERNELS = ("auto", "dense", "torch")


class DenseLinear(_QuantLinear):
    """y = x @ weight.T (+ bias), weight [N, K] fp32 or bf16, fp32 accumulation, output in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"DenseLinear takes fp32/bf16 CPU weights, got {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        # A Parameter stays a Parameter (shared with a tied embedding); buffers otherwise.
        if isinstance(weight, nn.Parameter):
            self.weight = weight
        else:
            self.register_buffer("weight", weight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype).contiguous())

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> DenseLinear:
        if not lin.weight.is_contiguous():
            raise ValueError("DenseLinear needs a contiguous [N, K] weight")
        return cls(lin.weight, lin.bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.detach().float()

    def ref_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reference: fp32 F.linear (bias added in fp32), rounded once to the activation dtype."""
        b = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.detach().float(), b).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reference:
            return self.ref_forward(x)
        y = cpu_kernels.linear_dense(self._kernel_rows(x), self.weight.detach(), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def concat_dense(mods: list[DenseLinear]) -> DenseLinear | None:
    """One layer computing the given layers side by side (weights concatenated), or None if they differ."""
    first = mods[0]
    if not all(isinstance(m, DenseLinear) and m.in_features == first.in_features
               and m.weight.dtype == first.weight.dtype for m in mods):
        return None
    bias = None
    if any(m.bias is not None for m in mods):
        bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=first.weight.dtype)
                          for m in mods])
    return DenseLinear(torch.cat([m.weight.detach() for m in mods]), bias)


def dense_kernels_apply(model: nn.Module) -> str | None:
    """None when `use_dense_kernels` can convert `model`, else why not."""
    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        return reason
    params = list(model.parameters())
    if not params:
        return "model has no parameters"
    p = params[0]
    if p.device.type != "cpu":
        return f"model on {p.device}, the dense kernel is CPU only"
    if p.dtype not in (torch.float32, torch.bfloat16):
        return f"model dtype {p.dtype} (the dense kernel takes fp32/bf16)"
    if getattr(model, "quantization", None) is not None:
        return f"model is quantised ({model.quantization})"
    return None


def use_dense_kernels(model: nn.Module, fuse: bool = True) -> nn.Module:
    """Swap every nn.Linear for a DenseLinear sharing its weight; mark the model batch invariant.

    Raises when the model cannot use the kernel (see `dense_kernels_apply`), so a caller that asked
    for it never silently runs torch's non-invariant GEMMs.
    """
    reason = dense_kernels_apply(model)
    if reason is not None:
        raise RuntimeError(f"dense CPU kernels unavailable: {reason}")
    swapped = 0
    for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, DenseLinear.from_linear(lin))
        swapped += 1
    if fuse:
        fuse_projections(model)
    for m in model.modules():
        if hasattr(m, "use_cpu_kernel"):
            m.use_cpu_kernel = True  # RMSNorm
    if hasattr(model, "batch_invariant"):
        model.batch_invariant = True
    model.linear_kernel = "dense"
    log.debug("dense CPU kernels: %d linear layers", swapped)
    return model


def apply_linear_kernel(model: nn.Module, choice: str) -> nn.Module:
    """`use_dense_kernels` per the `linear_kernel` setting: "dense" (required: raise if it cannot run),
    "torch" (leave nn.Linear), "auto" (dense for unquantised fp32/bf16 CPU models; quantised models and
    GPUs keep their own kernels; a CPU model that cannot use it runs torch's GEMMs, with a warning).
    """
    if choice not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear_kernel {choice!r}; use one of {', '.join(LINEAR_KERNELS)}")
    if choice == "torch":
        return model
    reason = dense_kernels_apply(model)
    if reason is None:
        return use_dense_kernels(model)
    if choice == "dense":
        raise RuntimeError(f"linear_kernel='dense' cannot run: {reason}")
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cpu" and getattr(model, "quantization", None) is None:
        log.warning("dense CPU kernel unavailable (%s): torch F.linear, slower and not batch invariant", reason)
    return model
