"""`ssd submit`: a generate job on a local Ray head (with its dashboard / job server), end to end.

The head is started by this test with its own temp dir and ports (so `ray.init()` elsewhere on the machine
does not find it) and torn down by pid: `ray start --block` is stopped with SIGTERM and any process it left
is killed by id. Never `ray stop`, which would stop every Ray instance on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from tiny_hf import write_model_dir

PY = sys.executable
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _kill_tree(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


@pytest.fixture(scope="module")
def ray_head():
    if not Path(RAY).exists():
        pytest.fail(f"ray CLI not found next to {PY}")
    gcs, dash, client, agent_http, agent_grpc, rtenv, metrics, nm, om = free_ports(9)
    temp_dir = tempfile.mkdtemp(prefix="ssdray", dir="/tmp")  # short: Ray puts unix sockets under it
    log_path = Path(temp_dir) / "head.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        RAY, "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}", "--num-cpus=2",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={rtenv}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
        "--object-store-memory=100000000", "--disable-usage-stats",
    ]
    log_f = open(log_path, "w")  # noqa: SIM115 - closed in the finalizer
    proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                # Up when the dashboard answers (401 = up, with token authentication on).
                if httpx.get(url + "/api/version", timeout=2).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"the Ray dashboard did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        tree = []
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # ray start --block drains and stops what it started
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _kill_tree([p for p in tree if p.is_running()])
        log_f.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(url: str, wd: Path, *command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "ssd.launch", "submit", "--address", url, "--working-dir", str(wd), "--python", PY,
         "--", *command],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.ray
@pytest.mark.slow
def test_submit_generate_job(ray_head, tmp_path):
    model = write_model_dir(tmp_path / "model", seed=0)
    wd = tmp_path / "job"
    wd.mkdir()
    prompts = ["def fib(n):", "hello world"]
    (wd / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
                                      + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    r = submit(ray_head, wd, "generate", "--target", str(model), "--mode", "ar", "--dtype", "float32",
               "--max-len", "128", "--temperature", "0", "--max-tokens", "8", "--input", "prompts.jsonl",
               "--output", str(out), "--log-level", "warning")
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    # The job's logs were followed: its per-prompt metrics lines came through.
    assert r.stdout.count('{"index"') >= 3, r.stdout
    assert "SUCCEEDED" in r.stderr
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [x["index"] for x in recs] == [0, 1, 2]
    assert [x.get("prompt") for x in recs[:2]] == prompts
    assert all(len(x["token_ids"]) >= 1 and x["finish_reason"] in ("stop", "length") for x in recs)

    # A job that fails (its input file does not exist) -> exit status 1.
    r = submit(ray_head, wd, "generate", "--target", str(model), "--input", "missing.jsonl")
    assert r.returncode == 1, r.stderr
    assert "cannot read --input missing.jsonl" in r.stdout
    assert "FAILED" in r.stderr


def test_ship_package_layout(tmp_path):
    """--ship-package uploads ssd as one importable tree (the checkout keeps workers/, launch/, ... apart)."""
    import argparse

    from ssd.launch.submit import build_runtime_env

    wd = tmp_path / "wd"
    wd.mkdir()
    args = argparse.Namespace(env=["A=1"], no_working_dir=False, working_dir=str(wd), pip=["numpy"])
    env = build_runtime_env(args, tmp_path / "stage")
    assert env["working_dir"] == str(wd) and env["pip"] == ["numpy"]
    assert env["env_vars"]["A"] == "1"
    pkg = Path(env["py_modules"][0])
    assert pkg.name == "ssd"
    for f in ("__init__.py", "llm.py", "workers/__init__.py", "workers/loader/__init__.py", "launch/cli.py",
              "launch/server.py", "cache/__init__.py", "kernels/__init__.py"):
        assert (pkg / f).is_file(), f
    assert not list(pkg.rglob("__pycache__"))
    r = subprocess.run([PY, "-c", "import ssd.launch.cli as c, ssd.client; print(c.__file__)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(pkg.parent)},
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(pkg))


def test_a_working_dir_with_an_ssd_folder_does_not_shadow_the_package(tmp_path):
    """A job runs in its uploaded working dir; a source checkout there has an ssd/ folder without the
    subpackages. The job's environment keeps the cwd off sys.path (PYTHONSAFEPATH)."""
    import argparse

    from ssd.launch.submit import build_runtime_env

    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / "__init__.py").write_text("raise ImportError('the working dir shadows ssd')\n")
    args = argparse.Namespace(env=[], no_working_dir=False, working_dir=str(tmp_path), pip=[])
    job_env = build_runtime_env(args, None)["env_vars"]
    cmd = [PY, "-c", "import ssd.launch.cli"]
    shadowed = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"})
    assert shadowed.returncode != 0 and "shadows" in shadowed.stderr  # the failure this guards against
    ok = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, **job_env})
    assert ok.returncode == 0, ok.stderr
