"""All decoder layers of a batch-invariant CPU model in one C call (`ssd.kernels.cpu.decoder_layers`).

With the CPU kernels a decode step spends most of its non-GEMM time in Python and ~20 small torch
ops per layer (18 of 66 ms on the 0.5B in w4a8). `FusedLayers` describes every layer's weights,
norms and KV cache once (pointers into the model's own tensors) and runs the layers of the
row-by-row attention path (every forward of a batch-invariant model: prefill, decode, verification)
in C, with the same kernels and the same roundings as the torch path — the two give the same bits
(tested). Anything the C code does not cover (torch-kernel linears, q/k norms, tensor-parallel
layers, reference mode) stays on the torch path.
"""

from __future__ import annotations

import operator

import torch
from torch import nn

from ssd.kernels import cpu as cpu_kernels
from ssd.workers.models.blockquant import W4A8Linear, W4G64A8Linear, W5A8Linear, W6A8Linear, W8A8Linear
from ssd.workers.models.dense import DenseLinear

_REST = (("o", "self_attn", "o_proj"), ("gate_up", "mlp", "gate_up_proj"), ("down", "mlp", "down_proj"))
_USES_REFERENCE = operator.attrgetter("use_reference")  # every fused linear is a _QuantLinear


def _layer_linears(layer: nn.Module) -> list[tuple[str, str, nn.Module | None]]:
    """(descriptor field, module name, module) of one layer's linears: the fused q/k/v projection, or
    q, k and v apart when they are quantised differently (Q4_K_M GGUFs keep some v at 8 bits)."""
    attn = layer.self_attn
    if attn.qkv_proj is not None:
        qkv = [("q", "qkv_proj", attn.qkv_proj)]
    else:
        qkv = [(f, f"{f}_proj", getattr(attn, f"{f}_proj")) for f in ("q", "k", "v")]
    return qkv + [(f, name, getattr(getattr(layer, parent), name)) for f, parent, name in _REST]


def _linear_kind(mod: nn.Module | None) -> int | None:
    if getattr(mod, "use_reference", False):
        return None
    if isinstance(mod, DenseLinear):
        return 0
    if isinstance(mod, W4G64A8Linear):
        return 5
    if isinstance(mod, W4A8Linear):
        return 1
    if isinstance(mod, W8A8Linear):
        return 2
    if isinstance(mod, W5A8Linear):
        return 3
    if isinstance(mod, W6A8Linear):
        return 4
    return None


def why_not(model: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None when every layer of `model` can run in C with these caches [L, S, Hkv, max_len, hd], else why not."""
    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        return reason
    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16) or model.embed_tokens.weight.device.type != "cpu":
        return f"activations {dtype} on {model.embed_tokens.weight.device}"
    if cfg.qk_norm or cfg.head_dim > 512 or cfg.head_dim % 2:
        return "q/k norms or an unsupported head_dim"
    for c in (k_cache, v_cache):
        if c.dtype != dtype or not c.is_contiguous() or c.device.type != "cpu":
            return "KV cache not a contiguous CPU tensor in the activation dtype"
    for i, layer in enumerate(model.layers):
        for _, name, mod in _layer_linears(layer):
            if _linear_kind(mod) is None:
                return f"layer {i} {name} is {type(mod).__name__}"
            if isinstance(mod, DenseLinear) and mod.weight.dtype not in (torch.float32, torch.bfloat16):
                return f"layer {i} {name}: dense weight {mod.weight.dtype}"
            if not isinstance(mod, DenseLinear) and mod.bias is not None and mod.bias.dtype != dtype:
                return f"layer {i} {name}: bias {mod.bias.dtype}"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not norm.use_cpu_kernel or norm.weight.dtype != dtype:
                return f"layer {i}: RMSNorm not on the C kernel in {dtype}"
    return None


def signature(model: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """What `why_not` depends on that can change after a model is built: the linear modules, their
    reference flags and the caches (so a refusal is not re-checked every forward)."""
    mods = tuple((id(m), getattr(m, "use_reference", False)) for layer in model.layers
                 for _, _, m in _layer_linears(layer))
    return (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype, mods)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedLayers:
    """Descriptors of `model`'s layers and KV caches for `ssd.kernels.cpu.decoder_layers`."""

    def __init__(self, model: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        reason = why_not(model, k_cache, v_cache)
        if reason is not None:
            raise ValueError(f"fused decoder layers unavailable: {reason}")
        cfg = model.config
        self.modules = [m for layer in model.layers for _, _, m in _layer_linears(layer)]
        self.model = model
        watch = self._watch(model)
        # matches() compares these in C-level loops (map), not bytecode: ~500 entries per forward
        self._owners, self._keys, self._objs = (tuple(e[i] for e in watch) for i in range(3))
        self._params = tuple(e[2] for e in watch if e[3] is not None)
        self._param_ptrs = [e[3] for e in watch if e[3] is not None]
        self.caches = [(c.data_ptr(), c.shape) for c in (k_cache, v_cache)]
        self.layers = (cpu_kernels.LayerDesc * len(model.layers))()
        for i, layer in enumerate(model.layers):
            desc = self.layers[i]
            linears = _layer_linears(layer)
            desc.qkv_parts = 1 if linears[0][1] == "qkv_proj" else 3
            for field, _, mod in linears:
                setattr(desc, field, self._linear(mod))
            desc.in_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.k_cache, desc.v_cache = k_cache[i].data_ptr(), v_cache[i].data_ptr()
        self.dims = cpu_kernels.LayerDims(
            hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, max_len=k_cache.shape[3], eps=cfg.rms_norm_eps,
        )

    @staticmethod
    def _linear(mod: nn.Module) -> cpu_kernels.LinearDesc:
        kind = _linear_kind(mod)
        d = cpu_kernels.LinearDesc(kind=kind, n=mod.out_features, k=mod.in_features)
        if isinstance(mod, DenseLinear):
            d.w, d.w_bf16 = mod.weight.data_ptr(), int(mod.weight.dtype == torch.bfloat16)
        else:
            d.w, d.scale = mod.qweight.data_ptr(), mod.scale_bits.data_ptr()
            if isinstance(mod, W4A8Linear):  # q4, q4g64
                d.offset = mod.offset_bits.data_ptr()
        d.bias = _ptr(mod.bias)
        return d

    @staticmethod
    def _watch(model: nn.Module) -> list[tuple[dict, str, object, int | None]]:
        """(owning dict, key, object, data pointer) of every module and tensor the descriptors depend on.

        Reading the owners' dicts directly keeps `matches` at a few hundred dict lookups per forward;
        nn.Module.__getattr__ over every tensor cost ~4 ms per decode step on the 0.5B. Buffers are
        watched by identity (they are replaced by assignment: register_buffer, module._apply); only
        parameters also by data pointer, since `param.data = x` keeps the object. After a decode step has
        streamed the weights these objects are out of cache, and a data_ptr() call on each of ~500
        tensors cost ~1 ms per forward on the 1.5B.
        """
        out: list[tuple[dict, str, object, int | None]] = []

        def slot(owner: dict, key: str) -> object:
            obj = owner.get(key)
            out.append((owner, key, obj, obj.data_ptr() if isinstance(obj, nn.Parameter) else None))
            return obj

        layers = slot(model._modules, "layers")
        for i in range(len(layers)):
            layer = slot(layers._modules, str(i))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                slot(slot(layer._modules, norm)._parameters, "weight")
            for part, names in (("self_attn", ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")),
                                ("mlp", ("gate_up_proj", "down_proj"))):
                owner = slot(layer._modules, part)
                for name in names:
                    mod = slot(owner._modules, name)
                    if mod is None:
                        continue
                    for store in (mod._parameters, mod._buffers):
                        for key in ("weight", "qweight", "scale_bits", "offset_bits", "bias"):
                            if key in store:
                                slot(store, key)
        return out

    def matches(self, model: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether the descriptors still point at `model`'s tensors and these caches (no module swapped,
        no tensor moved or re-allocated, no layer in reference mode)."""
        if self.model is not model or any(map(_USES_REFERENCE, self.modules)):
            return False
        if [(c.data_ptr(), c.shape) for c in (k_cache, v_cache)] != self.caches:
            return False
        if not all(map(operator.is_, map(dict.get, self._owners, self._keys), self._objs)):
            return False
        return list(map(torch.Tensor.data_ptr, self._params)) == self._param_ptrs

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_slot: torch.Tensor,
            write_pos: torch.Tensor, plan: cpu_kernels.RowPlan) -> torch.Tensor:
        """x [T, D] -> [T, D] through every layer; token t's keys go to (write_slot[t], write_pos[t])."""
        return cpu_kernels.decoder_layers(
            self.layers, self.dims, x.contiguous(), cos.contiguous(), sin.contiguous(),
            write_slot.to(torch.int32), write_pos.to(torch.int32), plan,
        )
