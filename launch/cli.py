"""`ssd` / `python -m ssd.launch`: serve (default), generate, bench, submit.

    python -m ssd.launch                                     # serve qwen-coder-1.5b + qwen-coder-0.5b on CPU
    python -m ssd.launch --target llama-70b --draft llama-1b --gpus 0,1
    python -m ssd.launch generate --target DIR "def fib(n):" --max-tokens 64
    python -m ssd.launch bench ...                           # benchmarks/bench.py (source checkout)
    python -m ssd.launch submit --address http://HEAD:8265 -- generate --input p.jsonl --output out.jsonl

Usage errors (bad flags, unknown model, no CUDA for --gpus, port in use) exit with status 2 and one line
on stderr; a serve that is stopped with SIGINT/SIGTERM exits 0 after releasing its workers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("ssd.launch")

DEFAULT_TARGET = "qwen-coder-1.5b"
DEFAULT_DRAFT = "qwen-coder-0.5b"
SUBCOMMANDS = ("serve", "generate", "bench", "submit")
MODES = ("ssd", "sd", "ngram", "ar", "auto")
# quant.QUANT_MODES (not imported: no torch for --help)
QUANTIZATIONS = ("int8", "int4", "w4a8", "w8a8", "w4a8-all", "w4a8-g64")


class CLIError(Exception):
    """A usage error: printed as one line, exit status 2."""


class _Interrupted(BaseException):
    pass


# -- arguments -------------------------------------------------------------------------------------
def _fanout(s: str) -> int | list[int]:
    try:
        parts = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer budget or a comma list of integers, got {s!r}") from None
    if not parts or any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError(f"fanout must be non-negative integers, got {s!r}")
    return parts[0] if len(parts) == 1 and "," not in s else parts


def _timeout(s: str) -> float:
    if s.strip().lower() in ("none", "inf", "off"):
        return math.inf  # Config: no timeout
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'none', got {s!r}") from None


def _gpus(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gpus takes a comma list of GPU indices like 0,1, got {s!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--gpus takes a comma list of GPU indices like 0,1, got {s!r}")
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"--gpus lists a GPU twice: {s!r}")
    return ids


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2 (argparse's own usage dump is noisy)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _model_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model and placement")
    g.add_argument("--target",
                   help=f"target model: alias, HF model dir or .gguf file (default {DEFAULT_TARGET})")
    g.add_argument("--draft", help=f"draft model (default {DEFAULT_DRAFT} when --target is not given; "
                                   "'none' for no draft)")
    g.add_argument("--mode", choices=MODES, help="decoding mode (default: auto with a draft, else ar)")
    g.add_argument("--k", type=int, help="speculation length (default: engine's choice)")
    g.add_argument("--fanout", type=_fanout, help="SSD fan-out: a budget B, or F_0,...,F_K")
    g.add_argument("--saguaro-c", type=float, help="Saguaro sampling coefficient in [0, 1]")
    g.add_argument("--candidates", choices=("ranked", "quota"),
                   help="how greedy SSD rows spend the fan-out budget (default: ranked)")
    g.add_argument("--candidate-vocab", choices=("draft", "full"),
                   help="with --draft-vocab, the ids SSD ranks its candidate outcomes over (default: draft)")
    g.add_argument("--draft-lookahead", type=int,
                   help="prompt-lookup guesses a greedy draft checks per forward (default 3; 0: off)")
    g.add_argument("--draft-timeout", dest="draft_timeout_s", type=_timeout,
                   help="seconds before an unanswered draft call counts as a hung draft, replaced while decoding "
                        "goes on without it (default 60; 'none' waits forever)")
    g.add_argument("--target-timeout", dest="target_timeout_s", type=_timeout,
                   help="seconds before an unanswered target call counts as a lost target: its running requests "
                        "fail and a fresh target actor replaces it (default: none, wait forever)")
    g.add_argument("--no-draft-gate", dest="draft_gate", action="store_false", default=None,
                   help="greedy drafts always run to K instead of stopping where the draft is unsure")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "bf16", "fp32"), help="weights dtype")
    g.add_argument("--max-batch", type=int, help="max concurrent sequences in the running batch")
    g.add_argument("--max-len", type=int, help="max tokens per sequence (prompt + output)")
    g.add_argument("--device", help="cpu or cuda[:i] (default: cuda if available, else cpu)")
    g.add_argument("--gpus", type=_gpus, help="GPU ids, e.g. 0,1: the target on all but the last, the draft "
                                              "on the last (0,1,2,3,4: target TP over 0-3, draft on 4)")
    g.add_argument("--target-tp", type=int, help="tensor-parallel degree of the target")
    g.add_argument("--address", help="join an existing Ray cluster at this address")
    g.add_argument("--ray", action=argparse.BooleanOptionalAction, default=None,
                   help="run the workers as Ray actors (default: the engine's choice for the mode)")
    g.add_argument("--ray-channel", action=argparse.BooleanOptionalAction, default=None,
                   help="per-round calls to actors on this node over a Unix socket (default) or Ray's calls")
    g.add_argument("--quantization", choices=("auto", "none", *QUANTIZATIONS),
                   help="default auto: a quantised GGUF target on CPU as its file is quantised (w4a8 for the "
                        "qwen-coder pair), else none (unquantised); int8/int4: weight-only linears; w4a8/w8a8: "
                        "+ int8 activations (AVX2 kernel, fastest on CPU); "
                        "w4a8-all: w4a8 with every layer in 4 bits, the output layer too; w4a8-g64: the same with "
                        "a scale per 64 weights, rounded to nearest (a draft's format)")
    g.add_argument("--draft-quantization", choices=("auto", "same", "none", *QUANTIZATIONS),
                   help="the draft's quantisation (default auto: w4a8-g64 under a w4a8 target or for a quantised GGUF "
                        "draft under an unquantised one, else the target's; "
                        "the output stays lossless)")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft proposes only the first N token ids (+ end-of-sequence): a cheaper draft step, "
                        "still lossless")
    g.add_argument("--no-autoconfig-cache", dest="autoconfig_cache", action="store_false", default=None,
                   help="measure the latencies K and the policy start from at every start (default: reuse the last "
                        "start's when one forward of each worker still takes as long)")
    g.add_argument("--no-core-loans", dest="core_loans", action="store_false", default=None,
                   help="mode auto on CPU: keep target and draft on their own cores even while the other idles")
    g.add_argument("--linear-kernel", choices=("auto", "dense", "torch"),
                   help="unquantised CPU linears: the dense C kernel (bf16/fp32 weights, batch invariant; the "
                        "default where it builds) or torch's F.linear")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="on CUDA, run every forward eagerly instead of replaying captured graphs")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--log-json", action="store_true", help="log one JSON object per line")


def serve_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="ssd",
        description="Serve a model with lossless speculative decoding behind an OpenAI-compatible API. "
                    "Subcommands: generate (offline, streams to stdout), bench (benchmarks/bench.py), "
                    "submit (run a command as a Ray job). `ssd SUBCOMMAND --help` for each.",
        epilog="examples: ssd --target llama-70b --draft llama-1b --gpus 0,1 | "
               "ssd generate --target DIR 'def f(x):' | "
               "ssd submit --address http://HEAD:8265 -- generate ...",
    )
    _model_args(ap)
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", help="the model name clients send (default: --target as given)")
    g.add_argument("--graceful-timeout", type=float, default=5.0,
                   help="seconds to let in-flight requests finish on shutdown")
    return ap


def generate_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ssd generate", description="Generate offline: streams each completion to stdout, then "
                                                   "one JSON line of metrics per prompt.")
    ap.add_argument("prompts", nargs="*", help="prompts (text); or use --input")
    ap.add_argument("--input", help='JSONL file, one {"prompt": ...} or {"messages": [...]} per line')
    ap.add_argument("--output", help="write one JSON result per prompt to this JSONL file")
    ap.add_argument("--chat", action="store_true", help="wrap each argument prompt as a user chat message")
    ap.add_argument("--batch", action="store_true", help="run all prompts as one batch (no streaming)")
    ap.add_argument("--quiet", action="store_true", help="print only the JSON metrics lines")
    s = ap.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    _model_args(ap)
    return ap


# -- validation and config -------------------------------------------------------------------------
def _check_model_spec(spec: str, what: str) -> None:
    from ssd.workers.loader import ALIASES

    if spec in ALIASES or Path(spec).expanduser().exists():
        return
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from ssd.workers.loader.load import find_hf_snapshot

        if find_hf_snapshot(spec) is not None:
            return
    raise CLIError(f"unknown {what} model {spec!r}: not an existing path, a cached Hugging Face repo, or an "
                   f"alias ({', '.join(ALIASES)})")


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM/Config keyword arguments from the model/placement flags. Raises CLIError on bad combinations."""
    target = args.target or DEFAULT_TARGET
    draft = args.draft if args.draft is not None else (None if args.target else DEFAULT_DRAFT)
    if draft is not None and draft.lower() == "none":
        draft = None
    if args.mode in ("sd", "ssd") and draft is None:
        raise CLIError(f"--mode {args.mode} needs a draft model (--draft)")
    uses_draft = draft is not None and args.mode not in ("ar", "ngram")

    import torch

    from ssd.config import is_device_name

    cuda = torch.cuda.is_available()
    kw: dict[str, Any] = {"target": target, "draft": draft if uses_draft else None, "mode": args.mode}
    extra: dict[str, Any] = {}
    if args.gpus is not None:
        if not cuda:
            raise CLIError(f"--gpus {','.join(map(str, args.gpus))} given but CUDA is not available on this "
                           "machine (torch.cuda.is_available() is False); leave out --gpus to run on CPU")
        n = torch.cuda.device_count()
        missing = [i for i in args.gpus if i >= n]
        if missing:
            raise CLIError(f"--gpus lists GPU {','.join(map(str, missing))} but only {n} GPU(s) are visible "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        if args.device and not args.device.startswith("cuda"):
            raise CLIError(f"--gpus conflicts with --device {args.device}")
        ids = args.gpus
        if uses_draft and len(ids) >= 2:
            target_ids, draft_id = ids[:-1], ids[-1]
        else:
            target_ids, draft_id = ids, (ids[0] if uses_draft else None)
        tp = args.target_tp or len(target_ids)
        if tp != len(target_ids):
            raise CLIError(f"--target-tp {tp} does not match the {len(target_ids)} target GPU(s) in --gpus")
        kw["device"] = f"cuda:{target_ids[0]}"
        if draft_id is not None:
            kw["draft_device"] = f"cuda:{draft_id}"
        # gpu_ids: what the Ray layout (launch/placement.py) reserves and exposes (CUDA_VISIBLE_DEVICES).
        extra.update(gpu_ids=list(ids), target_tp=tp, target_gpus=target_ids, draft_gpu=draft_id)
    else:
        device = args.device or ("cuda" if cuda else "cpu")
        if not is_device_name(device):
            raise CLIError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
        if device.startswith("cuda") and not cuda:
            raise CLIError(f"--device {device} but CUDA is not available on this machine")
        if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
            raise CLIError(f"--device {device} but only {torch.cuda.device_count()} GPU(s) are visible "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        kw["device"] = device
        if args.target_tp:
            extra["target_tp"] = args.target_tp  # on CPU: ranks over gloo, the target's cores split between them
    if args.target_tp is not None and args.target_tp < 1:
        raise CLIError("--target-tp must be >= 1")
    for flag, key in (("k", "k"), ("fanout", "fanout"), ("saguaro_c", "saguaro_c"), ("candidates", "candidates"),
                      ("candidate_vocab", "candidate_vocab"), ("draft_lookahead", "draft_lookahead"),
                      ("draft_timeout_s", "draft_timeout_s"), ("target_timeout_s", "target_timeout_s"),
                      ("dtype", "dtype"), ("max_batch", "max_batch"),
                      ("max_len", "max_len")):
        v = getattr(args, flag)
        if v is not None:
            kw[key] = v
    if args.quantization:
        kw["quantization"] = None if args.quantization == "none" else args.quantization
    if args.draft_quantization:
        kw["draft_quantization"] = None if args.draft_quantization == "none" else args.draft_quantization
    if args.draft_vocab is not None:
        kw["draft_vocab"] = args.draft_vocab
    if args.linear_kernel:
        kw["linear_kernel"] = args.linear_kernel
    if args.cuda_graphs is False:
        kw["cuda_graphs"] = False
    if args.core_loans is False:
        kw["core_loans"] = False
    if args.autoconfig_cache is False:
        kw["autoconfig_cache"] = False
    if args.draft_gate is False:
        kw["draft_gate"] = False
    if args.ray is not None:
        kw["use_ray"] = args.ray
    if args.ray_channel is not None:
        kw["ray_channel"] = args.ray_channel
    if args.address:
        kw["ray_address"] = args.address
    if extra:
        kw["extra"] = extra
    # Validate everything Config checks (mode, k, saguaro_c, ...) before any model is touched.
    from ssd.config import Config

    try:
        Config(**kw)
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None
    _check_model_spec(target, "target")
    if kw["draft"] is not None:
        _check_model_spec(kw["draft"], "draft")
    return kw


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) so a busy port fails before minutes of model loading; uvicorn listens on it."""
    if not 0 <= port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CLIError(f"cannot resolve --host {host!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        reason = "port already in use" if e.errno in (98, 48) else e.strerror
        raise CLIError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def _load_llm(kw: dict[str, Any]):
    from ssd.llm import LLM

    try:
        return LLM(**kw)
    except (FileNotFoundError, ValueError) as e:
        # Unknown/missing model files, bad checkpoints, mismatched vocabularies: the user's to fix.
        raise CLIError(str(e)) from None
    except (RuntimeError, MemoryError, OSError) as e:  # e.g. a KV cache too large for memory, a truncated file
        log.debug("loading the model failed", exc_info=True)
        raise CLIError(f"could not load the model: {type(e).__name__}: {e}") from None


def _release(llm: Any) -> None:
    if llm is not None:
        try:
            llm.shutdown()
        except Exception:  # noqa: BLE001
            log.exception("error while shutting down the workers")
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # noqa: BLE001
            log.exception("error while shutting down Ray")


def placement(llm: Any) -> list[dict[str, Any]]:
    """Where each worker runs: name, device, process, cores/GPUs (from the workers' info())."""
    rows = []
    cfg = llm.config
    for h in getattr(llm, "_handles", []):
        try:
            info = h.call("info").result(timeout=30)
        except Exception as e:  # noqa: BLE001
            info = {"error": repr(e)}
        worker = getattr(h, "worker", None)
        default_dev = cfg.device if h.name == "target" else (cfg.draft_device or cfg.device)
        row = {
            "worker": h.name,
            "kind": type(h).__name__,
            "device": getattr(worker, "device", None) or info.get("device") or default_dev,
            "pid": info.get("pid", os.getpid() if worker is not None else None),
            "threads": info.get("num_threads"),
        }
        cores = info.get("cpu_affinity")
        if cores is None and worker is not None and hasattr(os, "sched_getaffinity"):
            cores = sorted(os.sched_getaffinity(0))
        row["cores"] = _ranges(cores) if cores else None
        for key in ("hostname", "cuda_visible_devices", "arch", "vocab_size"):
            if info.get(key) is not None:
                row[key] = info[key]
        if h.name == "target" and cfg.extra.get("target_tp"):
            row["tp"] = cfg.extra["target_tp"]
        rows.append(row)
    return rows


def _ranges(ids: list[int]) -> str:
    out, start, prev = [], None, None
    for i in sorted(ids):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)


def banner(llm: Any, kw: dict[str, Any], url: str | None) -> None:
    stats = llm.stats()
    head = {"target": kw["target"], "draft": kw.get("draft"), "mode": stats.get("mode"), "k": stats.get("k"),
            "max_batch": llm.config.max_batch, "max_len": llm.config.max_len, "dtype": llm.config.dtype,
            "quantization": llm.config.quantization}  # as resolved: "auto" picks the target file's own
    if kw.get("draft"):
        head["draft_quantization"] = llm.config.draft_quantization
    if url:
        head["url"] = url
    log.info("ssd ready", extra={"fields": head})
    for row in placement(llm):
        log.info("placement", extra={"fields": row})


# -- serve -----------------------------------------------------------------------------------------
def serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    from ssd.launch.logs import setup_logging

    setup_logging(args.log_level, args.log_json)
    kw = config_kwargs(args)
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    name = args.served_model_name or kw["target"]
    state: dict[str, Any] = {"server": None}

    def on_signal(signum: int, frame: Any) -> None:
        server = state["server"]
        if server is not None:
            server.should_exit = True
        else:
            raise _Interrupted()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    llm = None
    code = 0
    try:
        log.info("loading models", extra={"fields": {k: v for k, v in kw.items() if k != "extra"}})
        llm = _load_llm(kw)
        for s in old:  # again: ray.init() installs its own SIGTERM handler (sys.exit(15))
            signal.signal(s, on_signal)
        import uvicorn

        from ssd.launch.server import create_app

        app = create_app(llm, name)
        host = f"[{args.host}]" if ":" in args.host else args.host
        banner(llm, kw, f"http://{host}:{port}/v1")
        config = uvicorn.Config(app, host=args.host, port=port, log_config=None, access_log=False,
                                timeout_graceful_shutdown=args.graceful_timeout, lifespan="on",
                                log_level=args.log_level)
        server = uvicorn.Server(config)
        state["server"] = server
        server.run(sockets=[sock])
        if not server.started:
            log.error("server failed to start")
            code = 1
    except _Interrupted:
        log.info("interrupted during startup")
    finally:
        # A second signal while the workers are released ends the process the usual way.
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        sock.close()
        log.info("shutting down")
        _release(llm)
    log.info("stopped", extra={"fields": {"exit_code": code}})
    return code


# -- generate --------------------------------------------------------------------------------------
def _read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for p in args.prompts:
        items.append({"messages": [{"role": "user", "content": p}]} if args.chat else {"prompt": p})
    if args.input:
        path = Path(args.input)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise CLIError(f"cannot read --input {args.input}: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CLIError(f"{args.input}:{n}: invalid JSON: {e}") from None
            if isinstance(obj, str):
                obj = {"prompt": obj}
            ok = isinstance(obj, dict) and (
                isinstance(obj.get("prompt"), str)
                or (isinstance(obj.get("prompt"), list) and all(isinstance(t, int) for t in obj["prompt"]))
                or isinstance(obj.get("messages"), list)
            )
            if not ok:
                raise CLIError(f'{args.input}:{n}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
            items.append(obj)
    if not items:
        raise CLIError("no prompts: pass them as arguments or with --input FILE.jsonl")
    return items


def generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    from ssd.launch.logs import setup_logging

    setup_logging(args.log_level, args.log_json)
    items = _read_prompts(args)
    from ssd.sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop=list(args.stop),
                                ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise CLIError(str(e)) from None
    kw = config_kwargs(args)
    if args.output:
        try:
            out_f = open(args.output, "w")  # noqa: SIM115 - closed in finally
        except OSError as e:
            raise CLIError(f"cannot write --output {args.output}: {e.strerror}") from None
    else:
        out_f = None

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    import ssd

    log.info("loading models", extra={"fields": {"target": kw["target"], "draft": kw.get("draft"),
                                                  "ssd_path": os.path.dirname(ssd.__file__)}})
    llm = None
    failed = 0
    try:
        llm = _load_llm(kw)
        signal.signal(signal.SIGTERM, on_term)  # ray.init() may have replaced it
        banner(llm, kw, None)
        prompts: list[Any] = []
        errors: dict[int, str] = {}
        for i, it in enumerate(items):
            if "messages" in it and "prompt" not in it:
                if llm.tokenizer is None:
                    errors[i] = "this model has no tokenizer, so chat messages cannot be rendered"
                    prompts.append(None)
                    continue
                try:
                    prompts.append(
                        llm.tokenizer.apply_chat_template(it["messages"], add_generation_prompt=True))
                except Exception as e:  # noqa: BLE001 - template errors are the input's
                    errors[i] = f"cannot apply the chat template: {e}"
                    prompts.append(None)
            else:
                prompts.append(it["prompt"])

        def emit(i: int, out: Any, error: str | None) -> None:
            it = items[i]
            rec: dict[str, Any] = {"index": i}
            if "id" in it:
                rec["id"] = it["id"]
            if error is not None:
                rec["error"] = error
            else:
                rec.update(finish_reason=out.finish_reason, usage={
                    "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids)},
                    metrics=out.metrics)
            print(json.dumps(rec), flush=True)
            if out_f is not None:
                full = dict(rec)
                full.update({k: it[k] for k in ("prompt", "messages") if k in it})
                if out is not None:
                    full.update(text=out.text, token_ids=out.token_ids)
                out_f.write(json.dumps(full) + "\n")
                out_f.flush()

        if args.batch:
            ok = [i for i in range(len(items)) if i not in errors]
            outs: dict[int, Any] = {}
            for i in ok:  # validate one by one so a bad prompt fails alone
                try:
                    llm.engine.make_sequence(prompts[i], params)
                except ValueError as e:
                    errors[i] = str(e)
            ok = [i for i in ok if i not in errors]
            if ok:  # a request that fails while running fails alone
                for i, o in zip(ok, llm.generate([prompts[i] for i in ok], params, raise_errors=False), strict=True):
                    if o.error is not None:
                        errors[i] = o.error
                    else:
                        outs[i] = o
            for i in range(len(items)):
                if i in errors:
                    failed += 1
                    emit(i, None, errors[i])
                else:
                    if not args.quiet:
                        print(outs[i].text, flush=True)
                    emit(i, outs[i], None)
        else:
            for i in range(len(items)):
                if i in errors:
                    failed += 1
                    emit(i, None, errors[i])
                    continue
                try:
                    for piece in llm.stream(prompts[i], params):
                        if not args.quiet:
                            sys.stdout.write(piece)
                            sys.stdout.flush()
                except (ValueError, RuntimeError) as e:  # refused, or failed while running: this prompt only
                    failed += 1
                    if not args.quiet:
                        sys.stdout.write("\n")
                    emit(i, None, str(e))
                    continue
                if not args.quiet:
                    sys.stdout.write("\n")
                emit(i, llm.last_stream_output, None)
    except KeyboardInterrupt:
        log.info("interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
        if out_f is not None:
            out_f.close()
        _release(llm)
    return 1 if failed else 0


# -- bench -----------------------------------------------------------------------------------------
def _load_bench():
    """benchmarks/bench.py as a module, loaded from its file as `python benchmarks/bench.py` runs it (it imports its
    siblings from its own folder). The checkout's root stays off sys.path, also where `python -m` put the
    working directory there: its top-level `kernels/` folder would shadow Hugging Face's `kernels` package,
    which transformers imports for `--transformers`."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    candidates = [Path.cwd(), root]
    for base in candidates:
        path = base / "benchmarks" / "bench.py"
        if path.is_file():
            sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != base.resolve()]
            spec = importlib.util.spec_from_file_location("ssd_bench", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            if hasattr(mod, "main"):
                return mod
    raise CLIError("`ssd bench` runs benchmarks/bench.py from an ssd source checkout, and none was found "
                   f"(looked in {', '.join(str(c) for c in candidates)}); run it from the repository root")


def bench(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]) and not _bench_available():
        print("usage: ssd bench [ARGS...]\n\n"
              "Runs benchmarks/bench.py main(ARGS) from an ssd source checkout.")
        return 0
    import inspect

    mod = _load_bench()
    if inspect.signature(mod.main).parameters:
        rc = mod.main(argv)
    else:  # an argparse main() that reads sys.argv
        sys.argv = ["ssd bench", *argv]
        rc = mod.main()
    return int(rc or 0)


def _bench_available() -> bool:
    try:
        _load_bench()
    except CLIError:
        return False
    return True


# -- entry point -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv and argv[0] in SUBCOMMANDS else "serve"
    rest = argv[1:] if argv and argv[0] in SUBCOMMANDS else argv
    try:
        if cmd == "serve":
            return serve(rest)
        if cmd == "generate":
            return generate(rest)
        if cmd == "bench":
            return bench(rest)
        from ssd.launch.submit import submit

        return submit(rest)
    except CLIError as e:
        prog = "ssd" if cmd == "serve" else f"ssd {cmd}"
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
