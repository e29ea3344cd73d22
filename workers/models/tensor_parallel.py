"""Megatron-style tensor parallelism for a loaded DecoderModel: `shard_model(model, rank, world_size)`.

Per decoder layer, rank r of W keeps
* attention: query heads [r*H/W, (r+1)*H/W) and KV heads [r*Hkv/W, (r+1)*Hkv/W) of q/k/v_proj (or of
  the fused qkv_proj): column-parallel, no communication. With contiguous head blocks, every query
  head's KV head (h // (H/Hkv)) lies on the same rank, and the KV cache per rank holds only its
  Hkv/W heads (ModelRunner reads the per-rank count from the attention modules).
* o_proj: the matching input columns, row-parallel: a partial product, summed over the group (all-reduce
  for 2 ranks; beyond, gathered and summed in rank order, so a token's bits do not depend on the forward's
  size), then the bias (if any) added once.
* MLP: gate/up_proj (or fused gate_up_proj) column-parallel over intermediate features
  [r*I/W, (r+1)*I/W), down_proj row-parallel like o_proj.
* Embeddings, norms and the LM head: replicated. Every rank therefore computes the same logits
  from the same all-reduced hidden states (and samples the same tokens from the same seeds).

Quantised layers (quant.Int8Linear / Int4Linear) are sliced as they are, without requantising,
so a TP model runs exactly the weights of the single-rank model (int8: per-output-row scales, any
split; int4: column splits on whole groups of 32 inputs). Only the summation order of the
all-reduce differs from one rank: expect ~1e-6 relative differences in fp32, not bitwise equality.

The all-reduce runs on `group` (None: torch.distributed's default group, looked up at call time,
so a model may be sharded before the process group exists).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ssd.workers.models.decoder import DecoderModel
from ssd.workers.models.quant import Int4Linear, Int8Linear, pack_int4


class RowParallelLinear(nn.Module):
    """y = all_reduce(inner(x_local)) + bias: the local part of a linear layer split along its inputs."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group: object = None) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias)
        self.group = group
        self.in_features = inner.in_features  # local
        self.out_features = inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if not y.is_contiguous():
            y = y.contiguous()
        world = dist.get_world_size(self.group)
        if world <= 2:  # a + b: the same bits in any order
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        else:
            # A ring all-reduce sums each chunk of the buffer in its own rank order, and the chunks follow the
            # buffer's size: an element's bits would depend on how many tokens share the forward. Gathered
            # and summed in rank order, they do not (batch invariance, greedy SD == AR).
            parts = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(parts, y, group=self.group)
            y = parts[0]
            for p in parts[1:]:
                y = y + p
        if self.bias is not None:
            y = y + self.bias
        return y


def _bias_of(layer: nn.Module) -> torch.Tensor | None:
    b = getattr(layer, "bias", None)
    return None if b is None else b.detach()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    n, k = weight.shape
    lin = torch.nn.utils.skip_init(nn.Linear, k, n, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def select_outputs(layer: nn.Module, idx: torch.Tensor) -> nn.Module:
    """A layer computing only output features `idx` of `layer` (column parallelism), from the same weights."""
    b = _bias_of(layer)
    b = None if b is None else b[idx.to(b.device)].clone()
    if isinstance(layer, nn.Linear):
        return _linear(layer.weight.detach()[idx.to(layer.weight.device)], b)
    if isinstance(layer, Int8Linear):
        i = idx.to(layer.qweight.device)
        return Int8Linear(layer.qweight[i].clone(), layer.scales[i].clone(), b)
    if isinstance(layer, Int4Linear):
        if not Int4Linear.supports(len(idx), layer.in_features, layer.group_size):
            raise ValueError(
                f"tensor parallelism: an int4 layer of {len(idx)} output features per rank is not supported "
                "by the int4 kernel (needs a multiple of 16); use int8 or a smaller tp"
            )
        codes = layer.codes()[idx]
        sz = layer.scales_and_zeros[:, idx.to(layer.scales_and_zeros.device)].clone()
        return Int4Linear(pack_int4(codes, layer.qweight.device), sz, b, layer.in_features, layer.group_size)
    raise TypeError(f"tensor parallelism: cannot shard a {type(layer).__name__}")


def select_inputs(layer: nn.Module, start: int, stop: int) -> tuple[nn.Module, torch.Tensor | None]:
    """(layer over input features [start, stop) without its bias, the bias) (row parallelism)."""
    b = _bias_of(layer)
    if isinstance(layer, nn.Linear):
        return _linear(layer.weight.detach()[:, start:stop].clone(), None), b
    if isinstance(layer, Int8Linear):  # per-output-row scales: unchanged by a split of the inputs
        return Int8Linear(layer.qweight[:, start:stop].clone(), layer.scales.clone(), None), b
    if isinstance(layer, Int4Linear):
        g = layer.group_size
        if start % g or stop % g or not Int4Linear.supports(layer.out_features, stop - start, g):
            raise ValueError(
                f"tensor parallelism: int4 layer inputs [{start}, {stop}) per rank do not fall on whole groups "
                f"of {g}; use int8 or a smaller tp"
            )
        codes = layer.codes()[:, start:stop]
        sz = layer.scales_and_zeros[start // g : stop // g].clone()
        return Int4Linear(pack_int4(codes, layer.qweight.device), sz, None, stop - start, g), b
    raise TypeError(f"tensor parallelism: cannot shard a {type(layer).__name__}")


def _block(rank: int, world_size: int, total: int, what: str) -> tuple[int, int]:
    if total % world_size:
        raise ValueError(f"tensor parallelism: {what} ({total}) is not divisible by tp={world_size}")
    per = total // world_size
    return rank * per, (rank + 1) * per


def _arange(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, b, dtype=torch.long)


def shard_model(model: DecoderModel, rank: int, world_size: int, group: object = None) -> DecoderModel:
    """Convert a loaded (optionally quantised / fused) DecoderModel in place to rank `rank` of `world_size`.

    Raises ValueError when the attention heads, KV heads or MLP width do not divide evenly.
    world_size 1 leaves the model as it is.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} outside 0..{world_size - 1}")
    if getattr(model, "tp_size", 1) != 1:
        raise ValueError("model is already sharded")
    if world_size == 1:
        return model
    cfg = model.config
    H, Hkv, hd, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    q0, q1 = _block(rank, world_size, H, "num_attention_heads")
    k0, k1 = _block(rank, world_size, Hkv, "num_key_value_heads")
    i0, i1 = _block(rank, world_size, inter, "intermediate_size")
    q_idx, kv_idx = _arange(q0 * hd, q1 * hd), _arange(k0 * hd, k1 * hd)
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            if getattr(attn, "qkv_proj", None) is not None:  # fused [q | k | v]
                idx = torch.cat([q_idx, H * hd + kv_idx, (H + Hkv) * hd + kv_idx])
                attn.qkv_proj = select_outputs(attn.qkv_proj, idx)
            else:
                attn.q_proj = select_outputs(attn.q_proj, q_idx)
                attn.k_proj = select_outputs(attn.k_proj, kv_idx)
                attn.v_proj = select_outputs(attn.v_proj, kv_idx)
            attn.o_proj = RowParallelLinear(*select_inputs(attn.o_proj, q0 * hd, q1 * hd), group)
            attn.n_heads, attn.n_kv = q1 - q0, k1 - k0
            mlp = layer.mlp
            local = _arange(i0, i1)
            if getattr(mlp, "gate_up_proj", None) is not None:  # fused [gate | up]
                mlp.gate_up_proj = select_outputs(mlp.gate_up_proj, torch.cat([local, inter + local]))
            else:
                mlp.gate_proj = select_outputs(mlp.gate_proj, local)
                mlp.up_proj = select_outputs(mlp.up_proj, local)
            mlp.down_proj = RowParallelLinear(*select_inputs(mlp.down_proj, i0, i1), group)
    model.tp_rank, model.tp_size = rank, world_size
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()  # the full weights just dropped
    return model
