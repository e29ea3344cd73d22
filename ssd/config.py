"""One dataclass with every engine setting."""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from ssd.sampling_params import is_int
from ssd.workers.draft_worker import CANDIDATE_VOCABS
from ssd.workers.loader.load import native_quantization
from ssd.workers.models.dense import LINEAR_KERNELS
from ssd.workers.models.quant import BLOCK_MODES, QUANT_MODES

log = logging.getLogger("ssd.config")

MODES = ("ar", "sd", "ngram", "ssd", "auto")
BACKUPS = ("auto", "neural", "ngram", "random")
FANOUT_KINDS = ("geometric", "uniform")
QUANTIZATIONS = (None, *QUANT_MODES)


@dataclass
class Config:
    target: Any  # alias, path, or a DecoderModel (tests)
    draft: Any = None
    mode: str | None = None  # default: "auto" with a draft, else "ar"
    device: str = "cpu"
    draft_device: str | None = None
    dtype: str = "bfloat16"
    # None, "int8"/"int4" (weight-only) or "w4a8"/"w8a8"/"w4a8-all"/"w4a8-g64" (int8 activations, CPU). "auto":
    # a quantised GGUF target on CPU runs as its file is quantised (`native_quantization`: "w4a8" for the
    # packaged Q4_K_M files, which keeps their 4-, 5- and 6-bit codes), anything else unquantised (None).
    quantization: str | None = "auto"
    # The draft's own quantisation: any draft keeps the output lossless, so a cheaper draft (e.g. w4a8 under a
    # bf16 target) only changes the speed. "auto": "w4a8-g64" under a "w4a8" target (4 bits in every layer, the
    # output layer too, a scale per 64 weights: on CPU the draft's forwards share the memory path with the
    # target's) and for a quantised GGUF draft on CPU under an unquantised target, else the target's; "same":
    # the target's.
    draft_quantization: str | None = "auto"
    # Restrict the draft's output layer to the first `draft_vocab` token ids (+ end-of-sequence): a cheaper
    # draft step, still lossless (verification uses the restricted q); None = the whole vocabulary.
    draft_vocab: int | None = None
    # With draft_vocab: each sequence's draft may also propose the tokens of its own prompt and output (on
    # HumanEval nearly all the target's tokens outside the first 32768 ids: identifiers, code fences).
    draft_vocab_context: bool = True
    linear_kernel: str = "auto"  # unquantised CPU linears: "dense" (C kernel, batch invariant), "torch", "auto"
    cuda_graphs: bool = True  # on CUDA, replay captured graphs for decode, verification and tree steps
    k: int | None = None  # draft length; None = chosen from measured latencies
    # mode="ar": tokens decoded per call to the target worker (one actor round trip per call, not per token;
    # new requests wait for the call to end). Same tokens and random draws as one per call.
    ar_steps: int = 4
    # SSD budget B (int) or explicit F_0..F_K; None: chosen from measured latencies (for a given k too)
    fanout: int | list[int] | None = None
    fanout_kind: str = "geometric"  # or "uniform"
    # How greedy rows spend SSD's budget B: "ranked" on the B outcomes (k, t*) the draft finds likeliest
    # (its probability of x_1..x_k, then t*), "quota" on F_k candidates per k as the fan-out gives them.
    # Sampled rows and an explicit fan-out list always use the quotas.
    candidates: str = "ranked"
    # With draft_vocab: the ids SSD ranks its candidates t* over: "draft", the ids the draft proposes, or
    # "full", the whole vocabulary (also predicts target tokens outside them, for one full output-layer row
    # per round).
    candidate_vocab: str = "draft"
    saguaro_c: float = 1.0  # Saguaro sampling coefficient (1.0 = plain draft sampling)
    # Greedy drafts also feed up to this many prompt-lookup guesses per forward; each guess the draft agrees
    # with is a draft token without a forward of its own (same tokens as drafting one by one). 0 = off.
    draft_lookahead: int = 3
    # With K auto-configured, greedy plain drafts (SD, and auto's SD rounds) run up to the longest K and stop
    # once the draft's confidence says another forward is worth less than its time (DraftWorker._worth).
    draft_gate: bool = True
    backup: str = "auto"
    # A draft call still unanswered after this many seconds counts as a hung draft: rounds go on without it
    # (exact either way) while a fresh draft actor replaces it. None waits forever.
    draft_timeout_s: float | None = 60.0
    # A target call still unanswered after this many seconds counts as a lost target: the running requests
    # fail with that error and a fresh target actor replaces it (in-process: the engine refuses new work).
    # None (the default) waits forever: a long prompt's prefill can legitimately take minutes on CPU.
    target_timeout_s: float | None = None
    max_batch: int = 8
    max_len: int = 2048
    ngram_max: int = 4
    target_threads: int | None = None
    draft_threads: int | None = None
    target_cores: list[int] | None = None
    draft_cores: list[int] | None = None
    # mode="auto" on CPU with target and draft pinned to their own cores: in rounds where the draft has
    # nothing to do (AR, SD verification, n-gram) the target also computes on the draft's cores, and
    # while the target waits for a just-in-time draft (SD, a neural backup) the draft on the target's.
    core_loans: bool = True
    # Keep auto-configuration's measurements between starts (ssd/autoconfig_cache.py): a start with the same
    # models, settings and machine re-times one forward per worker and reuses them if it matches.
    autoconfig_cache: bool = True
    # Workers as Ray actors (each pinned to its cores or GPU; on CPU `auto` then lends cores between them).
    # False: both in this process, on threads, without core loans. None picks Ray for ssd/auto with a draft on
    # CPU (2 cores, session 41: `auto` at ~50 tok/s in one process against ~67 over Ray) and with ray_address;
    # in this process otherwise (SD is as fast there, and nothing starts Ray for AR).
    use_ray: bool | None = None
    ray_address: str | None = None
    # Calls to actors on the coordinator's node go over a Unix socket they serve (launch/channel.py), not
    # Ray's task path (~2 ms less per call); False keeps Ray's calls. Actors on other nodes always use Ray's.
    ray_channel: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    # Set when use_ray=None chose Ray: if another engine holds Ray's CPUs, this one runs in this process instead.
    ray_by_default: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.target is None:
            raise ValueError("target is required: a model alias, a path, or a DecoderModel")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {self.extra!r}")
        for name in ("device", "draft_device"):
            d = getattr(self, name)
            if not (d is None and name == "draft_device") and not is_device_name(d):
                raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {d!r}")
        for name in ("target_threads", "draft_threads"):
            n = getattr(self, name)
            if n is not None and not (is_int(n) and n >= 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {n!r}")
        if self.mode is None:
            self.mode = "auto" if self.draft is not None else "ar"
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.mode in ("sd", "ssd") and self.draft is None:
            raise ValueError(f"mode {self.mode!r} needs a draft model (draft=...)")
        if self.backup not in BACKUPS:
            raise ValueError(f"unknown backup {self.backup!r}; choose from {', '.join(BACKUPS)}")
        if self.k is not None and not (is_int(self.k) and 1 <= self.k <= 32):
            raise ValueError(f"k must be an integer in 1..32, got {self.k!r}")
        f = self.fanout
        if isinstance(f, list):
            if not f or not all(is_int(x) and x >= 0 for x in f) or sum(f) < 1:
                raise ValueError(f"fanout as a list gives F_0..F_K: integers >= 0 with a positive sum, got {f!r}")
            if self.k is not None and len(f) != self.k + 1:
                raise ValueError(f"fanout lists F_0..F_K: {self.k + 1} entries for k={self.k}, got {len(f)}")
            if len(f) < 2:
                raise ValueError(f"fanout as a list gives F_0..F_K with K >= 1: at least 2 entries, got {f!r} "
                                 "(a budget B is a plain integer)")
            if self.k is None:
                self.k = len(f) - 1  # the list fixes K
        elif f is not None and not (is_int(f) and f >= 1):
            raise ValueError(f"fanout must be a budget B >= 1, a list F_0..F_K or None, got {f!r}")
        if self.fanout_kind not in FANOUT_KINDS:
            raise ValueError(f"fanout_kind must be one of {', '.join(FANOUT_KINDS)}, got {self.fanout_kind!r}")
        if not (is_int(self.ngram_max) and self.ngram_max >= 1):
            raise ValueError(f"ngram_max must be an integer >= 1, got {self.ngram_max!r}")
        if isinstance(self.saguaro_c, bool) or not isinstance(self.saguaro_c, (int, float)) or not (
                0.0 <= self.saguaro_c <= 1.0):
            raise ValueError(f"saguaro_c must be in [0, 1], got {self.saguaro_c}")
        if not (is_int(self.draft_lookahead) and 0 <= self.draft_lookahead <= 16):
            raise ValueError(f"draft_lookahead must be an integer in 0..16, got {self.draft_lookahead!r}")
        if self.use_ray is None:
            on_cpu = self.device == "cpu" and (self.draft_device or "cpu") == "cpu"
            speculates_ahead = self.draft is not None and self.mode in ("ssd", "auto")
            tensor_parallel = self.extra.get("target_tp", 1) != 1  # its ranks are Ray actors
            self.use_ray = bool(self.ray_address) or tensor_parallel or (on_cpu and speculates_ahead)
            self.ray_by_default = self.use_ray and not tensor_parallel
        if not isinstance(self.use_ray, bool):
            raise ValueError(f"use_ray must be True, False or None, got {self.use_ray!r}")
        if self.ray_address and not self.use_ray:
            raise ValueError(f"ray_address={self.ray_address!r} joins a Ray cluster; it needs use_ray (not False)")
        if not isinstance(self.ray_channel, bool):
            raise ValueError(f"ray_channel must be True or False, got {self.ray_channel!r}")
        if not isinstance(self.autoconfig_cache, bool):
            raise ValueError(f"autoconfig_cache must be True or False, got {self.autoconfig_cache!r}")
        for name in ("draft_timeout_s", "target_timeout_s"):
            self._check_timeout(name)
        for name in ("target_cores", "draft_cores"):
            self._check_cores(name)
        if not (is_int(self.max_batch) and self.max_batch >= 1):
            raise ValueError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        if not (isinstance(self.max_len, int) and self.max_len >= 2):
            raise ValueError(f"max_len must be an integer >= 2 (tokens of context), got {self.max_len!r}")
        if self.k is None and self.draft is not None and self.mode in ("sd", "ssd", "auto"):
            from ssd.autoconfig import K_CHOICES  # auto-configuration times forwards of up to max(K) + 1 tokens

            if self.max_len < max(K_CHOICES) + 2:
                raise ValueError(f"max_len {self.max_len} is too short to auto-configure k (it times drafts of up "
                                 f"to {max(K_CHOICES)} tokens): use max_len >= {max(K_CHOICES) + 2} or give k")
        if not (is_int(self.ar_steps) and 1 <= self.ar_steps <= 64):
            raise ValueError(f"ar_steps must be an integer in 1..64, got {self.ar_steps!r}")
        if self.dtype not in ("bfloat16", "bf16", "float32", "fp32"):
            raise ValueError(f"unsupported dtype {self.dtype!r}; use bfloat16 or float32")
        if self.quantization == "auto":
            self.quantization = auto_quantization(self.target, self.device)
        if self.quantization not in QUANTIZATIONS:  # before the draft's "auto" / "same" copy it
            raise ValueError(f"unknown quantization {self.quantization!r}; use 'auto', None or one of "
                             f"{', '.join(QUANT_MODES)}")
        if self.draft_quantization == "auto":
            draft_device = self.draft_device or self.device
            # An unquantised target (e.g. quantization=None for its bf16 weights) with a quantised GGUF draft on
            # CPU: the draft still runs in 4 bits, since no draft changes the output.
            quantised_draft = self.quantization is None and auto_quantization(self.draft, draft_device) is not None
            if self.quantization == "w4a8" or quantised_draft:
                self.draft_quantization = "w4a8-g64"
            else:
                self.draft_quantization = self.quantization
            if not _on_cpu(draft_device) and self.draft_quantization in BLOCK_MODES:
                self.draft_quantization = None  # the block kernels run on CPU only
        elif self.draft_quantization == "same":
            self.draft_quantization = self.quantization
        if self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(
                f"unknown draft_quantization {self.draft_quantization!r}; use 'auto', 'same', None or one of "
                f"{', '.join(QUANT_MODES)}"
            )
        if self.candidates not in ("ranked", "quota"):
            raise ValueError(f"candidates must be 'ranked' or 'quota', got {self.candidates!r}")
        if self.candidate_vocab not in CANDIDATE_VOCABS:
            raise ValueError(
                f"candidate_vocab must be one of {', '.join(CANDIDATE_VOCABS)}, got {self.candidate_vocab!r}")
        if self.draft_vocab is not None and not (is_int(self.draft_vocab) and self.draft_vocab >= 1):
            raise ValueError(f"draft_vocab must be a positive integer or None, got {self.draft_vocab!r}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"unknown linear_kernel {self.linear_kernel!r}; use one of {', '.join(LINEAR_KERNELS)}")


    def _check_timeout(self, name: str) -> None:
        t = getattr(self, name)
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"{name} must be a number of seconds > 0 or None, got {t!r}")
        if t is not None and math.isinf(t):
            setattr(self, name, None)  # waits forever (a future's wait cannot take an infinite timeout)
        elif t is not None and t > threading.TIMEOUT_MAX:
            raise ValueError(f"{name} must be at most {threading.TIMEOUT_MAX:.0f} s, or None (or inf) to "
                             f"wait forever, got {t!r}")

    def _check_cores(self, name: str) -> None:
        cores = getattr(self, name)
        if cores is None:
            return
        if not isinstance(cores, (list, tuple)) or not cores or not all(is_int(c) and c >= 0 for c in cores):
            raise ValueError(f"{name} must be a non-empty list of core ids, got {cores!r}")
        setattr(self, name, list(cores))

    def check_cores_exist(self, available: list[int]) -> None:
        """Cores named for workers on this machine must be among `available` (this process's)."""
        for name in ("target_cores", "draft_cores"):
            missing = sorted(set(getattr(self, name) or ()) - set(available))
            if missing:
                raise ValueError(f"{name}: cores {missing} are not among this process's cores {sorted(available)}")


def auto_quantization(target: Any, device: str) -> str | None:
    """`quantization="auto"`: the target file's own block mode on CPU where the kernels run, else None."""
    if not _on_cpu(device) or not isinstance(target, str):
        return None
    mode = native_quantization(target)
    if mode is None:
        return None
    from ssd.kernels import cpu as cpu_kernels

    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        log.warning("quantization='auto': %s is quantised, but the CPU block kernels cannot run here (%s); "
                    "running it unquantised", target, reason)
        return None
    return mode


def _on_cpu(device: str) -> bool:
    return str(device).split(":")[0] == "cpu"


def is_device_name(d: object) -> bool:
    """'cpu', 'cuda', or either with ':N' (whether that GPU exists is the worker's to find out)."""
    if not isinstance(d, str):
        return False
    kind, _, index = d.partition(":")
    return kind in ("cpu", "cuda") and (index == "" and ":" not in d or index.isdigit())
