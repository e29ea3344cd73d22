"""Loader tests on tiny models built in the test: HF directories, GGUF files, aliases, tokenizers, cache."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from ssd.workers.loader import (
    ALIASES,
    LoadedModel,
    ModelNotFoundError,
    Tokenizer,
    load,
    load_model,
    resolve_alias,
)
from ssd.workers.loader.tokenizer import PRE_TOKENIZER_SPLITS

transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine, we've done it.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())  # héllo wörld 世界 🙂",
] * 20
TEXTS = [
    "def f(x):\n    return x * 2  # héllo 世界 🙂",
    "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n",
    "   spaces\n\n\ttabs and 1234567 numbers, they'll DON'T",
    "unseen: zygote ∑ 𝔘 ½",
]


# ---------------------------------------------------------------------------------------------------------
# tiny Hugging Face models


def _hf_model(arch: str, tie: bool = False) -> torch.nn.Module:
    common = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=1e6))
    else:  # qwen3, with head_dim != hidden/heads
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    with torch.no_grad():  # make norms/biases non-trivial so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_()
    return model.eval()


def _hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in model.state_dict().items()}


def _assert_same_weights(lm: LoadedModel, ref: dict[str, torch.Tensor], exact: bool = True) -> None:
    ours = lm.model.state_dict()
    assert set(ours) == set(ref)
    for k, v in ref.items():
        if exact:
            assert torch.equal(ours[k].float(), v.float()), k
        else:
            torch.testing.assert_close(ours[k].float(), v.float(), rtol=1e-2, atol=1e-2, msg=k)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_dir_roundtrip(tmp_path: Path, arch: str) -> None:
    hf = _hf_model(arch)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype=torch.float32, progress=False)
    assert lm.name == str(tmp_path) and lm.tokenizer is None  # no tokenizer files: still loads
    cfg, hcfg = lm.config, hf.config
    assert cfg.arch == arch
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 160)
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.rms_norm_eps == hcfg.rms_norm_eps and cfg.tie_word_embeddings is False
    _assert_same_weights(lm, _hf_state(hf))
    params = list(lm.model.parameters())
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in params)
    assert not lm.model.training
    assert lm.model.inv_freq.dtype == torch.float32 and not lm.model.inv_freq.is_meta


def test_hf_dir_bf16_tied_and_sharded(tmp_path: Path) -> None:
    hf = _hf_model("qwen2", tie=True)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards + model.safetensors.index.json
    assert (tmp_path / "model.safetensors.index.json").is_file()
    lm = load_model(str(tmp_path), progress=False)
    assert lm.config.tie_word_embeddings
    assert lm.model.lm_head.weight is lm.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    ref = _hf_state(hf)
    ref["lm_head.weight"] = ref["embed_tokens.weight"]
    _assert_same_weights(lm, {k: v.to(torch.bfloat16) for k, v in ref.items()})


def test_hf_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist"), progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(empty), progress=False)

    d = tmp_path / "m"
    _hf_model("llama").save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())

    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(ValueError, match="mamba"):
        load_model(str(d), progress=False)

    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"shape .*mlp|mlp.*shape"):
        load_model(str(d), progress=False)

    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(d), progress=False)

    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(d), progress=False)


# ---------------------------------------------------------------------------------------------------------
# tokenizers


@pytest.fixture(scope="module")
def bpe() -> Backend:
    """A small byte-level BPE trained here, with Qwen2's split regex and chat special tokens."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["qwen2"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)
    return tok


def _write_hf_tokenizer(d: Path, backend: Backend, bos_post: bool = False) -> None:
    if bos_post:  # Llama-3 style: the post-processor prepends BOS
        backend = Backend.from_str(backend.to_str())
        backend.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A",
            special_tokens=[("<|endoftext|>", backend.token_to_id("<|endoftext|>"))],
        )
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE})
    )
    (d / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]}
        )
    )


def test_tokenizer_from_dir(tmp_path: Path, bpe: Backend) -> None:
    _hf_model("qwen2").save_pretrained(tmp_path)
    _write_hf_tokenizer(tmp_path, bpe)
    tok = load_model(str(tmp_path), progress=False).tokenizer
    assert tok is not None
    im_start, im_end, eot = (bpe.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert tok.eos_token_ids == [im_end, eot] and tok.bos_token_id == eot and not tok.add_bos
    assert tok.vocab_size == bpe.get_vocab_size()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == bpe.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>")[0] == im_start and len(tok.encode("<|im_start|>user")) >= 2
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"  # specials skipped by default
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(msgs)
    assert (
        rendered
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    # the rendered prompt is identical to transformers' rendering of the same template
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHAT_TEMPLATE)
    assert rendered == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # a template that tests `tools is not none` (unguarded by `is defined`) sees None, as in transformers
    tools_tpl = ("{% if tools is not none %}[TOOLS]{{ tools | tojson }}{% endif %}{% for m in messages %}"
                 "<{{ m.role }}>{{ m.content }}{% endfor %}{% if documents is not none %}[DOCS]{% endif %}")
    tok.chat_template = hf_tok.chat_template = tools_tpl
    assert tok.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False,
                                                                       add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == "<system>be brief<user>hi"


def test_tokenizer_bos_and_template_errors(tmp_path: Path, bpe: Backend) -> None:
    _write_hf_tokenizer(tmp_path, bpe, bos_post=True)
    tok = Tokenizer.from_dir(tmp_path)
    bos = bpe.token_to_id("<|endoftext|>")
    assert tok.add_bos and tok.bos_token_id == bos
    assert tok.encode("hi")[0] == bos and tok.encode("hi")[1] != bos
    assert tok.encode("<|endoftext|>hi").count(bos) == 1  # a template that writes BOS itself: not doubled

    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{{ raise_exception('nope') }}"
    with pytest.raises(Exception, match="nope"):
        tok.apply_chat_template([])


# ---------------------------------------------------------------------------------------------------------
# GGUF


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's tensor names (gguf.constants.TENSOR_NAMES), written out independently of the loader's table.
_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_TOP = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
Q8 = gguf.GGMLQuantizationType.Q8_0


def _gguf_name(name: str) -> str:
    if not name.startswith("layers."):
        return _GGUF_TOP[name]
    _, layer, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK[part]}.{kind}"


def _write_gguf(
    path: Path,
    arch: str,
    hf: torch.nn.Module,
    bpe: Backend | None,
    quantize: bool = True,
    rope_freqs: bool = False,
    drop: str | None = None,
    pre: str | None = None,
    f64: str | None = None,
) -> dict[str, torch.Tensor]:
    """Write `hf` as llama.cpp would; return the tensors the loader should produce (HF names, fp32)."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if bpe is not None:
        vocab = bpe.get_vocab()
        tokens = sorted(vocab, key=vocab.get)
        added = set(SPECIALS)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or ("qwen2" if arch != "llama" else "llama-bpe"))
        w.add_token_list(tokens)
        w.add_token_types([3 if t in added else 1 for t in tokens])
        w.add_token_merges([" ".join(m) for m in json.loads(bpe.to_str())["model"]["merges"]])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_bos_token_id(vocab["<|endoftext|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)

    expected: dict[str, torch.Tensor] = {}
    for name, t in _hf_state(hf).items():
        a = t.float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = _gguf_name(name)
        if gname == drop:
            continue
        stored = a
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            n = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            stored = _llamacpp_permute(a, n)
        if quantize and a.ndim == 2 and a.shape[1] % 32 == 0:
            q = gguf.quants.quantize(stored, Q8)
            w.add_tensor(gname, q, raw_dtype=Q8)
            a = _undo(gguf.quants.dequantize(q, Q8), arch, gname, cfg)
        else:
            w.add_tensor(gname, np.ascontiguousarray(stored, dtype=np.float64 if gname == f64 else np.float32))
        expected[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    if rope_freqs:  # what convert_hf_to_gguf.py writes for a llama3 rope_scaling
        w.add_tensor("rope_freqs.weight", _llama3_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cfg.tie_word_embeddings:
        expected["lm_head.weight"] = expected["embed_tokens.weight"]
    return expected


def _undo(a: np.ndarray, arch: str, gname: str, cfg: object) -> np.ndarray:
    # Reference inverse of the llama.cpp permutation, written independently of the loader's.
    if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
        n = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads  # type: ignore[attr-defined]
        return a.reshape(n, a.shape[0] // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    return a


def _llama3_factors(cfg: object, factor: float = 8.0) -> np.ndarray:
    hd = cfg.hidden_size // cfg.num_attention_heads  # type: ignore[attr-defined]
    theta = cfg.rope_parameters["rope_theta"]  # type: ignore[attr-defined]
    freqs = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / 3
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_roundtrip(tmp_path: Path, arch: str, bpe: Backend) -> None:
    hf = _hf_model(arch, tie=arch == "qwen2")
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_gguf(path, arch, hf, bpe)
    lm = load_model(str(path), dtype=torch.float32, cache_dir=str(tmp_path / "cache"), progress=False)
    cfg = lm.config
    assert cfg.arch == arch and cfg.vocab_size == 160 and cfg.num_hidden_layers == 2
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        64,
        96,
        4,
        2,
    )
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.rms_norm_eps == 1e-5  # float32 in the file, printed back as the config had it
    assert cfg.tie_word_embeddings == (arch == "qwen2")
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    _assert_same_weights(lm, expected)
    # Q8_0 loses precision, but the unpermuted q/k must still match the original HF weights closely
    ref = _hf_state(hf)
    q = "layers.0.self_attn.q_proj.weight"
    assert torch.allclose(lm.model.state_dict()[q], ref[q], atol=0.02)
    if arch == "qwen2":
        assert lm.model.lm_head.weight is lm.model.embed_tokens.weight
    assert lm.tokenizer is not None
    assert lm.tokenizer.eos_token_ids[0] == bpe.token_to_id("<|im_end|>")
    assert lm.config.eos_token_ids == lm.tokenizer.eos_token_ids


@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_0_codes_are_kept_in_the_block_modes(tmp_path: Path, arch: str, mode: str) -> None:
    """A Q8_0 file is W8A8's own format (w = d * q, d fp16 per 32): loaded in bf16 (the default), every layer
    holds the file's weights exactly, not a re-rounding of their bf16 copies (which moves ~0.4 % of the codes)."""
    from ssd.workers.models.blockquant import W8A8Linear

    hf = _hf_model(arch)
    expected = _write_gguf(tmp_path / "q8.gguf", arch, hf, None)  # fp32 dequantisation of the file's blocks
    lm = load_model(str(tmp_path / "q8.gguf"), dtype=torch.bfloat16, cache_dir=str(tmp_path / "c"), progress=False,
                    quantization=mode)
    mods = dict(lm.model.named_modules())
    for i in range(lm.config.num_hidden_layers):
        parts = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 "self_attn.o_proj": ["self_attn.o_proj"], "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
                 "mlp.down_proj": ["mlp.down_proj"]}
        for fused, names in parts.items():
            m = mods[f"layers.{i}.{fused}"]
            want = torch.cat([expected[f"layers.{i}.{n}.weight"] for n in names])
            assert isinstance(m, W8A8Linear) and torch.equal(m.dequantize(), want), (i, fused)
    if "lm_head.weight" in expected and not lm.config.tie_word_embeddings:
        assert torch.equal(lm.model.lm_head.dequantize(), expected["lm_head.weight"])


def test_native_quantization(tmp_path: Path) -> None:
    """quantization="auto" reads a GGUF's tensor types: Q8_0 linears -> w8a8, float ones -> None (unquantised);
    Hugging Face directories, missing files and other specs -> None; the packaged aliases -> w4a8."""
    from ssd.workers.loader.load import native_quantization

    hf = _hf_model("qwen2")
    _write_gguf(tmp_path / "q8.gguf", "qwen2", hf, None)
    _write_gguf(tmp_path / "f32.gguf", "qwen2", hf, None, quantize=False)
    assert native_quantization(str(tmp_path / "q8.gguf")) == "w8a8"
    assert native_quantization(str(tmp_path / "f32.gguf")) is None
    hf.save_pretrained(tmp_path / "hf")
    assert native_quantization(str(tmp_path / "hf")) is None
    assert native_quantization(str(tmp_path / "missing.gguf")) is None
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    assert native_quantization(str(tmp_path / "junk.gguf")) is None  # loading it raises, not the Config
    assert native_quantization("qwen-coder-1.5b") == "w4a8" and native_quantization("llama-70b") is None


def test_gguf_cache_second_load(tmp_path: Path, bpe: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _hf_model("llama")
    path = tmp_path / "m.gguf"
    expected = _write_gguf(path, "llama", hf, bpe)
    cache = tmp_path / "cache"
    first = load_model(str(path), dtype=torch.float32, cache_dir=str(cache), progress=False)
    files = sorted(p.name for p in cache.iterdir())
    assert any(f.endswith("-f32.safetensors") for f in files) and not any(".tmp" in f for f in files)
    mtimes = {p: p.stat().st_mtime_ns for p in cache.iterdir()}

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("cache hit must not read or dequantise the GGUF")

    monkeypatch.setattr(gguf.quants, "dequantize", boom)
    monkeypatch.setattr(gguf, "GGUFReader", boom)
    second = load_model(str(path), dtype=torch.float32, cache_dir=str(cache), progress=False)
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == mtimes
    assert second.config == first.config
    _assert_same_weights(second, expected)
    assert second.tokenizer is not None and first.tokenizer is not None
    for text in TEXTS:
        assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == CHAT_TEMPLATE
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids

    # another dtype is another cache entry (and needs the GGUF again)
    monkeypatch.undo()
    third = load_model(str(path), dtype=torch.bfloat16, cache_dir=str(cache), progress=False)
    assert any(p.name.endswith("-bf16.safetensors") for p in cache.iterdir())
    assert all(p.dtype == torch.bfloat16 for p in third.model.parameters())

    # SSD_CACHE_DIR is the default cache
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path / "envcache"))
    load_model(str(path), dtype=torch.float32, progress=False)
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "envcache").iterdir())


def test_gguf_llama3_rope_freqs_and_no_tokenizer(tmp_path: Path) -> None:
    hf = _hf_model("llama")
    path = tmp_path / "r.gguf"
    expected = _write_gguf(path, "llama", hf, None, quantize=False, rope_freqs=True)
    lm = load_model(str(path), dtype=torch.float32, cache_dir=str(tmp_path), progress=False)
    assert lm.tokenizer is None
    rs = lm.config.rope_scaling
    assert rs is not None and rs["rope_type"] == "llama3" and rs["factor"] == pytest.approx(8.0)
    assert rs["original_max_position_embeddings"] == 8192
    _assert_same_weights(lm, expected)  # unquantised: exact, including the un-permuted q/k


def test_gguf_errors_and_stale_cache(tmp_path: Path) -> None:
    hf = _hf_model("qwen2")
    path = tmp_path / "drop.gguf"
    _write_gguf(path, "qwen2", hf, None, quantize=False, drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(path), cache_dir=str(tmp_path / "c"), progress=False)
    _write_gguf(tmp_path / "f64.gguf", "qwen2", hf, None, quantize=False, f64="blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match="tensor blk.0.ffn_up.weight has GGUF type F64, which this loader cannot"):
        load_model(str(tmp_path / "f64.gguf"), cache_dir=str(tmp_path / "c"), progress=False)

    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        load_model(str(tmp_path / "gemma.gguf"), cache_dir=str(tmp_path / "c"), progress=False)

    # a corrupt cache entry is rebuilt, with a warning, instead of failing the load
    path = tmp_path / "ok.gguf"
    expected = _write_gguf(path, "qwen2", hf, None, quantize=False)
    load_model(str(path), dtype=torch.float32, cache_dir=str(tmp_path / "c"), progress=False)
    (manifest,) = [p for p in (tmp_path / "c").glob("*.json")]
    manifest.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cache entry"):
        lm = load_model(str(path), dtype=torch.float32, cache_dir=str(tmp_path / "c"), progress=False)
    _assert_same_weights(lm, expected)
    assert json.loads(manifest.read_text())["config"]["arch"] == "qwen2"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # pre-tokenizer "qwen2" / "llama-bpe"
def test_gguf_tokenizer_matches_transformers(tmp_path: Path, bpe: Backend, arch: str) -> None:
    path = tmp_path / "t.gguf"
    _write_gguf(path, arch, _hf_model(arch), bpe, quantize=False)
    ours = Tokenizer.from_gguf(str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        if arch == "qwen2":  # the vocabulary was trained with Qwen2's split regex
            assert ids == bpe.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert len(ours.encode("<|im_start|>")) == 1
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_gguf_unknown_pre_tokenizer_is_refused(tmp_path: Path, bpe: Backend) -> None:
    """Another split regex would give other ids than the model's own tokenizer: no tokenizer, with a warning
    (the model still runs on token ids), rather than GPT-2's regex in silence."""
    path = tmp_path / "t.gguf"
    _write_gguf(path, "qwen2", _hf_model("qwen2"), bpe, quantize=False, pre="tekken")
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'tekken'"):
        Tokenizer.from_gguf(str(path))
    with pytest.warns(UserWarning, match="no tokenizer loaded.*tekken"):
        lm = load_model(str(path), dtype=torch.float32, cache_dir=str(tmp_path / "c"), progress=False)
    assert lm.tokenizer is None


# ---------------------------------------------------------------------------------------------------------
# aliases


def test_unknown_alias_lists_aliases(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        load_model("no-such-model", progress=False)
    for alias in ALIASES:
        assert alias in str(e.value)
    assert isinstance(e.value, FileNotFoundError)  # ModelNotFoundError is both


def test_absent_hf_alias_is_offline_and_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as e:
        load_model("llama-70b", progress=False)
    msg = str(e.value)
    assert "'llama-70b' (meta-llama/Llama-3.1-70B-Instruct) not found locally" in msg
    assert "huggingface-cli download meta-llama/Llama-3.1-70B-Instruct" in msg


def test_hf_alias_from_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B"
    snap = repo / "snapshots" / "abc123"
    hf = _hf_model("qwen3", tie=True)
    hf.save_pretrained(snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_alias("qwen3-0.6b") == str(snap)
    assert resolve_alias("Qwen/Qwen3-0.6B") == str(snap)  # a cached repo id works too
    lm = load_model("qwen3-0.6b", dtype=torch.float32, progress=False)
    assert lm.name == "qwen3-0.6b" and lm.config.qk_norm and lm.config.tie_word_embeddings


def _fake_parts(root: Path, prefix: str, chunks: list[bytes]) -> None:
    for i, chunk in enumerate(chunks, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (pkg / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            f"    here = os.path.dirname(os.path.abspath(__file__))\n"
            f"    return os.path.join(here, 'data', 'part{i:02d}.bin')\n"
        )


def test_pypi_parts_assembly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [bytes([i]) * (i + 3) for i in range(1, 12)]  # 11 parts: part10 must follow part9
    _fake_parts(tmp_path / "site", "ssdtest_fake_part", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    total = sum(map(len, chunks))
    monkeypatch.setitem(load.PYPI_ALIASES, "fake-coder", load._PartsSpec("ssdtest_fake_part", 11, total))
    out = Path(resolve_alias("fake-coder", cache_dir=str(tmp_path / "cache")))
    assert out == tmp_path / "cache" / "fake-coder.gguf"
    assert out.read_bytes() == b"".join(chunks)
    mtime = out.stat().st_mtime_ns
    assert resolve_alias("fake-coder", cache_dir=str(tmp_path / "cache")) == str(out)
    assert out.stat().st_mtime_ns == mtime  # assembled once

    monkeypatch.setitem(load.PYPI_ALIASES, "bad-size", load._PartsSpec("ssdtest_fake_part", 11, total + 1))
    with pytest.raises(ValueError, match="bytes"):
        resolve_alias("bad-size", cache_dir=str(tmp_path / "cache"))

    monkeypatch.setitem(load.PYPI_ALIASES, "missing", load._PartsSpec("ssdtest_not_installed_part", 3, 10))
    with pytest.raises(ModelNotFoundError, match=r"pip install 'ssd\[models\]'"):
        load_model("missing", cache_dir=str(tmp_path / "cache"), progress=False)
    assert not any(p.name.startswith("missing") for p in (tmp_path / "cache").iterdir())
    for i in range(1, 12):
        sys.modules.pop(f"ssdtest_fake_part{i}", None)


def test_aliases_table() -> None:
    assert ALIASES["llama-70b"] == "meta-llama/Llama-3.1-70B-Instruct"
    assert ALIASES["llama-8b"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert ALIASES["llama-1b"] == "meta-llama/Llama-3.2-1B-Instruct"
    assert ALIASES["qwen3-32b"] == "Qwen/Qwen3-32B" and ALIASES["qwen3-0.6b"] == "Qwen/Qwen3-0.6B"
    assert {"qwen-coder-1.5b", "qwen-coder-0.5b"} <= set(ALIASES)
    assert os.fspath(resolve_alias(__file__)) == __file__  # an existing path passes through


def test_quantised_codes_cache_failures_only_cost_time(tmp_path):
    """The quantised-codes cache, as the dequantised weights' one: an unwritable directory or a truncated
    entry gives a warning and the same model, never a failed load."""
    path = tmp_path / "m.gguf"
    _write_gguf(path, "qwen2", _hf_model("qwen2"), None)
    good = tmp_path / "cache"
    ref = load_model(str(path), dtype=torch.float32, cache_dir=str(good), progress=False, quantization="int4")

    def same(lm) -> bool:
        a, b = ref.model.state_dict(), lm.model.state_dict()
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    (tmp_path / "file").write_text("x")
    with pytest.warns(UserWarning, match="could not write the quantised-codes cache"):
        lm = load_model(str(path), dtype=torch.float32, cache_dir=str(tmp_path / "file" / "c"), progress=False,
                        quantization="int4")
    assert same(lm)
    meta = next(good.glob("*-codes.json"))
    meta.write_text('{"format": 3, "ty')  # a writer killed mid-file
    with pytest.warns(UserWarning, match="unreadable quantised-codes cache entry"):
        lm = load_model(str(path), dtype=torch.float32, cache_dir=str(good), progress=False, quantization="int4")
    assert same(lm)
    assert json.loads(meta.read_text())["types"]  # rewritten
