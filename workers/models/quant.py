"""Weight-only quantised linear layers for CPU decoding, and `quantize_model` to swap them in.

* `Int8Linear`: per-output-channel symmetric int8, `torch._weight_int8pack_mm`.
* `Int4Linear`: groupwise (32) affine int4, `torch._weight_int4pack_mm_for_cpu`. That op computes
  every weight as `(q - 8) * scale + zero` with q in 0..15 and (scale, zero) per (group, column),
  in the activation dtype (checked by experiment on torch 2.13 and in the kernel source). An affine
  group `w = a * q + b` (round-to-nearest from floats, or a GGUF Q4_K sub-block `d*sc*q - dmin*m`)
  therefore maps to scale = a, zero = b + 8a without re-rounding the codes.

Both kernels give every row of the activation matrix the same bits whatever the number of rows
(unlike bf16/fp32 `F.linear`), which is what lets a K+1-token verification pass reproduce
one-token decoding exactly; see `DecoderModel.batch_invariant`.

Each layer has `ref_forward`: dequantise to fp32 and `F.linear` in fp32 (the reference the fused
kernels are tested against); `reference_mode(model)` switches a whole model to it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("ssd.quant")

QUANT_MODES = ("int8", "int4", "w4a8", "w8a8", "w4a8-all", "w4a8-g64")
BLOCK_MODES = ("w4a8", "w8a8", "w4a8-all", "w4a8-g64")  # int8 activations, ssd.kernels.cpu (see blockquant.py)
# "w4a8-all": every layer in q4 tiles, the output layer too, whatever bits a GGUF file gives it (a draft that
# streams fewer bytes: on CPU a draft's forwards and the target's share one memory path). "w4a8-g64": the
# same with one scale and offset per 64 weights (W4G64A8Linear; layers whose inputs are not a multiple of 64
# stay per 32), every layer rounded to nearest: ~10 % fewer bytes again.
Q4_MODES = ("w4a8", "w4a8-all")  # the modes that keep a GGUF file's Q4_K codes (scales per 32)
DEFAULT_HEAD = {"int8": "int8", "int4": "int8", "w4a8": "w8a8", "w8a8": "w8a8", "w4a8-all": "w4a8-all",
                "w4a8-g64": "w4a8-g64"}
INT4_GROUP = 32
_ROWS = 512  # rows per block when quantising


# -- int4 packing ---------------------------------------------------------------------------------


def _int4_block_n() -> int:
    # The CPU kernel packs N in blocks of 4 float vectors: 64 columns with AVX512, 32 otherwise.
    return 64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32


def pack_int4(codes: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """[N, K] integer codes in 0..15 -> the packed layout `Int4Linear`'s kernel reads on `device`.

    CPU: `torch._convert_weight_to_int4pack_for_cpu` (specific to the CPU capability). CUDA: the
    tensor-core tiles of `torch._convert_weight_to_int4pack`, from bytes holding two codes each
    (even column in the high nibble).
    """
    device = torch.device(device)
    if device.type == "cuda":
        c = codes.to(device=device, dtype=torch.uint8)
        k = c.shape[1]
        tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
        return torch._convert_weight_to_int4pack(((c[:, ::2] << 4) | c[:, 1::2]).contiguous(), tiles)
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def _unpack_int4_cuda(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [N, K] of a CUDA-packed weight, read back through the kernel itself: with scale 1 and
    zero 0 every weight is q - 8, an integer bf16 holds exactly, so x = identity rows returns them."""
    unit = torch.zeros(k // INT4_GROUP, n, 2, dtype=torch.bfloat16, device=packed.device)
    unit[..., 0] = 1.0
    cols = []
    for r0 in range(0, k, 1024):
        eye = torch.zeros(min(1024, k - r0), k, dtype=torch.bfloat16, device=packed.device)
        eye[:, r0 : r0 + eye.shape[0]] = torch.eye(eye.shape[0], dtype=torch.bfloat16, device=packed.device)
        cols.append(torch._weight_int4pack_mm(eye, packed, INT4_GROUP, unit))  # [chunk, N] = (q - 8).T
    return (torch.cat(cols).T.float() + 8.0).to(torch.uint8).cpu()


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_int4` (uint8 [N, K] codes on the CPU); the CPU layout follows
    aten/native/cpu/int4mm_kernel.cpp."""
    if packed.device.type == "cuda":
        return _unpack_int4_cuda(packed, n, k)
    bn = _int4_block_n()
    cap = torch.backends.cpu.get_cpu_capability()
    flat = packed.reshape(-1)
    out = torch.empty(n, k, dtype=torch.uint8)
    full = n // bn * bn if cap.startswith(("AVX512", "AVX2")) else 0
    if full:  # whole blocks of bn columns, all at once: [blocks, K, bn/2] bytes
        blk = flat[: full * k // 2].view(full // bn, k, bn // 2)
        lo, hi = blk & 0x0F, blk >> 4
        if cap.startswith("AVX512"):  # byte d: n=d | n=d+32 ; byte 16+d: n=d+16 | n=d+48
            cols = torch.cat([lo[..., :16], lo[..., 16:], hi[..., :16], hi[..., 16:]], dim=-1)
        else:  # AVX2, byte d: n=d | n=d+16
            cols = torch.cat([lo, hi], dim=-1)
        out[:full] = cols.transpose(1, 2).reshape(full, k)
    for n0 in range(full, n, bn):  # a partial last block (or no vector ISA): pairs, n=2j | n=2j+1
        nb = min(bn, n - n0)
        blk = flat[n0 * k // 2 : (n0 + nb) * k // 2].view(k, nb // 2)
        out[n0 : n0 + nb] = torch.stack([blk & 0x0F, blk >> 4], dim=2).reshape(k, nb).T
    return out


# -- layers ---------------------------------------------------------------------------------------


class _QuantLinear(nn.Module):
    in_features: int
    out_features: int
    use_reference = False  # set per instance by `reference_mode`
    _ref_weight: torch.Tensor | None = None  # dequantised weight cached by `reference_mode`

    def dequantize(self) -> torch.Tensor:  # fp32 [N, K]
        raise NotImplementedError

    def ref_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reference: dequantise to fp32, F.linear in fp32, round to the activation dtype."""
        b = None if self.bias is None else self.bias.float()
        w = self._ref_weight if self._ref_weight is not None else self.dequantize()
        return F.linear(x.float(), w, b).to(x.dtype)

    def _kernel_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] as the contiguous fp32/bf16 [M, K] matrix the C kernels take."""
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if x2.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{type(self).__name__}: activations must be fp32 or bf16, got {x2.dtype}")
        return x2

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        has_bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}"


class Int8Linear(_QuantLinear):
    """y = x @ (q * scale[:, None]).T (+ bias); q int8 [N, K], scale [N] in the activation dtype."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(scales.dtype).contiguous())

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> Int8Linear:
        """Round-to-nearest, symmetric, one scale per output row (absmax / 127)."""
        dtype = dtype or weight.dtype
        weight = weight.detach()
        n = weight.shape[0]
        q = torch.empty(weight.shape, dtype=torch.int8)
        scale = torch.empty(n, dtype=dtype)
        for r in range(0, n, _ROWS):  # row blocks: fp32 temporaries stay in cache
            w = weight[r : r + _ROWS].to(torch.float32, copy=True)
            s = (torch.maximum(w.amax(dim=1), -w.amin(dim=1)) / 127.0).to(dtype)
            s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero rows
            q[r : r + _ROWS] = w.div_(s.float()[:, None]).round_().clamp_(-127, 127)
            scale[r : r + _ROWS] = s
        return cls(q, scale, None if bias is None else bias.detach())

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reference:
            return self.ref_forward(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(_QuantLinear):
    """Groupwise affine int4: w[n, k] = (q - 8) * scale[g, n] + zero[g, n], g = k // group_size.

    Buffers: `qweight` (packed codes in the layout of the device's kernel, see `pack_int4`: on the
    CPU specific to this machine's capability, so `.to()` cannot move it; `on(device)` repacks) and
    `scales_and_zeros` [K / group, N, 2] in the activation dtype (the kernel requires it to match).
    On CUDA the kernel is `torch._weight_int4pack_mm` (bf16 activations, sm80+).
    """

    def __init__(
        self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
        in_features: int, group_size: int = INT4_GROUP,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = scales_and_zeros.shape[1]
        self.group_size = group_size
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(scales_and_zeros.dtype).contiguous())

    @staticmethod
    def supports(out_features: int, in_features: int, group_size: int = INT4_GROUP) -> bool:
        return in_features % group_size == 0 and out_features % 16 == 0

    @classmethod
    def from_affine(
        cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None,
        dtype: torch.dtype, group_size: int = INT4_GROUP,
    ) -> Int4Linear:
        """From codes [N, K] in 0..15 and per-group scale/offset [N, K/group] with w = scale * q + offset.

        Only scale and zero (= offset + 8 * scale, formed in fp32) are rounded, to `dtype`; the codes
        are kept as given.
        """
        n, k = codes.shape
        scale32, offset32 = scale.float(), offset.float()
        zero = offset32 + 8.0 * scale32
        sz = torch.stack([scale32.T, zero.T], dim=-1).to(dtype)  # [K/g, N, 2]
        return cls(pack_int4(codes), sz, bias, k, group_size)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None,
        group_size: int = INT4_GROUP,
    ) -> Int4Linear:
        """Round-to-nearest affine: per group, scale = (max - min) / 15 and zero = min + 8 * scale.

        Codes are chosen against the scale and zero as stored (rounded to `dtype`).
        """
        dtype = dtype or weight.dtype
        weight = weight.detach()
        n, k = weight.shape
        codes = torch.empty(n, k, dtype=torch.int32)
        sz = torch.empty(k // group_size, n, 2, dtype=dtype)
        for r in range(0, n, _ROWS):  # row blocks: fp32 temporaries stay in cache
            g = weight[r : r + _ROWS].to(torch.float32, copy=True).view(-1, k // group_size, group_size)
            mn, mx = g.amin(dim=-1), g.amax(dim=-1)
            scale = ((mx - mn) / 15.0).to(dtype)
            scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-6))  # constant groups
            zero = (mn + 8.0 * scale.float()).to(dtype)
            g.sub_(zero.float()[..., None]).div_(scale.float()[..., None]).add_(8.0).round_().clamp_(0, 15)
            codes[r : r + _ROWS] = g.view(-1, k)
            sz[:, r : r + _ROWS, 0] = scale.T
            sz[:, r : r + _ROWS, 1] = zero.T
        return cls(pack_int4(codes), sz, None if bias is None else bias.detach(), k, group_size)

    def on(self, device: str | torch.device) -> Int4Linear:
        """This layer on `device`, its codes repacked for that device's kernel."""
        device = torch.device(device)
        if device.type == self.qweight.device.type:
            return self.to(device)
        codes = self.codes()
        return Int4Linear(pack_int4(codes, device), self.scales_and_zeros.to(device),
                          None if self.bias is None else self.bias.to(device), self.in_features, self.group_size)

    def codes(self) -> torch.Tensor:
        return unpack_int4(self.qweight, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        q = self.codes().to(self.scales_and_zeros.device).float().view(self.out_features, -1, self.group_size)
        scale = self.scales_and_zeros[..., 0].float().T[..., None]  # [N, K/g, 1]
        zero = self.scales_and_zeros[..., 1].float().T[..., None]
        return ((q - 8.0) * scale + zero).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reference:
            return self.ref_forward(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if x2.device != self.qweight.device:
            raise ValueError(f"Int4Linear packed for {self.qweight.device} got input on {x2.device}; use .on(device)")
        if x2.device.type == "cuda":
            y = torch._weight_int4pack_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)


# -- GGUF Q4_K, Q5_0 ------------------------------------------------------------------------------


def q4k_to_affine(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw GGUF Q4_K bytes (uint8, n * k / 256 blocks of 144) -> codes [n, k] uint8, scale, offset [n, k/32].

    A Q4_K super-block of 256 weights holds fp16 d, dmin, 12 bytes of packed 6-bit (sc, m) for 8
    sub-blocks of 32, and 128 bytes of nibbles; weight = d * sc * q - dmin * m (as in
    gguf.quants.Q4_K.dequantize_blocks). scale = d * sc and offset = -dmin * m are exact in fp32.
    """
    b = blocks.view(torch.uint8).reshape(-1, 144)
    nb = b.shape[0]
    if nb * 256 != n * k:
        raise ValueError(f"Q4_K data holds {nb * 256} weights, expected {n}x{k}")
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # [nb, 1]
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    s = b[:, 4:16].to(torch.int32).view(nb, 3, 4)
    s_d, s_m, s_md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([s_d & 0x3F, (s_md & 0x0F) | ((s_d >> 2) & 0x30)], dim=1)  # [nb, 8]
    mn = torch.cat([s_m & 0x3F, (s_md >> 4) | ((s_m >> 2) & 0x30)], dim=1)
    qs = b[:, 16:].view(nb, 4, 32)  # 4 chunks of 32 bytes: low nibbles = sub-block 2j, high = 2j+1
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, k)
    scale = (d * sc.float()).reshape(n, k // 32)
    offset = (-(dmin * mn.float())).reshape(n, k // 32)
    return codes, scale, offset


def q5_0_codes(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF Q5_0 bytes (n * k / 32 blocks of 22) -> codes [n, k] uint8 (0..31), scale fp16 [n, k/32].

    A Q5_0 block holds fp16 d, 32 high bits (uint32, bit j for weight j) and 16 bytes of nibbles
    (low nibble: weight j, high nibble: weight j + 16); weight = d * (q - 16), as in
    gguf.quants.Q5_0.dequantize_blocks.
    """
    b = blocks.view(torch.uint8).reshape(-1, 22)
    if b.shape[0] * 32 != n * k:
        raise ValueError(f"Q5_0 data holds {b.shape[0] * 32} weights, expected {n}x{k}")
    scale = b[:, 0:2].contiguous().view(torch.float16).reshape(n, k // 32)
    qh = b[:, 2:6].contiguous().view(torch.int32)  # [blocks, 1], little-endian
    high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)  # [blocks, 32]
    qs = b[:, 6:22]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1) | (high << 4)
    return codes.reshape(n, k), scale


def q8_0_codes(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF Q8_0 bytes (n * k / 32 blocks of 34: fp16 d, then 32 int8 codes) -> codes [n, k] int8,
    scale fp16 [n, k/32]; weight = d * q, as in gguf.quants.Q8_0.dequantize_blocks: W8A8Linear's own format."""
    b = blocks.view(torch.uint8).reshape(-1, 34)
    if b.shape[0] * 32 != n * k:
        raise ValueError(f"Q8_0 data holds {b.shape[0] * 32} weights, expected {n}x{k}")
    scale = b[:, 0:2].contiguous().view(torch.float16).reshape(n, k // 32)
    return b[:, 2:34].contiguous().view(torch.int8).reshape(n, k), scale


def q6k_codes(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF Q6_K bytes (n * k / 256 blocks of 210) -> codes [n, k] uint8 (0..63), scale fp16 [n, k/16].

    A Q6_K super-block of 256 weights holds 128 bytes of low nibbles (ql), 64 bytes of 2-bit high
    parts (qh), 16 int8 scales (one per 16 weights) and fp16 d; weight = d * sc * (q - 32), as in
    gguf.quants.Q6_K.dequantize_blocks. Per half of 128 weights, weight 32i + l (i = 0..3, l =
    0..31) takes the low or high nibble (i >= 2) of ql[l + 32 (i % 2)] and bits 2i, 2i + 1 of qh[l].
    scale = d * sc is exact in fp32 and rounded to fp16 here.
    """
    b = blocks.view(torch.uint8).reshape(-1, 210)
    if b.shape[0] * 256 != n * k:
        raise ValueError(f"Q6_K data holds {b.shape[0] * 256} weights, expected {n}x{k}")
    ql = b[:, :128].reshape(-1, 2, 2, 32)  # [blocks, half, i % 2, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [blocks, half, 1, l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [blocks, half, i, l]
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)) & 3
    codes = (low | (high << 4)).reshape(n, k)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # [blocks, 16]
    d = b[:, 208:210].contiguous().view(torch.float16).float()  # [blocks, 1]
    return codes, (d * sc).half().reshape(n, k // 16)


# -- whole models ---------------------------------------------------------------------------------


def _rel_err(w: torch.Tensor, mod: _QuantLinear) -> float:
    w = w.float()
    return float(torch.linalg.norm(w - mod.dequantize()) / torch.linalg.norm(w).clamp_min(1e-30))


def cuda_kernel_available(mode: str) -> bool:
    """Whether this torch build has a CUDA kernel for the layer `mode` uses (with this API)."""
    op = {"int8": "aten::_weight_int8pack_mm", "int4": "aten::_weight_int4pack_mm"}.get(mode)
    if op is None:  # w4a8 / w8a8: AVX2 kernels only
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"))
    except RuntimeError:
        return False


def make_quant_linear(
    mode: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> _QuantLinear:
    """Round-to-nearest layer of kind `mode`; shapes a kernel cannot take become Int8Linear."""
    if mode in BLOCK_MODES:
        from ssd.workers.models.blockquant import W4A8Linear, W4G64A8Linear, W8A8Linear, require_kernel

        require_kernel()
        if mode == "w4a8-g64" and weight.shape[1] % W4G64A8Linear.SUB == 0:
            return W4G64A8Linear.from_float(weight, bias, dtype)
        if weight.shape[1] % W4A8Linear.block == 0:
            layer = W8A8Linear if mode == "w8a8" else W4A8Linear
            return layer.from_float(weight, bias, dtype)
    if mode == "int4" and Int4Linear.supports(*weight.shape):
        return Int4Linear.from_float(weight, bias, dtype)
    return Int8Linear.from_float(weight, bias, dtype)  # int8, or int4 shapes the kernel cannot take


# A GGUF file's own codes, kept as they are: the block layer that holds each kind, and the modes that keep them.
_FILE_CODE_MODES = {"q5": ("w4a8",), "q6": ("w4a8", "w8a8"), "q8": ("w4a8", "w8a8")}


def _file_codes_layer(kind: str, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      dtype: torch.dtype) -> _QuantLinear:
    from ssd.workers.models.blockquant import W5A8Linear, W6A8Linear, W8A8Linear

    build = {"q5": W5A8Linear.from_q5, "q6": W6A8Linear, "q8": W8A8Linear}[kind]
    return build(codes, scale, bias, dtype)


def quantize_model(
    model: nn.Module,
    mode: str | None,
    *,
    skip: tuple[str, ...] = (),
    head: str | None = "default",
    overrides: dict[str, str] | None = None,
    affine_int4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    q5: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    q6: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    q8: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    fuse: bool = True,
) -> nn.Module:
    """Replace the model's nn.Linear layers in place by Int8Linear / Int4Linear (round to nearest).

    mode: None (no-op), "int8", "int4" (weight-only, torch kernels), "w4a8", "w8a8", "w4a8-all" or "w4a8-g64"
    (int8 activations, blockquant.py; "w4a8-all" puts the head in q4 too and takes no q5 / q6 codes;
    "w4a8-g64" rounds every layer to q4 with a scale and offset per 64 weights).
    `skip`: module-name suffixes left in floating point.
    `head`: how to quantise `lm_head` ("default": int8 for the weight-only modes, w8a8 for the
    block modes; the head is a quarter of the 0.5B model's weights and the single largest matmul
    of a decode step, so it keeps 8 bits; None keeps it floating point, which also gives up batch
    invariance). `overrides`: {module name: mode} for particular layers.
    `affine_int4`: {module name: (codes [N, K] 0..15, scale, offset [N, K/32])} used as they are
    (w = scale * q + offset, e.g. GGUF Q4_K) instead of rounding the float weights. `q5`: {module
    name: (codes [N, K] 0..31, scale [N, K/32])}, w = scale * (q - 16) (GGUF Q5_0), kept exactly as
    W5A8Linear where the layer's mode is "w4a8". `q6`: likewise {module name: (codes [N, K] 0..63,
    scale [N, K/16])}, w = scale * (q - 32) (GGUF Q6_K), kept as W6A8Linear where the layer's mode
    is "w4a8" or "w8a8". `q8`: {module name: (codes [N, K] int8, scale fp16 [N, K/32])}, w = scale * q
    (GGUF Q8_0), kept as W8A8Linear where the layer's mode is "w4a8" or "w8a8". `fuse`: merge
    q/k/v and gate/up into one layer each where they end up the same kind (fuse_projections).
    Sets `model.batch_invariant` when every linear ends up quantised. Per-layer relative Frobenius
    errors are logged at DEBUG. On CUDA, when this torch lacks a kernel the model stays in floating
    point, with a warning.
    """
    if mode is None:
        return model
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; use None or one of {', '.join(QUANT_MODES)}")
    overrides, affine_int4, q5, q6, q8 = overrides or {}, affine_int4 or {}, q5 or {}, q6 or {}, q8 or {}
    if head == "default":
        head = DEFAULT_HEAD[mode]
    done = getattr(model, "quantization", None)
    if done is not None and done != mode:
        raise ValueError(f"this model is already quantised ({done!r}); quantise its floating-point weights to {mode!r}")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return model
    device = linears[0][1].weight.device
    dtype = linears[0][1].weight.dtype

    def layer_mode(name: str) -> str | None:
        if any(name.endswith(s) for s in skip):
            return None
        if name in overrides:
            return overrides[name]
        return head if name.rpartition(".")[2] == "lm_head" else mode

    if mode in BLOCK_MODES and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization={mode!r} takes a float32 or bfloat16 model, not {dtype}")
    if device.type != "cpu" and mode in BLOCK_MODES:
        raise ValueError(f"quantization={mode!r} runs on CPU only (AVX2 kernel); use int8/int4 on {device}")
    used = {layer_mode(name) for name, _ in linears} - {None}
    if device.type == "cuda":
        missing = sorted(used - {m for m in QUANT_MODES if cuda_kernel_available(m)})
        if missing:
            log.warning(
                "quantization=%r: this torch (%s) has no CUDA kernel for weight-only %s matmul; "
                "keeping the %s weights", mode, torch.__version__, "/".join(missing), dtype,
            )
            return model
        if "int4" in used and dtype != torch.bfloat16:
            raise ValueError(f"int4 on CUDA runs torch._weight_int4pack_mm, which takes bfloat16, not {dtype}")
    elif device.type != "cpu":
        raise ValueError(f"quantization runs on cpu (or cuda where kernels exist), not on {device}")

    debug = log.isEnabledFor(logging.DEBUG)
    all_quantised = True
    for name, lin in linears:
        lmode = layer_mode(name)
        if lmode is None:
            all_quantised = False
            continue
        if lmode not in QUANT_MODES:
            raise ValueError(f"unknown quantization {lmode!r} for layer {name}")
        weight = lin.weight.detach().to("cpu")
        if lmode in ("int4", *Q4_MODES) and name in affine_int4:
            codes, scale, offset = affine_int4[name]
            if tuple(codes.shape) != tuple(weight.shape):
                raise ValueError(f"{name}: int4 codes {tuple(codes.shape)}, weight {tuple(weight.shape)}")
            if lmode == "int4":
                q: _QuantLinear = Int4Linear.from_affine(codes, scale, offset, lin.bias, dtype)
            else:
                from ssd.workers.models.blockquant import W4A8Linear

                q = W4A8Linear.from_affine(codes, scale, offset, lin.bias, dtype)
        elif (kind := next((kind for kind, table in (("q5", q5), ("q6", q6), ("q8", q8))
                            if name in table and lmode in _FILE_CODE_MODES[kind]), None)) is not None:
            codes, scale = {"q5": q5, "q6": q6, "q8": q8}[kind][name]
            if tuple(codes.shape) != tuple(weight.shape):
                raise ValueError(f"{name}: {kind} codes {tuple(codes.shape)}, weight {tuple(weight.shape)}")
            q = _file_codes_layer(kind, codes, scale, lin.bias, dtype)
        else:
            q = make_quant_linear(lmode, weight, lin.bias, dtype)
        if debug:  # against the loaded weights: for a file's own codes, their rounding to the load dtype
            log.debug("%s %s -> %s, relative error vs the %s weights %.3e", name, tuple(weight.shape),
                      type(q).__name__, str(weight.dtype).removeprefix("torch."), _rel_err(weight, q))
        q = q.on(device) if isinstance(q, Int4Linear) else q.to(device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
    if fuse:
        fuse_projections(model)
    if mode in BLOCK_MODES:
        for m in model.modules():
            if hasattr(m, "use_cpu_kernel"):
                m.use_cpu_kernel = True  # RMSNorm: the C kernel too
    if hasattr(model, "batch_invariant"):  # the CPU kernels are row-independent; CUDA's are not known to be
        model.batch_invariant = all_quantised and device.type == "cpu"
    model.quantization = mode
    return model


def _concat(mods: list[_QuantLinear]) -> _QuantLinear | None:
    """One layer computing the given layers' outputs side by side (same input), or None if they differ in kind."""
    first = mods[0]
    from ssd.workers.models.blockquant import _BlockLinear, concat_block_linears
    from ssd.workers.models.dense import DenseLinear, concat_dense

    if isinstance(first, _BlockLinear):
        return concat_block_linears(mods)  # type: ignore[arg-type]
    if isinstance(first, DenseLinear):
        return concat_dense(mods)  # type: ignore[arg-type]
    same = all(type(m) is type(first) and m.in_features == first.in_features for m in mods)
    if isinstance(first, Int4Linear):
        same = same and all(m.group_size == first.group_size for m in mods)  # type: ignore[attr-defined]
    if not same:
        return None
    dtype = (first.scales if isinstance(first, Int8Linear) else first.scales_and_zeros).dtype
    bias = None
    if any(m.bias is not None for m in mods):
        dev = first.qweight.device
        bias = torch.cat([
            m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=dtype, device=dev) for m in mods
        ])
    if isinstance(first, Int8Linear):
        return Int8Linear(torch.cat([m.qweight for m in mods]), torch.cat([m.scales for m in mods]), bias)
    assert isinstance(first, Int4Linear)
    bn = _int4_block_n()  # >= 8 columns, CUDA's tile: whole blocks on either device
    if all(m.out_features % bn == 0 for m in mods):  # packed rows are whole column blocks: concatenate
        packed = torch.cat([m.qweight for m in mods])
    else:
        packed = pack_int4(torch.cat([m.codes() for m in mods]), first.qweight.device)
    sz = torch.cat([m.scales_and_zeros for m in mods], dim=1)
    return Int4Linear(packed, sz, bias, first.in_features, first.group_size)


def fuse_projections(model: nn.Module) -> int:
    """Replace q/k/v_proj by `qkv_proj` and gate/up_proj by `gate_up_proj` where they are quantised alike.

    Fewer, larger matmuls per decode step (3 + 2 -> 1 + 1 per layer); every output column is
    computed exactly as before, so batch invariance is unaffected. Returns the number of fusions.
    """
    fused = 0
    for mod in model.modules():
        for names, attr in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            parts = [getattr(mod, nm, None) for nm in names]
            if not hasattr(mod, attr) or not all(isinstance(p, _QuantLinear) for p in parts):
                continue
            one = _concat(parts)  # type: ignore[arg-type]
            if one is None:
                continue
            setattr(mod, attr, one)
            for nm in names:
                setattr(mod, nm, None)
            fused += 1
    return fused


@contextlib.contextmanager
def reference_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run every quantised layer through `ref_forward` (fp32 dequantise + F.linear) inside the block."""
    mods = [m for m in model.modules() if isinstance(m, _QuantLinear)]
    for m in mods:
        m.use_reference = True
        m._ref_weight = m.dequantize()
    try:
        yield model
    finally:
        for m in mods:
            m.use_reference = False
            m._ref_weight = None
