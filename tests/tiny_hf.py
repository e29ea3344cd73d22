"""A tiny Hugging Face-style model directory (config.json + model.safetensors + byte-level BPE tokenizer
with a chat template), written in well under a second and without transformers, for server/CLI/job tests."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tiny_models import random_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello, world! 0123456789",
    "import os\nimport sys\nfor i in range(10):\n    print(i, 'hello')\n",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \u2014 emoji \U0001f600",
]


def build_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def write_model_dir(path: str | Path, seed: int = 0, scale: float = 3.0, layers: int = 2, hidden: int = 32,
                    tokenizer: bool = True, vocab: int | None = None) -> Path:
    """Write the directory and return it. `scale` > 1 makes the random model's next token peaked."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    eos_id = None
    if tokenizer:
        tok = build_tokenizer()
        tok.save(str(d / "tokenizer.json"))
        vocab = tok.get_vocab_size()
        eos_id = tok.token_to_id("<|im_end|>")
        (d / "tokenizer_config.json").write_text(json.dumps({
            "eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
        }))
    vocab = vocab or 64
    model = random_model(vocab=vocab, layers=layers, hidden=hidden, seed=seed, scale=scale)
    cfg = model.config
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False,
        "eos_token_id": eos_id, "torch_dtype": "float32",
    }))
    sd = {}
    for k, v in model.state_dict().items():
        sd[k if k.startswith("lm_head") else f"model.{k}"] = v.detach().contiguous()
    save_file(sd, str(d / "model.safetensors"))
    return d
