"""Block-quantised linears with int8 activations (W4A8 / W8A8), run by ``ssd.kernels.cpu`` (AVX2).

* `W4A8Linear`: w = scale * q + offset per block of 32 inputs, q in 0..15, fp16 scale and offset
  (5 bits per weight; a GGUF Q4_K sub-block keeps its codes, only d*sc and -dmin*m are rounded to
  fp16).
* `W4G64A8Linear`: the same with one scale and offset per 64 inputs (4.5 bits per weight), rounded
  to nearest: a draft's format, where bytes per forward count more than the last bit of fidelity.
* `W8A8Linear`: w = scale * q per block of 32, q in -127..127, fp16 scale (8.5 bits per weight),
  stored as q + 128 in tiles.
* `W5A8Linear`: w = scale * (q - 16) per block of 32, q in 0..31, fp16 scale: GGUF Q5_0 exactly,
  at 5.5 bits per weight.
* `W6A8Linear`: w = scale * (q - 32) per 16 weights, q in 0..63, fp16 scale: GGUF Q6_K up to the
  fp16 rounding of d * sc, at 7 bits per weight.

All five interleave 8 weight rows (tiles), so one multiply-add covers all of them.

Activations are quantised per row and block of 32 to int8 (dx = absmax / 127) inside the kernel,
as llama.cpp does for its Q4/Q8 dot products, so every block product is an exact integer sum. That
activation rounding is part of the model: the quantised model is the target that speculative
decoding reproduces. Every output row gets the same bits whatever the number of rows (see
qgemm.cpp), so these layers are batch invariant like the int8/int4 weight-only ones.

`ref_forward` is the slow reference: quantise the activations with `ref_quantize_rows`, dequantise
both sides, fp32 `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ssd.kernels import cpu as qk
from ssd.workers.models.quant import _ROWS, _QuantLinear

QK = qk.QK


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous()


def require_kernel() -> None:
    """Raise with the reason when the AVX2 kernel cannot run here (never fall back silently)."""
    reason = qk.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"quantization w4a8/w8a8 needs the block-quantised CPU kernel: {reason}")


def _nudge_fp16(h: torch.Tensor, ok: torch.Tensor, up: bool) -> torch.Tensor:
    """fp16 values `h`, moved one fp16 step up (or down) where `ok` is False.

    Rounding a bound to fp16 can land on the wrong side of it; one step fixes that. Matters for
    tiny blocks, where fp16 scales are subnormal and coarse.
    """
    step = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(ok, h, torch.nextafter(h, step))


def _round_symmetric(weight: torch.Tensor, qmax: int, block: int = QK) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest per block: scale = absmax / qmax rounded up to fp16 (so no code clamps),
    q = round(w / scale) in -qmax..qmax (int8 [N, K]); + scale fp16 [N, K/block]."""
    weight = weight.detach()
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, k // block, dtype=torch.float16)
    for r in range(0, n, _ROWS):  # row blocks: fp32 temporaries stay in cache
        g = weight[r : r + _ROWS].to(torch.float32, copy=True).view(-1, k // block, block)
        amax = g.abs().amax(dim=-1)
        s = (amax / qmax).half()
        s = _nudge_fp16(s, qmax * s.float() >= amax, up=True)
        s_safe = torch.where(s > 0, s.float(), torch.ones_like(s, dtype=torch.float32))
        q[r : r + _ROWS] = g.div_(s_safe[..., None]).round_().clamp_(-qmax, qmax).view(-1, k).to(torch.int8)
        scale[r : r + _ROWS] = s
    return q, scale


class _BlockLinear(_QuantLinear):
    block = QK
    qweight: torch.Tensor
    # fp16 scales (and offsets) are stored as their int16 bits: `model.to(dtype)` casts every
    # floating-point buffer, which would reinterpret what the kernel reads.
    scale_bits: torch.Tensor  # int16 [N, K/32]

    @property
    def scale(self) -> torch.Tensor:  # fp16 [N, K/32]
        return self.scale_bits.view(torch.float16)

    def _setup(self, n: int, k: int, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        require_kernel()
        qk.check_shape(k)
        self.out_features, self.in_features = n, k
        # Bias in the activation dtype, added after the kernel (as the other quantised layers do).
        self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype).contiguous())

    def ref_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        xq, dx, _ = qk.ref_quantize_rows(x2)
        x_deq = (xq.float().view(x2.shape[0], -1, QK) * dx[..., None]).view_as(x2)
        w = self._ref_weight if self._ref_weight is not None else self.dequantize()
        y = F.linear(x_deq, w).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reference:
            return self.ref_forward(x)
        y = self._kernel(self._kernel_rows(x))
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class _TiledLinear(_BlockLinear):
    """Codes in tiles of 8 rows (N zero-padded to whole tiles): `qweight` uint8 [tiles, K/32 * (128 + 32 HIGH_BITS)],
    `scale_bits` int16 [tiles, S, 8] (S scales per row; a scale's 8 rows side by side), as qgemm.cpp
    reads them.

    Per tile and block: 128 bytes of nibbles in 4 chunks of 32; chunk c holds for row r at bytes
    4r + j (j = 0..3) q[r][8c + j] | q[r][8c + 4 + j] << 4, so an unpacked chunk is two vectors:
    v = 2c (the low nibbles) and v = 2c + 1 (the high ones). Codes wider than 4 bits add HIGH_BITS
    planes of 32 bytes: bits b (v % vpp) .. of byte i of plane v // vpp (vpp = 8 / b vectors per
    plane) are the high bits of byte i of unpacked vector v.
    """

    TILE = 8  # weight rows interleaved so one multiply-add covers all of them (qgemm.cpp)
    FMT = ""
    HIGH_BITS = 0  # code bits above the nibble
    SUB = QK  # weights per scale

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
        act_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """codes [N, K] in 0..2^(4 + HIGH_BITS) - 1 (W8A8Linear: signed, int8), scale [N, K/SUB]."""
        super().__init__()
        self._check_codes(codes)
        if scale.shape != (codes.shape[0], codes.shape[1] // self.SUB):
            raise ValueError(f"{self.FMT} scales {tuple(scale.shape)} do not fit codes {tuple(codes.shape)}: "
                             f"one per {self.SUB}")
        n, k = codes.shape
        self._setup(n, k, bias, act_dtype)
        self.register_buffer("qweight", self.pack(codes))
        self.register_buffer("scale_bits", self._tiled(_fp16(scale)).view(torch.int16))

    @classmethod
    def _check_codes(cls, codes: torch.Tensor) -> None:
        code_max = (16 << cls.HIGH_BITS) - 1
        if codes.numel() and int(codes.max()) > code_max:
            raise ValueError(f"{cls.FMT} codes must lie in 0..{code_max}")

    @classmethod
    def from_packed(
        cls, n: int, k: int, qweight: torch.Tensor, scale_bits: torch.Tensor, bias: torch.Tensor | None,
        act_dtype: torch.dtype, **more_bits: torch.Tensor,
    ) -> _TiledLinear:
        """A layer of N x K from buffers already in its layout (`pack`, `_tiled`; q4 also `offset_bits`)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(n, k, bias, act_dtype)
        for name, t in {"qweight": qweight, "scale_bits": scale_bits, **more_bits}.items():
            layer.register_buffer(name, t)
        return layer

    @classmethod
    def _tiled(cls, t: torch.Tensor) -> torch.Tensor:
        """[N, S] -> [tiles, S, 8]: rows zero-padded to whole tiles, a tile's 8 rows side by side."""
        n, per_row = t.shape
        padded = torch.zeros(-(-n // cls.TILE) * cls.TILE, per_row, dtype=t.dtype)
        padded[:n] = t
        return padded.view(-1, cls.TILE, per_row).transpose(1, 2).contiguous()

    def _untiled(self, bits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[tiles, S, 8] int16 -> fp16 [N, S], or only `rows` [R, S]."""
        if rows is not None:
            return bits[rows // self.TILE, :, rows % self.TILE].view(torch.float16)
        return bits.view(torch.float16).transpose(1, 2).reshape(-1, bits.shape[1])[: self.out_features]

    def scale_of(self, rows: torch.Tensor) -> torch.Tensor:  # fp16 [R, S]: `scale[rows]` without untiling all
        return self._untiled(self.scale_bits, rows)

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """codes [N, K], unpacked from `qweight`; or only `rows` [R, K], unpacking just their tiles (a
        restricted output layer takes ~33k rows of 152k)."""
        if rows is None:
            return self._unpack(self.qweight)[: self.out_features]
        tiles, at = torch.unique(rows // self.TILE, return_inverse=True)
        return self._unpack(self.qweight[tiles]).view(len(tiles), self.TILE, -1)[at, rows % self.TILE]

    @property
    def scale(self) -> torch.Tensor:  # fp16 [N, K/32] (q6: [N, K/16])
        return self._untiled(self.scale_bits)

    @classmethod
    def block_bytes(cls) -> int:
        return 4 * QK + QK * cls.HIGH_BITS

    @classmethod
    def pack(cls, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, K] -> [tiles, K/32 * block_bytes()]: per block the nibbles, then the planes."""
        n, k = codes.shape
        c = torch.zeros(-(-n // cls.TILE) * cls.TILE, k, dtype=torch.uint8)
        c[:n] = codes
        # A row's codes 8c + j and 8c + 4 + j (j = 0..3) move as two int32 words: permuting words, not bytes,
        # copies 4x fewer elements (loading the 1.5B packed its weights in ~14 s byte by byte).
        words = c.view(torch.int32).view(-1, cls.TILE, k // QK, 4, 2)  # [tile, row, block, chunk, nibble]
        vec = words.permute(0, 2, 3, 4, 1).contiguous().view(torch.uint8)  # [tile, block, chunk, nibble, row | j]
        vec = vec.view(-1, k // QK, 8, QK)  # [tile, block, v = 2 chunk + nibble, 32]
        low = vec & 0x0F
        parts = [(low[:, :, 0::2] | (low[:, :, 1::2] << 4)).flatten(2)]  # chunk c: v = 2c | v = 2c + 1 << 4
        bits = cls.HIGH_BITS
        if bits:
            vpp = 8 // bits
            high = (vec >> 4).view(vec.shape[0], k // QK, bits, vpp, QK)  # vector v = plane * vpp + i
            planes = high[:, :, :, 0].clone()
            for i in range(1, vpp):
                planes |= high[:, :, :, i] << (bits * i)
            parts.append(planes.flatten(2))
        return torch.cat(parts, dim=2).reshape(-1, k // QK * cls.block_bytes()).contiguous()

    def _unpack(self, qweight: torch.Tensor) -> torch.Tensor:
        """Tiles of `pack`'s layout -> codes [8 tiles, K]."""
        k = self.in_features
        g = qweight.view(-1, k // QK, self.block_bytes())
        b = g[:, :, : 4 * QK].reshape(g.shape[0], g.shape[1], 4, 1, QK)
        vec = torch.cat([b & 0x0F, b >> 4], dim=3).reshape(g.shape[0], g.shape[1], 8, QK)  # [tile, block, v, 32]
        bits = self.HIGH_BITS
        if bits:
            vpp = 8 // bits
            planes = g[:, :, 4 * QK :].to(torch.int32).view(g.shape[0], g.shape[1], bits, 1, QK)
            shift = (bits * torch.arange(vpp, dtype=torch.int32))[:, None]
            high = ((planes >> shift) & ((1 << bits) - 1)).view(g.shape[0], g.shape[1], 8, QK) << 4
            vec = vec | high.to(torch.uint8)
        c = vec.view(-1, k // QK, 4, 2, self.TILE, 4)  # [tile, block, chunk, nibble, row, j]
        return c.permute(0, 4, 1, 2, 3, 5).reshape(-1, k)

    def _kernel_offset(self) -> torch.Tensor | None:
        return None  # only q4 has offsets

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return qk.linear(x2, self.qweight, self.scale_bits.view(torch.float16), self._kernel_offset(), fmt=self.FMT,
                         n=self.out_features)


class W4A8Linear(_TiledLinear):
    """q4 codes (w = scale * q + offset per block of 32) in tiles of 8 rows, fp16 scale and offset
    (`offset_bits` int16 [tiles, K/32, 8], as `scale_bits`)."""

    FMT = "q4"

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None,
        act_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """codes [N, K] in 0..15, scale and offset [N, K/32]; codes kept as given."""
        super().__init__(codes, scale, bias, act_dtype)
        self.register_buffer("offset_bits", self._tiled(_fp16(offset)).view(torch.int16))

    @property
    def offset(self) -> torch.Tensor:  # fp16 [N, K/32]
        return self._untiled(self.offset_bits)

    def offset_of(self, rows: torch.Tensor) -> torch.Tensor:  # fp16 [R, K/32]
        return self._untiled(self.offset_bits, rows)

    def _kernel_offset(self) -> torch.Tensor:
        return self.offset_bits.view(torch.float16)

    @classmethod
    def from_affine(
        cls, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None,
        act_dtype: torch.dtype = torch.bfloat16,
    ) -> W4A8Linear:
        """w = scale * q + offset with codes [N, K] (0..15) and scale/offset [N, K/32]; codes kept as given."""
        return cls(codes, scale, offset, bias, act_dtype)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype | None = None
    ) -> W4A8Linear:
        """Round to nearest per group of SUB weights against the fp16 scale and offset as stored.

        offset = min rounded down and scale = (max - offset) / 15 rounded up (in fp16), so that
        [offset, offset + 15 * scale] covers the group and no code clamps: error <= scale / 2.
        """
        act_dtype = act_dtype or weight.dtype
        weight = weight.detach()
        n, k = weight.shape
        sub = cls.SUB
        if k % sub:
            raise ValueError(f"{cls.FMT}: in_features {k} is not a multiple of {sub}")
        codes = torch.empty(n, k, dtype=torch.uint8)
        scale = torch.empty(n, k // sub, dtype=torch.float16)
        offset = torch.empty(n, k // sub, dtype=torch.float16)
        for r in range(0, n, _ROWS):  # row blocks: fp32 temporaries stay in cache
            g = weight[r : r + _ROWS].to(torch.float32, copy=True).view(-1, k // sub, sub)
            mn, mx = g.amin(dim=-1), g.amax(dim=-1)
            o = mn.half()
            o = _nudge_fp16(o, o.float() <= mn, up=False)
            s = ((mx - o.float()) / 15.0).half()
            s = _nudge_fp16(s, o.float() + 15.0 * s.float() >= mx, up=True)
            s_safe = torch.where(s > 0, s.float(), torch.ones_like(mn))  # constant blocks: every code 0
            g.sub_(o.float()[..., None]).div_(s_safe[..., None]).round_().clamp_(0, 15)
            codes[r : r + _ROWS] = g.view(-1, k).to(torch.uint8)
            scale[r : r + _ROWS], offset[r : r + _ROWS] = s, o
        return cls(codes, scale, offset, bias, act_dtype)

    def dequantize(self) -> torch.Tensor:
        q = self.codes().float().view(self.out_features, -1, self.SUB)
        w = q * self.scale.float()[..., None] + self.offset.float()[..., None]
        return w.view(self.out_features, self.in_features)


class W4G64A8Linear(W4A8Linear):
    """q4 codes in W4A8Linear's tiles with one fp16 scale and offset per 64 weights: `scale_bits` and
    `offset_bits` int16 [tiles, K/64, 8]. The kernel keeps its integer sums and float steps per block of
    32 (each block of a group takes the group's scale and offset), so the output equals, bit for bit, a
    W4A8Linear whose scales and offsets repeat per block (`as_q4`): row independence carries over."""

    FMT = "q4g64"
    SUB = 64

    def _setup(self, n: int, k: int, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        if k % self.SUB:
            raise ValueError(f"q4g64: in_features {k} is not a multiple of {self.SUB}")
        super()._setup(n, k, bias, act_dtype)

    def as_q4(self) -> W4A8Linear:
        """The same weights as a W4A8Linear (every scale and offset given to both blocks of its group)."""
        rep = lambda t: t.repeat_interleave(self.SUB // QK, dim=1)
        act_dtype = self.bias.dtype if self.bias is not None else torch.bfloat16  # the bias's only use
        return W4A8Linear(self.codes(), rep(self.scale), rep(self.offset), self.bias, act_dtype)


class W5A8Linear(_TiledLinear):
    """q5 codes (0..31, w = scale * (q - 16)) in tiles of 8 rows, fp16 scale: per tile and block the
    low 4 bits as W4A8Linear packs them, then 32 bytes of fifth bits (see `pack`)."""

    FMT = "q5"
    HIGH_BITS = 1  # 160 bytes per tile and block: bit v of plane byte i is bit 4 of vector v's byte i

    @classmethod
    def from_q5(
        cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
        act_dtype: torch.dtype = torch.bfloat16,
    ) -> W5A8Linear:
        """w = scale * (q - 16) with codes [N, K] (0..31, as GGUF Q5_0 stores them) and scale [N, K/32]."""
        return cls(codes, scale, bias, act_dtype)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype | None = None
    ) -> W5A8Linear:
        """Round to nearest, symmetric per block: scale = absmax / 15 rounded up to fp16, codes 1..31."""
        q, scale = _round_symmetric(weight, 15)
        return cls.from_q5((q + 16).to(torch.uint8), scale, bias, act_dtype or weight.dtype)

    def dequantize(self) -> torch.Tensor:
        q = self.codes().float().view(self.out_features, -1, QK) - 16.0
        return (q * self.scale.float()[..., None]).view(self.out_features, self.in_features)


class W6A8Linear(_TiledLinear):
    """q6 codes (0..63, w = scale * (q - 32)) with a scale per 16 weights (GGUF Q6_K, up to the fp16
    rounding of d * sc), in tiles of 8 rows: per tile and block the low 4 bits as W4A8Linear packs
    them, then 64 bytes of high bits (see `pack`); `scale_bits` [tiles, K/16, 8]."""

    FMT = "q6"
    HIGH_BITS = 2  # 192 bytes: bits 2(v % 4), +1 of byte i of plane v // 4 are bits 4, 5 of vector v
    SUB = 16

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype | None = None
    ) -> W6A8Linear:
        """Round to nearest, symmetric per 16 weights: scale = absmax / 31 rounded up to fp16, codes 1..63."""
        q, scale = _round_symmetric(weight, 31, cls.SUB)
        return cls((q + 32).to(torch.uint8), scale, bias, act_dtype or weight.dtype)

    def dequantize(self) -> torch.Tensor:
        q = self.codes().float().view(self.out_features, -1, self.SUB) - 32.0
        return (q * self.scale.float()[..., None]).view(self.out_features, self.in_features)


class W8A8Linear(_TiledLinear):
    """int8 codes (w = scale * q, q in -127..127) in tiles of 8 rows as whole bytes q + 128, fp16 scale:
    per tile and block 8 vectors of 32 bytes, vector v holding codes 4v..4v+3 of row r at bytes 4r..4r+3
    (the order in which the q4 kernel reads its unpacked nibbles), 8.5 bits per weight."""

    FMT = "q8"

    @classmethod
    def _check_codes(cls, codes: torch.Tensor) -> None:  # the signed codes, int8 [N, K]
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise ValueError(f"q8 codes must be an int8 [N, K] tensor, got {codes.dtype} {tuple(codes.shape)}")

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, act_dtype: torch.dtype | None = None
    ) -> W8A8Linear:
        """Round to nearest, symmetric per block: scale = absmax / 127 rounded up to fp16 (no code clamps)."""
        q, scale = _round_symmetric(weight, 127)
        return cls(q, scale, bias, act_dtype or weight.dtype)

    @classmethod
    def block_bytes(cls) -> int:
        return 8 * QK

    @classmethod
    def pack(cls, codes: torch.Tensor) -> torch.Tensor:
        """int8 codes [N, K] -> uint8 [tiles, K/32 * 256]: per tile, block and vector v the tile's rows' codes
        4v..4v+3, plus 128. Padding rows hold q = 0."""
        n, k = codes.shape
        u = torch.full((-(-n // cls.TILE) * cls.TILE, k), 128, dtype=torch.uint8)
        u[:n] = (codes.to(torch.int16) + 128).to(torch.uint8)
        words = u.view(torch.int32).view(-1, cls.TILE, k // QK, 8)  # [tile, row, block, v]: codes 4v..4v+3
        return words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(-1, k // QK * cls.block_bytes())

    def _unpack(self, qweight: torch.Tensor) -> torch.Tensor:
        """Tiles of `pack`'s layout -> the signed codes int8 [8 tiles, K]."""
        k = self.in_features
        words = qweight.view(torch.int32).view(-1, k // QK, 8, self.TILE)  # [tile, block, v, row]
        u = words.permute(0, 3, 1, 2).contiguous().view(torch.uint8).view(-1, k)
        return (u.to(torch.int16) - 128).to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        w = self.codes().float().view(self.out_features, -1, QK) * self.scale.float()[..., None]
        return w.view(self.out_features, self.in_features)


def concat_block_linears(mods: list[_BlockLinear]) -> _BlockLinear | None:
    """One layer computing the given layers side by side (rows concatenated), or None if they differ in kind."""
    first = mods[0]
    if not all(type(m) is type(first) and m.in_features == first.in_features for m in mods):
        return None
    dtype = next((m.bias.dtype for m in mods if m.bias is not None), None)
    bias = None
    if dtype is not None:
        bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=dtype) for m in mods])
    cat = lambda name: torch.cat([getattr(m, name) for m in mods])
    if isinstance(first, _TiledLinear) and all(m.out_features % first.TILE == 0 for m in mods[:-1]):
        # Every part but the last fills whole tiles: the packed tiles stack as they are (repacking the
        # 1.5B's fused projections from codes took ~2.8 s of its load).
        more = {"offset_bits": cat("offset_bits")} if isinstance(first, W4A8Linear) else {}  # q4, q4g64
        return type(first).from_packed(sum(m.out_features for m in mods), first.in_features, cat("qweight"),
                                       cat("scale_bits"), bias, dtype or torch.bfloat16, **more)
    if isinstance(first, W4A8Linear):
        codes = torch.cat([m.codes() for m in mods])  # tiles would straddle parts: repack from codes
        return type(first)(codes, cat("scale"), cat("offset"), bias, dtype or torch.bfloat16)
    return type(first)(torch.cat([m.codes() for m in mods]), cat("scale"), bias, dtype or torch.bfloat16)
