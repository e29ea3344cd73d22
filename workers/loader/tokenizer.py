"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` with the bits a decoding runtime needs.

Two sources:
  * a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json` [+ `generation_config.json`]),
  * GGUF metadata (`tokenizer.ggml.*`), rebuilt as the byte-level BPE llama.cpp and transformers use.

Special tokens are never added by `encode` except a BOS the checkpoint asks for (Llama-3 style); chat
templates are rendered with a sandboxed Jinja environment set up like transformers' one.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

# llama.cpp's token_type values (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer split regexes, keyed by `tokenizer.ggml.pre`; the same as llama.cpp's llama-vocab.cpp and
# transformers' gguf_tokenizer_mapping.py (and the `Split` regex in each model's own tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# llama.cpp sets ignore_merges for these (a word that is itself a vocab entry is taken whole), as do the
# models' own tokenizer.json files.
_IGNORE_MERGES_PRE = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "pixtral", "llama4"}
# Control tokens llama.cpp also treats as end-of-generation when the file does not list them
# (llama-vocab.cpp).
_EOG_TEXTS = {
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are spelled in)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class Tokenizer:
    """Encode/decode text and render chat templates.

    `eos_token_ids` lists every id that ends generation (first = the primary EOS); `add_bos` says whether
    `encode` prepends `bos_token_id` (only when the checkpoint asks for it).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        eos_token_ids: list[int],
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.bos_token = bos_token if bos_token is not None else self._token_text(bos_token_id)
        self.eos_token = (
            eos_token
            if eos_token is not None
            else self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None)
        )

    # -- basic API ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a server's other threads run meanwhile
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        # A rendered chat template often already starts with BOS; don't double it (llama.cpp warns on that).
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` the way transformers' `apply_chat_template(tokenize=False)` does."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (none in tokenizer_config.json / chat_template.jinja / "
                "GGUF tokenizer.chat_template); encode the raw prompt instead"
            )
        template = _compile_template(self.chat_template)
        # transformers passes tools and documents as None when not given: templates test `is not none`
        kwargs = {"tools": None, "documents": None, **kwargs}
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    # -- persistence (used by the GGUF conversion cache) --------------------------------------------

    def save(self, tokenizer_json: str | os.PathLike[str], meta_json: str | os.PathLike[str]) -> None:
        Path(tokenizer_json).write_text(self.backend.to_str())
        Path(meta_json).write_text(json.dumps(self.metadata()))

    def metadata(self) -> dict[str, Any]:
        """Everything besides the backend that `load` needs (JSON-serialisable)."""
        return {
            "eos_token_ids": self.eos_token_ids,
            "bos_token_id": self.bos_token_id,
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }

    @classmethod
    def load(cls, tokenizer_json: str | os.PathLike[str], meta_json: str | os.PathLike[str]) -> Tokenizer:
        meta = json.loads(Path(meta_json).read_text())
        return cls(_Backend.from_file(str(tokenizer_json)), **meta)

    # -- constructors ------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a Hugging Face model directory; `tokenizer.json` is required."""
        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        backend = _Backend.from_file(str(tok_file))
        tcfg = _read_json(d / "tokenizer_config.json")
        gcfg = _read_json(d / "generation_config.json")
        mcfg = _read_json(d / "config.json")

        def special(name: str) -> str | None:
            v = tcfg.get(name)
            return v.get("content") if isinstance(v, dict) else v

        bos_token, eos_token = special("bos_token"), special("eos_token")
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        if bos_id is None:
            bos_id = gcfg.get("bos_token_id", mcfg.get("bos_token_id"))
        eos_ids: list[int] = []
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos_ids.append(backend.token_to_id(eos_token))
        for cfg in (
            gcfg,
            mcfg,
        ):  # generation_config lists the extra stop ids (e.g. <|eot_id|>, <|endoftext|>)
            e = cfg.get("eos_token_id")
            eos_ids += [] if e is None else ([e] if isinstance(e, int) else list(e))

        # BOS: trust what the tokenizer.json post-processor does (Llama-3 adds <|begin_of_text|> there).
        with_sp = backend.encode("a", add_special_tokens=True).ids
        without = backend.encode("a", add_special_tokens=False).ids
        add_bos = bool(tcfg.get("add_bos_token")) or (
            bos_id is not None and with_sp[:1] == [bos_id] and without[:1] != [bos_id]
        )

        template = tcfg.get("chat_template")
        if (d / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it on its own
            template = (d / "chat_template.jinja").read_text()
        elif template is None and (d / "chat_template.json").is_file():
            template = _read_json(d / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            chat_template=template,
            add_bos=add_bos,
            bos_token=bos_token,
            eos_token=eos_token,
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """From a `gguf.GGUFReader` (or a path to a .gguf file). Only byte-level BPE ("gpt2") is supported."""
        if isinstance(reader, (str, os.PathLike)):
            import gguf

            reader = gguf.GGUFReader(str(reader))
        meta = _GGUFFields(reader)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported"
            )
        tokens: list[str] = meta.get("tokenizer.ggml.tokens")
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges: list[str] = meta.get("tokenizer.ggml.merges") or []
        pre: str = meta.get("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZER_SPLITS and pre not in ("default", "gpt2"):
            # another split regex would give other token ids than the model's own tokenizer (llama.cpp refuses too)
            raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: "
                             f"{', '.join(sorted({*PRE_TOKENIZER_SPLITS, 'default', 'gpt2'}))}")

        # Vocab entries are spelled in GPT-2's byte alphabet; respell the odd one that is not.
        spell = _byte_alphabet()
        alphabet = set(spell.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES_PRE)
        backend = _Backend(bpe)
        split = PRE_TOKENIZER_SPLITS.get(pre)
        if split is not None:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:  # "default"/"gpt2": GPT-2's own regex, which ByteLevel applies itself
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()

        # CONTROL tokens become special (skipped by decode), USER_DEFINED ones plain added tokens; both are
        # matched whole in the text, so "<|im_start|>" is one id. A "control" token spelled outside the byte
        # alphabet is a llama.cpp mislabel and is left alone (as transformers does).
        control = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL and set(t) <= alphabet]
        user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED and t in vocab]
        if control:
            backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        if user:
            backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

        eos_ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            v = meta.get(f"tokenizer.ggml.{key}")
            if v is not None:
                eos_ids.append(int(v))
        # llama.cpp also stops on well-known end tokens the metadata does not list (Qwen's <|endoftext|>).
        eos_ids += [
            i
            for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
            if ty == _CONTROL and t in _EOG_TEXTS
        ]
        bos = meta.get("tokenizer.ggml.bos_token_id")
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            chat_template=template,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )


class _GGUFFields:
    """Typed access to GGUF metadata values (`field.contents()`), None when absent."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.contents()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    # Same environment as transformers: sandboxed, trim/lstrip blocks, loop controls, non-escaping tojson.
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
