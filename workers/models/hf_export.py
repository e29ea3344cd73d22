"""View one of our models as a `transformers` model over the same tensors (no copy).

Used as the oracle in parity tests and as the transformers baseline in benchmarks: its own
modelling code, identical weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ssd.workers.models.decoder import DecoderModel


def _unfused(model: DecoderModel) -> dict[str, torch.Tensor]:
    """The state dict with fused qkv_proj / gate_up_proj (dense kernel) split back into views of q/k/v, gate/up."""
    cfg = model.config
    hd = cfg.head_dim
    qkv = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.num_key_value_heads * hd)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("self_attn.qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split(qkv), strict=True):
                out[f"{base}{part}.{leaf}"] = piece
        elif prefix.endswith("mlp.gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2), strict=True):
                out[f"{base}{part}.{leaf}"] = piece
        else:
            out[name] = t
    return out


def to_transformers(model: DecoderModel) -> Any:
    import transformers

    cfg = model.config
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        head_dim=cfg.head_dim, rope_scaling=cfg.rope_scaling,
    )
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[cfg.arch]
    hf_cfg = cls_cfg(**common)
    with torch.device("meta"):
        hf = cls_model(hf_cfg)
    sd = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in _unfused(model).items()}
    missing, _ = hf.load_state_dict(sd, assign=True, strict=False)
    tied = cfg.tie_word_embeddings
    missing = [m for m in missing if not m.endswith("inv_freq") and not (tied and m == "lm_head.weight")]
    if missing:
        raise ValueError(f"tensors missing for transformers: {missing[:5]}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg)  # rope buffers off the meta device
    return hf.eval()
