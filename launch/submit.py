"""`ssd submit`: run an `ssd` command (usually `generate`) as a Ray job and follow its logs.

    ssd submit --address http://HEAD:8265 [--working-dir DIR] -- generate --input p.jsonl --output out.jsonl

The job runs `python -m ssd.launch <command>` on the cluster with `runtime_env.working_dir` = DIR (default:
the current directory; relative paths in the command resolve there). The cluster needs `ssd` and its
dependencies (torch, ...) installed; `--ship-package` uploads this installation's `ssd` sources as
`py_modules` for a cluster that has the dependencies but not `ssd` itself. Files the job writes (e.g.
`--output`) stay on the node that ran it: give a path on shared storage. Exit status: 0 when the job
SUCCEEDED, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ssd.launch.cli import SUBCOMMANDS, CLIError, _Parser

log = logging.getLogger("ssd.launch")

# ssd's subpackages that live in their own top-level directory of a source checkout (pyproject package-dir).
_MAPPED_SUBPACKAGES = ("workers", "cache", "kernels", "launch")


def submit_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ssd submit", description="Submit `python -m ssd.launch COMMAND...` as a Ray job and "
                                                 "stream its logs; everything after `--` is the command.")
    default_address = os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    ap.add_argument("--address", default=default_address,
                    help="Ray job server (dashboard) address, e.g. http://HEAD:8265 (default: "
                         "$RAY_API_SERVER_ADDRESS or $RAY_ADDRESS)")
    ap.add_argument("--working-dir", default=".", help="uploaded as the job's working directory (default: .)")
    ap.add_argument("--no-working-dir", action="store_true", help="do not upload a working directory")
    ap.add_argument("--python", default="python", help="python executable on the cluster (default: python)")
    ap.add_argument("--ship-package", action="store_true",
                    help="upload this installation's ssd sources (runtime_env py_modules) for clusters "
                         "without ssd installed; its dependencies must be there")
    ap.add_argument("--pip", action="append", default=[], metavar="REQ",
                    help="pip requirement installed into the job's environment (runtime_env pip; repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="job environment variable (repeatable)")
    ap.add_argument("--job-id", help="submission id (default: generated)")
    ap.add_argument("--entrypoint-num-cpus", type=float, help="CPUs reserved for the job's driver")
    ap.add_argument("--entrypoint-num-gpus", type=float, help="GPUs reserved for the job's driver")
    ap.add_argument("--no-wait", action="store_true", help="submit and exit without following the logs")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return ap


def stage_package(dest: Path) -> Path:
    """Copy the installed `ssd` package, with the subpackages a source checkout keeps in sibling
    directories, into dest/ssd (the layout a wheel would install). Returns dest/ssd."""
    spec = importlib.util.find_spec("ssd")
    if spec is None or not spec.submodule_search_locations:
        raise CLIError("cannot locate the ssd package to ship")
    src = Path(list(spec.submodule_search_locations)[0])
    out = dest / "ssd"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    shutil.copytree(src, out, ignore=ignore)
    for sub in _MAPPED_SUBPACKAGES:
        if (out / sub).exists():
            continue
        s = importlib.util.find_spec(f"ssd.{sub}")
        if s is None or not s.submodule_search_locations:
            continue
        shutil.copytree(Path(list(s.submodule_search_locations)[0]), out / sub, ignore=ignore)
    return out


def build_runtime_env(args: argparse.Namespace, staging: Path | None) -> dict:
    # PYTHONSAFEPATH (Python 3.11+): the job's cwd, the uploaded working dir, is not put first on sys.path, so
    # a source checkout as working dir (its ssd/ folder lacks the subpackages) cannot shadow the installed ssd.
    env: dict = {"env_vars": {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"}}
    for kv in args.env:
        if "=" not in kv:
            raise CLIError(f"--env expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        env["env_vars"][k] = v
    if not args.no_working_dir:
        wd = Path(args.working_dir).expanduser().resolve()
        if not wd.is_dir():
            raise CLIError(f"--working-dir {args.working_dir} is not a directory")
        env["working_dir"] = str(wd)
        env["excludes"] = [".git", "__pycache__", "*.pyc", ".venv", "venv"]
    if staging is not None:
        env["py_modules"] = [str(stage_package(staging))]
    if args.pip:
        env["pip"] = list(args.pip)
    return env


def _enable_token_auth() -> None:
    """Ray >= 2.5x clusters may require a token: use the local one (~/.ray/auth_token, $RAY_AUTH_TOKEN)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception:  # noqa: BLE001 - best effort; the server says if it needs a token
        pass
    finally:
        quiet.setLevel(level)


def follow(client, job_id: str) -> None:
    """Print the job's logs until it ends (websocket tail; polling if that is unavailable)."""

    printed = 0  # characters of the job's log written so far: polling after a broken tail goes on from there

    async def tail() -> None:
        nonlocal printed
        async for lines in client.tail_job_logs(job_id):
            sys.stdout.write(lines)
            sys.stdout.flush()
            printed += len(lines)

    try:
        asyncio.run(tail())
        return
    except Exception as e:  # noqa: BLE001
        log.debug("log tail failed (%r); polling instead", e)
    while True:
        status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        if len(logs) > printed:
            sys.stdout.write(logs[printed:])
            sys.stdout.flush()
            printed = len(logs)
        if status.is_terminal():
            return
        time.sleep(1.0)


def submit(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        opts, command = argv[:i], argv[i + 1:]
    else:
        opts, command = argv, []
    args = submit_parser().parse_args(opts)
    from ssd.launch.logs import setup_logging

    setup_logging(args.log_level)
    if not args.address:
        raise CLIError("--address is required (the Ray job server, e.g. http://HEAD:8265)")
    if not command:
        raise CLIError("give the command after `--`, e.g. "
                       "ssd submit --address URL -- generate --input p.jsonl")
    if command[0] == "submit":
        raise CLIError("cannot submit `submit`")
    if command[0] not in SUBCOMMANDS and not command[0].startswith("-"):
        raise CLIError(f"unknown command {command[0]!r}; expected one of {', '.join(SUBCOMMANDS)} "
                       "or serve flags")
    entrypoint = f"{shlex.quote(args.python)} -m ssd.launch {shlex.join(command)}"

    address = args.address if "://" in args.address else f"http://{args.address}"
    _enable_token_auth()
    from ray.job_submission import JobStatus, JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - connection refused, auth, version mismatch ...
        raise CLIError(f"cannot reach the Ray job server at {address}: {e}") from None

    with tempfile.TemporaryDirectory(prefix="ssd-submit-") as tmp:
        runtime_env = build_runtime_env(args, Path(tmp) if args.ship_package else None)
        kw = {}
        if args.entrypoint_num_cpus is not None:
            kw["entrypoint_num_cpus"] = args.entrypoint_num_cpus
        if args.entrypoint_num_gpus is not None:
            kw["entrypoint_num_gpus"] = args.entrypoint_num_gpus
        try:
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                       submission_id=args.job_id, **kw)
        except Exception as e:  # noqa: BLE001
            raise CLIError(f"job submission failed: {e}") from None
    log.info("job submitted",
             extra={"fields": {"job_id": job_id, "address": address, "entrypoint": entrypoint}})
    if args.no_wait:
        print(job_id)
        return 0
    try:
        follow(client, job_id)
        status = client.get_job_status(job_id)
        while not status.is_terminal():
            time.sleep(0.5)
            status = client.get_job_status(job_id)
    except KeyboardInterrupt:
        log.info("detached; the job keeps running", extra={"fields": {
            "job_id": job_id, "stop_with": f"ray job stop --address {address} {job_id}"}})
        return 130
    info = client.get_job_info(job_id)
    fields = {"job_id": job_id, "status": str(status.value if hasattr(status, "value") else status)}
    if info.message:
        first = info.message.strip().splitlines()[0] if info.message.strip() else ""
        fields["message"] = first[:300]
    if status == JobStatus.SUCCEEDED:
        log.info("job finished", extra={"fields": fields})
        return 0
    log.error("job did not succeed", extra={"fields": fields})
    if "No module named" in (client.get_job_logs(job_id) or "") and not args.ship_package:
        log.error("hint: ssd is not importable on the cluster; install it there or pass --ship-package")
    return 1
