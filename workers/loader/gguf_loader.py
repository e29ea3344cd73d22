"""Load a GGUF file: config from metadata, dequantised weights renamed to Hugging Face names, tokenizer.

Dequantising in numpy is slow (tens of seconds for a 0.5B model), so the result is converted once and
cached on disk as `<cache_dir>/<key>-<dtype>.safetensors` (+ `<key>.json` manifest and tokenizer files);
the key hashes the file's path, size and mtime. A cache hit never opens the GGUF at all: just parsing
its metadata (150k-token vocabulary) takes ~15 s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ssd.workers.loader.tokenizer import Tokenizer, _GGUFFields
from ssd.workers.loader.weights import build_model, check_tensor, expected_shapes
from ssd.workers.models.config import SUPPORTED_ARCHS, ModelConfig
from ssd.workers.models.decoder import DecoderModel

CACHE_FORMAT = 1  # bump when the conversion changes, to invalidate old cache entries
_CHUNK_ROWS = 8192  # dequantise big matrices in row blocks: bounds the numpy temporaries

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_DTYPE_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> DecoderModel name; None for tensors that carry no weights (rope_freqs)."""
    if gguf_name.startswith("rope_freqs."):
        return None  # Llama-3.1 rope factors: folded into cfg.rope_scaling instead
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        return f"layers.{layer}.{_BLOCK_NAMES.get(part, part)}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES.get(stem, stem)}.{kind}"


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Llama q/k rows (interleaved -> half-split rope)."""
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
    )


def _f32(v: Any) -> float:
    # GGUF stores these as float32; print-round-trip gives the value the HF config had (1e-06, not 9.99e-07).
    return float(str(np.float32(v)))


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 `rope_scaling` from the `rope_freqs` factors llama.cpp writes for Llama-3.1+."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = float(factors.max())
    for low, high, old in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        wavelen = 2 * math.pi / freqs
        smooth = (old / wavelen - low) / (high - low)
        want = np.where(
            wavelen < old / high,
            1.0,
            np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(want, factors, rtol=1e-3):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": old,
            }
    raise ValueError("GGUF rope_freqs tensor does not match a llama3 rope scaling this loader knows")


def config_from_gguf(reader: Any, source: str) -> ModelConfig:
    meta = _GGUFFields(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    absent = [f"{arch}.{k}" for k in required if key(k) is None]
    if absent or "token_embd.weight" not in tensors:
        raise ValueError(
            f"{source}: GGUF metadata incomplete, missing {', '.join(absent) or 'token_embd.weight'}"
        )
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", 0) or 0)
    theta = _f32(key("rope.freq_base", 10000.0))

    rope_scaling: dict[str, Any] | None = None
    stype = key("rope.scaling.type")
    if stype and stype != "none":
        rope_scaling = {"rope_type": stype, "factor": _f32(key("rope.scaling.factor", 1.0))}
        if key("rope.scaling.original_context_length") is not None:
            rope_scaling["original_max_position_embeddings"] = int(
                key("rope.scaling.original_context_length")
            )
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        rope_scaling = _llama3_scaling(factors, theta, head_dim or int(key("embedding_length")) // heads)

    # Rows of the embedding, not the token list: files may pad the matrix past the vocabulary.
    vocab = int(tensors["token_embd.weight"].shape[-1])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=arch == "qwen3",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def _dequantize(t: Any, dtype: torch.dtype) -> torch.Tensor:
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne[] innermost-first
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(t.data.shape[0], -1) if t.data.ndim > 1 else out.view(1, -1)
    data = t.data if t.data.ndim > 1 else t.data.reshape(1, -1)
    for i in range(0, data.shape[0], _CHUNK_ROWS):
        try:
            block = gguf.quants.dequantize(data[i : i + _CHUNK_ROWS], t.tensor_type)
        except NotImplementedError as e:  # e.g. F64, the integer types, Q8_K
            raise ValueError(f"tensor {t.name} has GGUF type {t.tensor_type.name}, which this loader cannot read "
                             f"({e})") from None
        block = np.array(
            block, dtype=np.float32, copy=not block.flags.writeable
        )  # memmap views are read-only
        flat[i : i + _CHUNK_ROWS] = torch.from_numpy(block.reshape(block.shape[0], -1))
    return out


def _convert(
    reader: Any, cfg: ModelConfig, dtype: torch.dtype, source: str, progress: bool
) -> dict[str, torch.Tensor]:
    expected = expected_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(
        reader.tensors, desc=f"dequantising {Path(source).name}", unit="tensor", disable=not progress
    ):
        name = hf_name(t.name)
        if name is None:
            continue
        w = _dequantize(t, dtype)
        check_tensor(name, tuple(w.shape), expected, source)
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_rope(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        tensors[name] = w
    return tensors


def default_cache_dir() -> Path:
    return Path(os.environ.get("SSD_CACHE_DIR") or Path.home() / ".cache" / "ssd")


def cache_key(path: str | Path) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    return hashlib.sha256(f"{CACHE_FORMAT}|{real}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]


def dtype_tag(dtype: torch.dtype) -> str:
    return _DTYPE_TAGS.get(dtype, str(dtype).removeprefix("torch."))


def _atomic_write(final: Path, write: Any) -> None:
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # safetensors creates 0600 files; the cache is meant to be shared
        os.replace(tmp, final)  # readers never see a half-written cache file
    finally:
        tmp.unlink(missing_ok=True)


def _read_cache(
    manifest: Path, tok_json: Path, tok_meta: Path
) -> tuple[ModelConfig, Tokenizer | None] | None:
    """Config and tokenizer from a cache entry; None when absent or unreadable (then it is rebuilt)."""
    if not manifest.is_file():
        return None
    try:
        info = json.loads(manifest.read_text())
        cfg = ModelConfig(**info["config"])
        return cfg, (Tokenizer.load(tok_json, tok_meta) if info["tokenizer"] else None)
    except Exception as e:  # stale format, truncated file, ...
        warnings.warn(f"ignoring unreadable cache entry {manifest}: {e}", stacklevel=3)
        return None


def load_gguf(
    path: str | Path, *, dtype: torch.dtype, device: str, cache_dir: str | Path | None, progress: bool
) -> tuple[ModelConfig, DecoderModel, Tokenizer | None]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(path)
    manifest = cdir / f"{key}.json"
    weights = cdir / f"{key}-{dtype_tag(dtype)}.safetensors"
    tok_json, tok_meta = cdir / f"{key}.tokenizer.json", cdir / f"{key}.tokenizer_meta.json"
    source = str(path)

    cached = _read_cache(manifest, tok_json, tok_meta)
    if cached is not None and weights.is_file():
        cfg, tokenizer = cached
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            for name in tqdm(
                list(f.keys()), desc=f"loading {path.name} (cached)", unit="tensor", disable=not progress
            ):
                tensors[name] = f.get_tensor(name).to(device)
        return cfg, build_model(cfg, tensors, source, device), tokenizer

    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = config_from_gguf(reader, source)
    tokenizer: Tokenizer | None = None
    if cached is not None and cached[1] is not None:
        tokenizer = cached[1]  # only this dtype's weights are new
    elif _GGUFFields(reader).get("tokenizer.ggml.model") is not None:
        try:
            tokenizer = Tokenizer.from_gguf(reader)
        except ValueError as e:  # e.g. a sentencepiece vocabulary: run with token ids instead
            warnings.warn(f"{source}: no tokenizer loaded: {e}", stacklevel=2)
    if tokenizer is not None:
        cfg.eos_token_ids = list(tokenizer.eos_token_ids)

    tensors = _convert(reader, cfg, dtype, source, progress)
    model = build_model(cfg, {k: v.to(device) for k, v in tensors.items()}, source, device)

    # Cache: tokenizer and weights first, manifest last (it is what marks an entry complete). A cache that
    # cannot be written (read-only, disk full) costs the next load time, not this one its model.
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        if tokenizer is not None:
            _atomic_write(tok_json, lambda p: p.write_text(tokenizer.backend.to_str()))
            _atomic_write(tok_meta, lambda p: p.write_text(json.dumps(tokenizer.metadata())))
        _atomic_write(
            weights, lambda p: save_file(tensors, str(p), metadata={"source": source, "format": "pt"})
        )
        info = {"source": source, "config": dataclasses.asdict(cfg), "tokenizer": tokenizer is not None}
        _atomic_write(manifest, lambda p: p.write_text(json.dumps(info, indent=1)))
    except OSError as e:
        warnings.warn(f"could not write the GGUF conversion cache in {cdir}: {e}", stacklevel=2)
    return cfg, model, tokenizer
