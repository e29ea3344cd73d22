"""CPU kernels (``qgemm.cpp``, AVX2; AVX-512 VNNI (+ AMX) or AVX-VNNI where the CPU has them, ``isa``): block-quantised
GEMM (int4 / int5 / int8 weights x int8 activations, per block of 32), a dense GEMM for unquantised fp32/bf16
weights (fp32 accumulation), RMSNorm and token-by-token attention over the KV cache, all row-independent (the
batch-invariant path); and (``decoder_layer.cpp``) SiLU * up and whole decoder layers built from those
kernels in one call.

The C++ sources are compiled on first use with the system ``g++`` into the ssd cache directory
(``$SSD_CACHE_DIR`` or ``~/.cache/ssd``, keyed by a hash of source and flags) and loaded with
ctypes. ``available()`` says whether that works here; ``unavailable_reason()`` says why not
(no AVX2/FMA/F16C, no compiler). Nothing falls back silently: the layers that use these kernels
raise with that reason (see ``ssd.workers.models.blockquant``).

``ref_quantize_rows`` is the plain torch reference of the activation quantisation; the kernels
produce bit-identical ``xq``/``dx``/``sx`` and (up to fp32 summation order) the same products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BLOCK_FORMATS", "ISA_FLAGS", "QK", "LayerDesc", "LinearDesc", "RowPlan", "attend_rows", "available",
    "decoder_layers", "isa", "linear", "linear_dense", "load", "quantize_rows", "ref_attend_rows",
    "ref_quantize_rows", "rmsnorm", "silu_mul", "supported_isas", "unavailable_reason", "use",
]

QK = 32  # weights and activations are quantised in blocks of 32 along K
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Builds of the kernels, best first, with the CPU flags each needs: the VNNI builds do an int8 dot
# product in one instruction instead of three, the AVX-512 one runs two weight tiles per 512-bit
# vector, and the amx one hands q4 / q5 products of 12 or more rows to AMX's tile multiply (all the
# same integer sums and per-output float steps, so the same bits as avx2).
_AVX512 = ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni")
ISA_FLAGS = {
    "amx": (*_AVX512, "-mamx-tile", "-mamx-int8"),
    "avx512vnni": _AVX512,
    "avxvnni": ("-mavxvnni",),
    "avx2": (),
}
_ISA_CPU_FLAGS = {
    "amx": {"avx512f", "avx512vl", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"},
    "avx512vnni": {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"},
    "avxvnni": {"avx_vnni"},
    "avx2": set(),
}


SOURCES = ("qgemm.cpp", "decoder_layer.cpp")  # compiled together into one library (common.h shared)
HEADERS = ("common.h",)


def _sources(src_dir: Path | None = None) -> list[Path]:
    return [(src_dir or Path(__file__).parent) / name for name in SOURCES]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability()
    return {"avx2", "fma", "f16c"} if cap.startswith(("AVX2", "AVX512")) else set()


def _cache_dir() -> Path:
    return Path(os.environ.get("SSD_CACHE_DIR") or Path.home() / ".cache" / "ssd") / "kernels"


def supported_isas() -> list[str]:
    """The builds (keys of ISA_FLAGS) this CPU can run, best first."""
    flags = _cpu_flags()
    return [name for name, need in _ISA_CPU_FLAGS.items() if need <= flags]


def isa() -> str:
    """The build the kernels use here: ``$SSD_CPU_ISA`` if set (a key of ISA_FLAGS; ``avx2`` compares
    against the baseline), else the best this CPU supports."""
    forced = os.environ.get("SSD_CPU_ISA")
    if forced:
        if forced not in ISA_FLAGS:
            raise ValueError(f"SSD_CPU_ISA={forced!r}: expected one of {', '.join(ISA_FLAGS)}")
        if lacking := _ISA_CPU_FLAGS[forced] - _cpu_flags():
            raise ValueError(f"SSD_CPU_ISA={forced!r}: this CPU lacks {', '.join(sorted(lacking))}")
        return forced
    return supported_isas()[0]


def _build(isa_name: str, src_dir: Path | None = None) -> Path:
    src_dir = src_dir or Path(__file__).parent
    src = b"".join((src_dir / name).read_bytes() for name in (*SOURCES, *HEADERS))
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH to build the CPU kernels")
    flags = (*_FLAGS, *ISA_FLAGS[isa_name])
    tag = hashlib.sha256(src + " ".join((cxx, *flags)).encode()).hexdigest()[:16]
    out = _cache_dir() / f"qgemm-{tag}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    proc = subprocess.run([cxx, *flags, "-o", tmp, *map(str, _sources(src_dir))], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {', '.join(SOURCES)} failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders (Ray workers) never load a half-written file
    return out


@functools.cache
def _lib() -> ctypes.CDLL | str:
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    try:
        return load(isa())
    except (RuntimeError, OSError) as e:
        return str(e)


def load(isa_name: str, src_dir: Path | None = None) -> ctypes.CDLL:
    """The kernel library built for `isa_name` (a key of ISA_FLAGS), built first if not cached, from the
    sources in `src_dir` (SOURCES and HEADERS; default: this package's). `_lib` is the one the layers use;
    tests load others to compare builds, benchmarks/kernel_ab.py other source revisions (see `use`)."""
    # torch (imported above) already loaded libgomp.so.1: one OpenMP pool
    lib = ctypes.CDLL(str(_build(isa_name, src_dir)))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.ssd_quantize_rows.argtypes = [p, i, i, i, p, p, p]
    lib.ssd_linear.argtypes = [p, i, i, i, p, p, p, i, p, i, i]
    lib.ssd_rmsnorm.argtypes = [p, p, p, i, i, i, ctypes.c_float]
    lib.ssd_attend_rows.argtypes = [p, ctypes.c_int64, p, p, p, i, i, i, i, i, i, p, p, p, p, i]
    lib.ssd_linear_dense.argtypes = [p, i, i, i, i, p, i, p, p, i]
    lib.ssd_silu_mul.argtypes = [p, p, i, i, i, i]
    lib.ssd_argmax_rows.argtypes = [p, i, ctypes.c_int64, p, i]
    lib.ssd_decoder_layers.argtypes = [
        p, i, p, i, i, i, i, i, i, i, i, ctypes.c_float, p, p, p, p, p, p, p, p, i,
    ]
    for f in (lib.ssd_quantize_rows, lib.ssd_linear, lib.ssd_rmsnorm, lib.ssd_attend_rows, lib.ssd_linear_dense,
              lib.ssd_silu_mul, lib.ssd_decoder_layers):
        f.restype = None
    lib.ssd_argmax_rows.restype = ctypes.c_int  # rows holding a NaN
    if hasattr(lib, "ssd_amx_min_rows"):  # older source revisions (kernel_ab.py) lack it
        lib.ssd_amx_min_rows.argtypes = [i]
        lib.ssd_amx_min_rows.restype = ctypes.c_int
    return lib


def available() -> bool:
    return not isinstance(_lib(), str)


def unavailable_reason() -> str | None:
    lib = _lib()
    return lib if isinstance(lib, str) else None


_override: ctypes.CDLL | None = None


def use(lib: ctypes.CDLL | None) -> None:
    """From now on every kernel call (the layers' too) runs on `lib`, a library from `load` (another build or
    source revision; None: this package's own again): benchmarks/kernel_ab.py times kernel versions in turn
    in one process."""
    global _override
    _override = lib


def _require() -> ctypes.CDLL:
    lib = _override or _lib()
    if isinstance(lib, str):
        raise RuntimeError(f"block-quantised CPU kernel unavailable: {lib}")
    return lib


def check_shape(k: int) -> None:
    if k % QK:
        raise ValueError(f"in_features {k} is not a multiple of {QK}")


def _check_x(x: Tensor, k: int) -> None:
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise ValueError(f"expected a 2-d fp32/bf16 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"expected a contiguous [M, {k}] tensor, got {tuple(x.shape)}")


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [M, K] fp32/bf16 -> (xq int8 [M, K], dx fp32 [M, K/32], sx = dx * sum(xq) fp32 [M, K/32])."""
    m, k = x.shape
    _check_x(x, k)
    check_shape(k)
    xq = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, k // QK, dtype=torch.float32)
    sx = torch.empty(m, k // QK, dtype=torch.float32)
    _require().ssd_quantize_rows(
        x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, xq.data_ptr(), dx.data_ptr(), sx.data_ptr()
    )
    return xq, dx, sx


def ref_quantize_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reference for `quantize_rows`: per block of 32, dx = absmax / 127, xq = round(x * (1 / dx)). A block with
    a NaN or an infinity gives dx = NaN and xq = 0; one whose 1 / dx overflows counts as zero."""
    m, k = x.shape
    x32 = x.float().view(m, k // QK, QK)
    bad = ~torch.isfinite(x32).all(dim=-1)  # [M, K/32]
    x32 = torch.where(bad[..., None], torch.zeros_like(x32), x32)
    dx = x32.abs().amax(dim=-1) / 127.0  # [M, K/32]
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    tiny = ~torch.isfinite(inv)  # 1 / dx overflowed: the block counts as zero
    dx, inv = dx.masked_fill(tiny, 0.0), inv.masked_fill(tiny, 0.0)
    xq = (x32 * inv[..., None]).round()  # round half to even, like the kernel's vroundps
    dx = torch.where(bad, torch.full_like(dx, float("nan")), dx)
    sx = dx * xq.sum(dim=-1)
    return xq.to(torch.int8).view(m, k), dx, sx


BLOCK_FORMATS = {"q4": 1, "q8": 2, "q5": 3, "q6": 4, "q4g64": 5}  # as LinearDesc.kind
OFFSET_FORMATS = ("q4", "q4g64")  # w = scale * q + offset


def linear(x: Tensor, qweight: Tensor, scale: Tensor, offset: Tensor | None, fmt: str, n: int) -> Tensor:
    """y [M, N] = x [M, K] @ W^T in x's dtype, W in blocks of 32 along K with fp16 scales:

    * "q4": W = scale * q + offset, codes 0..15 in tiles of 8 rows (N zero-padded to whole tiles):
      qweight [ceil(N/8), K/32 * 128], scale and offset fp16 [ceil(N/8), K/32, 8] (see
      ssd.workers.models.blockquant.W4A8Linear.pack);
    * "q4g64": q4 with one scale and offset per 64 weights: q4's qweight, scale and offset fp16
      [ceil(N/8), K/64, 8] (K a multiple of 64; see W4G64A8Linear);
    * "q5": W = scale * (q - 16), codes 0..31 in the same tiles plus a plane of fifth bits:
      qweight [ceil(N/8), K/32 * 160], scale as q4's (see W5A8Linear.pack);
    * "q6": W = scale * (q - 32), codes 0..63 in the same tiles plus two planes of high bits, a scale
      per 16 weights: qweight [ceil(N/8), K/32 * 192], scale fp16 [ceil(N/8), K/16, 8] (see
      W6A8Linear.pack);
    * "q8": W = scale * q, codes -127..127 stored as q + 128 in the same tiles, whole bytes:
      qweight [ceil(N/8), K/32 * 256], scale as q4's (see W8A8Linear.pack).

    `n` gives N (the tiles are zero-padded to whole tiles).

    x must be a contiguous fp32/bf16 CPU tensor with K a multiple of 32 (the layers check once, at
    build time).
    """
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; one of {', '.join(BLOCK_FORMATS)}")
    if (fmt in OFFSET_FORMATS) != (offset is not None):
        raise ValueError("q4 / q4g64 weights need an offset, and only they take one")
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype)
    _require().ssd_linear(
        x.data_ptr(), m, n, k, qweight.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(),
        BLOCK_FORMATS[fmt], y.data_ptr(), x.dtype == torch.bfloat16, torch.get_num_threads(),
    )
    return y


def linear_dense(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias) with fp32 accumulation, in x's dtype.

    weight fp32 or bf16 (bias in the weight's dtype), x fp32 or bf16, all contiguous CPU tensors.
    Every output row gets the same bits whatever M is (see qgemm.cpp), unlike torch's GEMMs.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_dense: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    ok = (torch.float32, torch.bfloat16)
    if x.dtype not in ok or weight.dtype not in ok or x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"linear_dense: fp32/bf16 CPU tensors only, got x {x.dtype} on {x.device}, "
                         f"weight {weight.dtype} on {weight.device}")
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("linear_dense: x and weight must be contiguous")
    bad_bias = bias is not None and (bias.dtype != weight.dtype or bias.shape != (weight.shape[0],))
    if bad_bias or (bias is not None and not bias.is_contiguous()):
        raise ValueError(f"linear_dense: bias must be a contiguous [{weight.shape[0]}] {weight.dtype} tensor")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    _require().ssd_linear_dense(
        x.data_ptr(), int(x.dtype == torch.bfloat16), m, n, k, weight.data_ptr(), int(weight.dtype == torch.bfloat16),
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )
    return y


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (fp32 math), for contiguous fp32/bf16 x."""
    d = x.shape[-1]
    if (x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous() or x.device.type != "cpu"
            or weight.dtype != x.dtype or tuple(weight.shape) != (d,) or not weight.is_contiguous()):
        # the C kernel reads and writes fp32 or bf16 in place of whatever it is given
        raise ValueError(f"rmsnorm: contiguous fp32/bf16 CPU x [..., D] and a [D] weight of its dtype expected, got "
                         f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty_like(x)
    _require().ssd_rmsnorm(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.dtype == torch.bfloat16, x.numel() // d, d, eps
    )
    return out


def argmax_rows(x: Tensor) -> Tensor:
    """torch.argmax(x, -1) (the first maximum of each row) for a contiguous fp32 CPU tensor [..., V]: about
    8x faster on a vocabulary row. A row holding a NaN goes to torch, which ranks NaN highest."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.shape[-1] == 0:
        raise ValueError(f"argmax_rows: a contiguous fp32 CPU tensor [..., V > 0] expected, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    v = x.shape[-1]
    rows = x.view(-1, v)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if _require().ssd_argmax_rows(rows.data_ptr(), rows.shape[0], v, out.data_ptr(), torch.get_num_threads()):
        nan = out < 0
        out[nan] = rows[nan].argmax(-1)
    return out.view(x.shape[:-1])


@dataclass
class RowPlan:
    """Which cache positions each new token attends (built once per forward, used by every layer).

    slot, length: int32 [R]; off: int64 [R], -1 = positions 0..length-1, else idx[off:off+length].
    """

    slot: Tensor
    length: Tensor
    off: Tensor
    idx: Tensor

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, int, Any]]) -> RowPlan:
        """rows: (b, i, cache slot, keys) with keys = L (positions 0..L-1) or a LongTensor of positions."""
        slot, length, off, parts, at = [], [], [], [], 0
        for _, _, s, sel in rows:
            slot.append(s)
            if isinstance(sel, int):
                length.append(sel)
                off.append(-1)
            else:
                length.append(int(sel.numel()))
                off.append(at)
                parts.append(sel.to(torch.int64))
                at += int(sel.numel())
        idx = torch.cat(parts) if parts else torch.zeros(1, dtype=torch.int64)
        return cls(torch.tensor(slot, dtype=torch.int32), torch.tensor(length, dtype=torch.int32),
                   torch.tensor(off, dtype=torch.int64), idx.contiguous())


def attend_rows(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: RowPlan) -> Tensor:
    """q [R, H, hd] (one new token per row) over one layer's cache [S, Hkv, max_len, hd] -> [R, H, hd]."""
    r, h, hd = q.shape
    s, hkv, max_len, hd2 = k_cache.shape
    if hd2 != hd or h % hkv or q.dtype != k_cache.dtype or q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"attend_rows: q {q.dtype} {tuple(q.shape)}, cache {k_cache.dtype} {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or q.stride(1) != hd or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attend_rows: q rows must be [H, hd] contiguous and the caches contiguous")
    out = torch.empty(r, h, hd, dtype=q.dtype)
    _require().ssd_attend_rows(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        int(q.dtype == torch.bfloat16), r, h, hkv, hd, max_len,
        plan.slot.data_ptr(), plan.length.data_ptr(), plan.off.data_ptr(), plan.idx.data_ptr(), torch.get_num_threads(),
    )
    return out


def ref_attend_rows(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: RowPlan) -> Tensor:
    """Reference for `attend_rows`: one fp32 SDPA per token over its gathered keys."""
    r, h, hd = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    for j in range(r):
        s, n, o = int(plan.slot[j]), int(plan.length[j]), int(plan.off[j])
        pos = torch.arange(n) if o < 0 else plan.idx[o : o + n]
        kr, vr = k_cache[s][:, pos].float(), v_cache[s][:, pos].float()  # [Hkv, n, hd]
        qr = q[j].float().view(hkv, h // hkv, hd)
        out[j] = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr).reshape(h, hd).to(q.dtype)
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2I] (contiguous fp32/bf16) -> silu(gate) * up [..., I], each op rounded as in torch."""
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: contiguous fp32/bf16 [..., 2I] expected, got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    i2 = gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], i2 // 2, dtype=gate_up.dtype)
    _require().ssd_silu_mul(gate_up.data_ptr(), out.data_ptr(), int(gate_up.dtype == torch.bfloat16),
                            gate_up.numel() // i2, i2 // 2, torch.get_num_threads())
    return out


class LinearDesc(ctypes.Structure):
    """One linear layer for ssd_decoder_layers: kind 0 dense (fp32/bf16 weight), else a BLOCK_FORMATS value."""

    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("w_bf16", ctypes.c_int32),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class LayerDesc(ctypes.Structure):
    """One decoder layer for ssd_decoder_layers (pointers into tensors the caller keeps alive)."""

    _fields_ = [("q", LinearDesc), ("k", LinearDesc), ("v", LinearDesc), ("qkv_parts", ctypes.c_int32),
                ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


@dataclass
class LayerDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_len: int
    eps: float


def decoder_layers(layers: ctypes.Array, dims: LayerDims, x: Tensor, cos: Tensor, sin: Tensor, w_slot: Tensor,
                   w_pos: Tensor, plan: RowPlan) -> Tensor:
    """x [T, D] (updated in place and returned) through every layer of `layers` (LayerDesc array).

    cos/sin [T, hd] in x's dtype; w_slot/w_pos int32 [T]: where each token's keys and values go;
    plan: the tokens' attention (one entry per token, same order). The caller checks the
    descriptors against the model once (ssd.workers.models.fused); this checks the per-call tensors.
    """
    t, d = x.shape
    hd = dims.head_dim
    ok = x.dtype in (torch.float32, torch.bfloat16) and d == dims.hidden and x.is_contiguous()
    ok = ok and cos.shape == (t, hd) and sin.shape == (t, hd) and cos.dtype == x.dtype == sin.dtype
    ok = ok and cos.is_contiguous() and sin.is_contiguous() and hd <= 512 and hd % 2 == 0
    ok = ok and w_slot.dtype == w_pos.dtype == torch.int32 and w_slot.numel() == t == w_pos.numel()
    ok = ok and plan.slot.numel() == t
    if not ok:
        raise ValueError(f"decoder_layers: x {x.dtype} {tuple(x.shape)}, cos {tuple(cos.shape)}, "
                         f"{w_slot.numel()} write positions, {plan.slot.numel()} attention rows")
    _require().ssd_decoder_layers(
        ctypes.cast(layers, ctypes.c_void_p), len(layers), x.data_ptr(), int(x.dtype == torch.bfloat16), t, d,
        dims.heads, dims.kv_heads, hd, dims.intermediate, dims.max_len, dims.eps, cos.data_ptr(), sin.data_ptr(),
        w_slot.data_ptr(), w_pos.data_ptr(), plan.slot.data_ptr(), plan.length.data_ptr(), plan.off.data_ptr(),
        plan.idx.data_ptr(), torch.get_num_threads(),
    )
    return x
