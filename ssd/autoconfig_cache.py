"""Auto-configuration's measurements kept between starts, keyed by everything that sets them.

Measuring the latencies `autoconfigure` needs takes ~7 s of an `auto` start on the real pair on CPU. A start
whose key matches a stored entry re-times one forward of each worker (~1 s) and keeps the stored prices if both
are within `TOLERANCE` of the stored ones; otherwise (the machine in another speed phase, a changed build) it
measures everything again and replaces the entry. Stored prices are only a starting point either way: the
tuners and the policy correct them from every round's measured times.

The entries live in `$SSD_AUTOCONFIG_CACHE` (a directory; "off" disables the cache) or
`~/.cache/ssd/autoconfig` (`$XDG_CACHE_HOME` respected); `Config.autoconfig_cache=False` skips it for one engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ssd.autoconfig import AutoConfig
from ssd.config import Config
from ssd.handles import WorkerHandle
from ssd.sampling_params import is_int

log = logging.getLogger("ssd")

TOLERANCE = 0.15  # a re-timed forward further than this from its stored time invalidates the entry
FORMAT = 1  # bump when AutoConfig or the measurements change meaning


def kernel_sources() -> Path:
    """The CPU kernels' source folder: `kernels/cpu` in a checkout, `ssd/kernels/cpu` in an installed wheel."""
    spec = importlib.util.find_spec("ssd.kernels.cpu")
    assert spec is not None and spec.origin is not None, "ssd.kernels.cpu is part of the package"
    return Path(spec.origin).parent


def cache_dir() -> Path | None:
    """Where entries live; None when `$SSD_AUTOCONFIG_CACHE` is "off" (or "0")."""
    env = os.environ.get("SSD_AUTOCONFIG_CACHE")
    if env is not None and env.strip().lower() in ("off", "0", ""):
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "ssd" / "autoconfig"


def machine() -> dict[str, str]:
    """The CPU and the kernels' sources and build: a different CPU or kernel build prices forwards differently.
    A VM's `model name` can be as generic as "AMD EPYC", so the family, model and flags count too."""
    cpu = {"name": platform.processor()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in cpu:
                cpu[key] = value.strip()
            elif not line.strip() and len(cpu) > 1:  # the first processor's block is enough
                break
    except OSError:
        pass
    flags = cpu.pop("flags", "")
    described = " / ".join(cpu[k] for k in ("model name", "cpu family", "model") if k in cpu) or cpu["name"]
    digest = hashlib.sha256()
    for f in sorted(kernel_sources().glob("*")):
        if f.suffix in (".cpp", ".h", ".py"):
            digest.update(f.name.encode() + f.read_bytes())
    # the environment that picks the compiled library (kernels/cpu): instruction set and compiler
    for var in ("SSD_CPU_ISA", "CXX"):
        digest.update(f"{var}={os.environ.get(var, '')}".encode())
    return {"cpu": described, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "cpus": str(os.cpu_count()), "kernels": digest.hexdigest()[:16]}


def model_identity(spec: Any) -> dict[str, Any] | None:
    """A model given by name or path: its resolved path, size and modification time (a directory's: of its
    config and weight files, which can change in place without the directory's own changing); None for anything
    else (an in-memory model has no identity that outlives the process)."""
    if not isinstance(spec, str):
        return None
    from ssd.workers.loader import resolve_alias

    try:
        path = Path(resolve_alias(spec))
        st = path.stat()
        files = sorted(p for p in path.iterdir() if p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES
                       ) if path.is_dir() else []
        contents = [(p.name, s.st_size, s.st_mtime_ns) for p, s in ((p, p.stat()) for p in files)]
    except (OSError, ValueError):
        return None
    return {"spec": spec, "path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "files": contents}


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_TIMING_TABLES = ("t_verify", "t_draft", "t_chain", "t_borrowed", "t_verify_busy")  # token count -> seconds


# Config fields that set what autoconfigure measures: the models' formats, devices, cores and threads, the
# probe context's room (max_len) and the layout (a worker in this process shares its OpenMP runtime).
_KEY_FIELDS = ("dtype", "quantization", "draft_quantization", "draft_vocab", "draft_vocab_context", "candidate_vocab",
               "linear_kernel", "cuda_graphs", "device", "draft_device", "target_cores", "draft_cores",
               "target_threads", "draft_threads", "core_loans", "use_ray", "max_len", "extra")


def autoconfig_key(cfg: Config, target: WorkerHandle, draft: WorkerHandle, flags: dict[str, Any]
                   ) -> dict[str, Any] | None:
    """What an engine's measurements depend on; None if they cannot be stored (the cache is off for this
    engine, or a model is not a named file or directory)."""
    if not cfg.autoconfig_cache:
        return None
    models = [model_identity(cfg.target), model_identity(cfg.draft)]
    if None in models:
        return None
    return {"models": models, "config": {f: getattr(cfg, f) for f in _KEY_FIELDS}, "flags": flags,
            "workers": [_worker_key(h.call("info").result()) for h in (target, draft)]}


# What a worker's info says about its forwards' speed (not its process or node, which change every start).
_INFO_FIELDS = ("arch", "vocab_size", "max_len", "num_threads", "borrow_threads", "cuda_graphs", "linear_kernel")


def _worker_key(info: dict[str, Any]) -> dict[str, Any]:
    return {f: info.get(f) for f in _INFO_FIELDS}


def cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _load(path: Path) -> tuple[AutoConfig, dict[str, float]] | None:
    try:
        entry = json.loads(path.read_text())
        if entry.get("format") != FORMAT:
            return None
        fields = entry["config"]
        for name, value in fields.items():  # JSON keys are strings: token counts back to int
            if isinstance(value, dict):
                fields[name] = {int(n): float(t) for n, t in value.items()}
        check = {k: float(v) for k, v in entry["check"].items()}
        ac = AutoConfig(**fields)
        shaped = (set(check) == {"target", "draft"} and is_int(ac.k) and is_int(ac.budget)
                  and all(isinstance(getattr(ac, f), dict) or getattr(ac, f) is None for f in _TIMING_TABLES)
                  and isinstance(ac.t_verify, dict) and isinstance(ac.t_draft, dict)
                  and all(isinstance(getattr(ac, f), float) for f in ("t_draft1", "t_step")))
        return (ac, check) if shaped else None  # JSON of another shape: measured again
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable, or JSON of another shape
        return None


def _store(path: Path, ac: AutoConfig, check: dict[str, float], parts: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "config": dataclasses.asdict(ac), "check": check, "key": parts},
                                  default=str))
        tmp.replace(path)  # atomic: a concurrent start reads the old entry or the new one
    except OSError as e:
        log.warning("auto-config: could not store the measurements in %s (%s)", path, e)


def _check(target: WorkerHandle, draft: WorkerHandle) -> dict[str, float]:
    """One forward of each worker, timed as autoconfigure times them."""
    t_target = target.call("time_forwards", [1]).result()[1]
    t_draft = draft.call("time_forwards", [1]).result()[1]
    for f in [target.call("release_probe"), draft.call("release_probe")]:
        f.result()
    return {"target": t_target, "draft": t_draft}


def cached_autoconfigure(
    parts: dict[str, Any] | None, target: WorkerHandle, draft: WorkerHandle, measure: Callable[[], AutoConfig],
) -> AutoConfig:
    """`measure()`'s AutoConfig, or the stored one for `parts` (the key) if a re-timed forward of each worker
    still matches it. `parts` None, or no cache directory: always measure."""
    where = cache_dir()
    if parts is None or where is None:
        return measure()
    path = where / f"{cache_key({**parts, 'machine': machine(), 'format': FORMAT})}.json"
    stored = _load(path) if path.is_file() else None
    if stored is not None:
        ac, check = stored
        now = _check(target, draft)
        drift = {k: now[k] / check[k] - 1 for k in check if check[k] > 0}
        if len(drift) == 2 and all(abs(d) <= TOLERANCE for d in drift.values()):
            log.info("auto-config: stored measurements reused (%s; one forward each now %s of then)", path.name,
                     {k: f"{1 + d:.2f}x" for k, d in drift.items()})
            return ac
        log.info("auto-config: stored measurements stale (one forward each now %s of then): measuring again",
                 {k: f"{1 + d:.2f}x" for k, d in drift.items()})
    ac = measure()
    _store(path, ac, {"target": ac.t_verify[1], "draft": ac.t_step}, parts)
    return ac
