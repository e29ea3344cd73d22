"""Tiny randomly initialised models built in-process (no downloads), shared by the tests."""

from __future__ import annotations

import torch

from ssd.sampling_params import SamplingParams
from ssd.workers.models.config import ModelConfig
from ssd.workers.models.decoder import DecoderModel

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6], [20]]


def hf_config(arch: str, vocab: int = 64, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2):
    """A transformers config object for arch in {llama, qwen2, qwen3}."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        return transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True)
    raise ValueError(arch)


def hf_model(arch: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(arch, **kw)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[arch]
    model = cls(cfg).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so parity tests see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_from_hf(hf, dtype: torch.dtype = torch.float32) -> DecoderModel:
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = DecoderModel(cfg)
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    model.load_state_dict(sd, strict=False)
    return model.to(dtype).eval()


def random_model(
    vocab: int = 32, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, seed: int = 0,
    scale: float = 1.0, arch: str = "qwen2",
) -> DecoderModel:
    """A tiny model of our own with random weights (no transformers needed).

    `scale` multiplies the LM head so the next-token distribution is peaked (scale > 1) or flat.
    """
    cfg = ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, rope_theta=10000.0, attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )
    g = torch.Generator().manual_seed(seed)
    model = DecoderModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        model.lm_head.weight.mul_(scale)
    return model.eval()


def greedy_tokens(model: DecoderModel, prompt: list[int], n: int, max_len: int = 512) -> list[int]:
    """n greedy tokens straight from a ModelRunner (prompt in one forward, then one token per forward)."""
    from ssd.workers.model_runner import ModelRunner

    r = ModelRunner(model, max_slots=1, max_len=max_len)
    s = r.allocate()
    out, nxt = [], prompt
    for _ in range(n):
        t = int(torch.argmax(r.forward([s], [nxt], last_only=True)[0]))
        out.append(t)
        nxt = [t]
    return out
