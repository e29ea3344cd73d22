"""Load a Hugging Face model directory: config.json + *.safetensors (single or sharded) [+ tokenizer]."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ssd.workers.loader.tokenizer import Tokenizer
from ssd.workers.loader.weights import build_model, check_tensor, expected_shapes
from ssd.workers.models.config import ModelConfig
from ssd.workers.models.decoder import DecoderModel

# Checkpoint entries that are not weights of the model (old Llama checkpoints store the rope table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(d: Path) -> ModelConfig:
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{d} has no config.json (not a Hugging Face model directory?)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON: {e}") from e
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise ValueError(f"{cfg_file}: missing field {e}") from e
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from e


def weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(
                f"{d}: shard(s) listed in {index.name} are missing: {', '.join(absent[:5])}"
            )
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pth"))
        hint = f" (found {', '.join(other[:3])}; only .safetensors is supported)" if other else ""
        raise FileNotFoundError(f"{d}: no *.safetensors weight files{hint}")
    return files


def _hf_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def load_hf_dir(
    path: str | Path, *, dtype: torch.dtype, device: str, progress: bool
) -> tuple[ModelConfig, DecoderModel, Tokenizer | None]:
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist")
    cfg = read_config(d)
    files = weight_files(d)
    expected = expected_shapes(cfg)
    source = str(d)

    tensors: dict[str, torch.Tensor] = {}
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    for h, key in tqdm(keys, desc=f"loading {d.name}", unit="tensor", disable=not progress):
        name = _hf_name(key)
        if name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue  # a tied checkpoint may still carry a copy of the embedding as lm_head
        sl = h.get_slice(key)
        check_tensor(name, tuple(sl.get_shape()), expected, source)  # fail before reading the data
        tensors[name] = h.get_tensor(key).to(device=device, dtype=dtype)
    model = build_model(cfg, tensors, source, device)

    # No tokenizer.json is fine: callers then pass prompts as token-id lists.
    tokenizer = Tokenizer.from_dir(d) if (d / "tokenizer.json").is_file() else None
    return cfg, model, tokenizer
