"""Quantised loading: `load_model(..., quantization="int8" | "int4" | "w4a8" | "w8a8" | "w4a8-all" | "w4a8-g64")`.

"w4a8" / "w8a8" follow the "int4" / "int8" rules below with the block-quantised layers of
blockquant.py (int8 activations): with "w4a8" Q4_K codes -> W4A8Linear and Q5_0 codes -> W5A8Linear
(kept exactly: w = d * (q - 16)); with either, Q6_K codes -> W6A8Linear (w = d * sc * (q - 32), d * sc
rounded to fp16) and Q8_0 codes -> W8A8Linear (kept exactly: w = d * q), lm_head included; everything
else -> W8A8Linear, rounded to nearest. "w4a8-all" keeps the Q4_K codes
(lm_head's too) and rounds every other layer to nearest in q4 (W4A8Linear): fewer bits than the file has
where it has more (a draft's format: its output never changes what the target emits). "w4a8-g64" rounds
every layer to nearest in q4 with a scale and offset per 64 weights (W4G64A8Linear), from the dequantised
weights: ~10 % fewer bytes again, the default draft of a "w4a8" target.

* "int8": every linear layer (lm_head included) becomes Int8Linear, rounded to nearest from the
  floating-point weights the loader produced.
* "int4" from a GGUF file: each Q4_K linear weight becomes an Int4Linear holding the file's own
  4-bit codes (a Q4_K sub-block of 32 is an affine int4 group: no re-rounding, only scale and zero
  are rounded to the activation dtype). Linear weights stored with more bits (Q5_0, Q6_K, Q8_0,
  F16/F32) become Int8Linear, so nothing is stored with less precision than the file has;
  lm_head is int8.
* "int4" from floating-point weights (Hugging Face directories): Int4Linear round-to-nearest
  (groups of 32), lm_head int8.

The Q4_K, Q5_0 and Q6_K codes are cached beside the dequantised weights (`<key>-codes.safetensors`): the
packed layout the kernel reads depends on the CPU, so the cache holds plain codes and packing
happens at load time.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ssd.workers.loader.gguf_loader import (
    _atomic_write,
    cache_key,
    default_cache_dir,
    hf_name,
    unpermute_rope,
)
from ssd.workers.models.config import ModelConfig
from ssd.workers.models.decoder import DecoderModel
from ssd.workers.models.quant import (
    QUANT_MODES,
    Int4Linear,
    q4k_to_affine,
    q5_0_codes,
    q6k_codes,
    q8_0_codes,
    quantize_model,
)

log = logging.getLogger("ssd.quant")

CODES_CACHE_FORMAT = 4  # 2: Q5_0 codes too; 3: and Q6_K; 4: and Q8_0, and Q4_K of any row count


def _linear_names(model: DecoderModel) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _extract_codes(
    path: Path, cfg: ModelConfig, linear_names: set[str]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's Q4_K linear weights as {name.codes [N, K/2] nibbles, name.scale, name.offset}, its
    Q5_0 ones as {name.q5codes [N, K] (0..31), name.q5scale}, its Q6_K ones as {name.q6codes
    [N, K] (0..63), name.q6scale [N, K/16]} and its Q8_0 ones as {name.q8codes [N, K] int8, name.q8scale},
    + the GGUF type of every linear."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or not name.endswith(".weight") or name[: -len(".weight")] not in linear_names:
            continue
        mod = name[: -len(".weight")]
        types[mod] = t.tensor_type.name
        k, n = (int(x) for x in t.shape[:2])  # GGUF lists ne[] innermost first
        rope_heads = None
        if cfg.arch == "llama" and mod.endswith(("q_proj", "k_proj")):
            rope_heads = cfg.num_attention_heads if mod.endswith("q_proj") else cfg.num_key_value_heads
        exact = {gguf.GGMLQuantizationType.Q5_0: ("q5", q5_0_codes), gguf.GGMLQuantizationType.Q6_K: ("q6", q6k_codes),
                 gguf.GGMLQuantizationType.Q8_0: ("q8", q8_0_codes)}
        if t.tensor_type in exact:
            kind, extract = exact[t.tensor_type]
            codes, scale = extract(torch.from_numpy(t.data.copy()), n, k)
            if rope_heads is not None:
                codes, scale = (unpermute_rope(x, rope_heads) for x in (codes, scale))
            tensors[f"{mod}.{kind}codes"], tensors[f"{mod}.{kind}scale"] = codes.contiguous(), scale.contiguous()
            continue
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_K:
            continue
        codes, scale, offset = q4k_to_affine(torch.from_numpy(t.data.copy()), n, k)
        if rope_heads is not None:
            codes, scale, offset = (unpermute_rope(x, rope_heads) for x in (codes, scale, offset))
        tensors[f"{mod}.codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        tensors[f"{mod}.scale"] = scale.contiguous()
        tensors[f"{mod}.offset"] = offset.contiguous()
    return tensors, types


def _read_codes_cache(data_file: Path, meta_file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The cached codes and GGUF types, or None where there are none or they cannot be read (rebuilt)."""
    if not (meta_file.is_file() and data_file.is_file()):
        return None
    try:
        meta = json.loads(meta_file.read_text())
        if not isinstance(meta, dict) or meta.get("format") != CODES_CACHE_FORMAT:
            return None
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(data_file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
        return tensors, dict(meta["types"])
    except Exception as e:  # noqa: BLE001 - truncated or foreign files: extract again
        warnings.warn(f"ignoring unreadable quantised-codes cache entry {meta_file}: {e}", stacklevel=3)
        return None


def load_gguf_codes(
    path: str | Path, cfg: ModelConfig, linear_names: set[str], cache_dir: str | Path | None
) -> tuple[
    dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, tuple[torch.Tensor, torch.Tensor]],
    dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str],
]:
    """{linear: (codes [N, K] uint8, scale, offset [N, K/32] fp32)} for Q4_K weights, {linear: (codes
    [N, K] 0..31, scale fp16 [N, K/32])} for Q5_0 weights, {linear: (codes [N, K] 0..63, scale fp16
    [N, K/16])} for Q6_K weights, {linear: (codes [N, K] int8, scale fp16 [N, K/32])} for Q8_0 weights,
    + GGUF types."""
    path = Path(path)
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(path)
    data_file, meta_file = cdir / f"{key}-codes.safetensors", cdir / f"{key}-codes.json"
    cached = _read_codes_cache(data_file, meta_file)
    if cached is not None:
        tensors, types = cached
    else:  # as the dequantised weights' cache: a cache that cannot be read or written only costs time
        tensors, types = _extract_codes(path, cfg, linear_names)
        try:
            cdir.mkdir(parents=True, exist_ok=True)
            _atomic_write(data_file, lambda p: save_file(tensors, str(p)))
            meta = {"format": CODES_CACHE_FORMAT, "types": types}
            _atomic_write(meta_file, lambda p: p.write_text(json.dumps(meta)))
        except OSError as e:
            warnings.warn(f"could not write the quantised-codes cache in {cdir}: {e}", stacklevel=2)
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    exact: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {"q5": {}, "q6": {}, "q8": {}}
    for mod in {k.rsplit(".", 1)[0] for k in tensors}:
        kind = next((kind for kind in exact if f"{mod}.{kind}codes" in tensors), None)
        if kind is not None:
            exact[kind][mod] = (tensors[f"{mod}.{kind}codes"], tensors[f"{mod}.{kind}scale"])
            continue
        packed = tensors[f"{mod}.codes"]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        out[mod] = (codes, tensors[f"{mod}.scale"], tensors[f"{mod}.offset"])
    return out, exact["q5"], exact["q6"], exact["q8"], types


def quantize_loaded(
    model: DecoderModel, path: str | Path, mode: str | None, cache_dir: str | Path | None = None
) -> DecoderModel:
    """Apply `mode` to a model just loaded from `path` (a .gguf file or a Hugging Face directory)."""
    if mode is None:
        return model
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}; use None or one of {', '.join(QUANT_MODES)}")
    path = Path(path)
    if mode not in ("int4", "w4a8", "w8a8", "w4a8-all") or path.suffix != ".gguf":
        return quantize_model(model, mode)
    names = _linear_names(model)
    q4k, q5_0, q6_k, q8_0, types = load_gguf_codes(path, model.config, names, cache_dir)
    if mode == "w4a8-all":
        log.info("%s: w4a8-all, Q4_K codes kept for %d linear layers, %d rounded to nearest in q4", path.name,
                 len(q4k), len(names) - len(q4k))
        return quantize_model(model, mode, affine_int4=q4k)
    if mode == "w8a8":  # Q6_K and Q8_0 keep their codes; the rest (fewer bits, or float) is rounded to 8 bits
        log.info("%s: w8a8, q6 from Q6_K for %d linear layers, q8 from Q8_0 for %d, rounded to nearest for %d",
                 path.name, len(q6_k), len(q8_0), len(names) - len(q6_k) - len(q8_0))
        return quantize_model(model, mode, q6=q6_k, q8=q8_0)
    # The int4 kernel takes whole column blocks only: such a layer's Q4_K codes go to int8 instead.
    affine: dict[str, Any] = {n: v for n, v in q4k.items() if n != "lm_head"
                              and (mode != "int4" or Int4Linear.supports(*v[0].shape))}
    # Q5_0, Q6_K and Q8_0 keep their codes (W5A8Linear, W6A8Linear, W8A8Linear) in the block mode; the
    # weight-only int4 mode has no such kernels. A Q6_K or Q8_0 head keeps its bits: no fewer than the file has.
    q5 = {n: v for n, v in q5_0.items() if n != "lm_head"} if mode == "w4a8" else {}
    q6 = q6_k if mode == "w4a8" else {}
    q8 = q8_0 if mode == "w4a8" else {}
    eight = "int8" if mode == "int4" else "w8a8"
    overrides = {n: eight for n in names if n not in affine and n not in q5 and n not in q6}  # more bits: keep 8
    log.info(
        "%s: %s from Q4_K for %d linear layers, q5 from Q5_0 for %d, q6 from Q6_K for %d, %s for %d (%s; Q8_0 "
        "codes kept for %d)", path.name, mode, len(affine), len(q5), len(q6), eight, len(overrides),
        ", ".join(sorted({types.get(n, "?") for n in overrides})), len(q8),
    )
    return quantize_model(model, mode, affine_int4=affine, q5=q5, q6=q6, q8=q8, overrides=overrides)
