"""`python -m ssd.launch`: help, generate, early usage errors (exit 2), graceful shutdown of a server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from tiny_hf import write_model_dir

from ssd import LLM, SamplingParams

PY = sys.executable
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "ssd.launch", *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_models")
    return str(write_model_dir(root / "target", seed=0)), str(write_model_dir(root / "draft", seed=5))


def test_help():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--target", "--draft", "--gpus", "--mode", "--fanout", "--saguaro-c", "--port", "--address",
                 "generate", "bench", "submit"):
        assert flag in r.stdout
    for sub in ("generate", "submit"):
        r = run(sub, "--help")
        assert r.returncode == 0 and "usage: ssd " + sub in r.stdout


def _one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def cli(monkeypatch, capsys):
    """`ssd ARGS` in-process (fast: torch is already imported); returns (exit code, stderr)."""
    import ssd.launch.logs
    from ssd.launch.cli import main

    monkeypatch.setattr(ssd.launch.logs, "setup_logging", lambda *a, **k: None)

    def call(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        rc = main(list(args))
        return rc, capsys.readouterr().err

    return call


def test_gpus_without_cuda_is_a_usage_error(models):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # The real entry point, as a user runs it.
    r = run("--target", models[0], "--draft", models[1], "--gpus", "0,1")
    _one_line_error(r.returncode, r.stderr, "--gpus", "CUDA is not available")


def test_unknown_alias(cli, models):
    _one_line_error(*cli("--target", "llama-7000b"), "unknown target model 'llama-7000b'", "qwen-coder-1.5b")
    _one_line_error(*cli("generate", "--target", models[0], "--draft", "no-such-draft", "hi"),
                    "unknown draft model 'no-such-draft'")


def test_bad_flags(cli, models):
    _one_line_error(*cli("--target", models[0], "--k", "0"), "k must be")
    _one_line_error(*cli("--target", models[0], "--mode", "ssd"), "needs a draft")
    _one_line_error(*cli("--target", models[0], "--draft-lookahead", "-1"), "draft_lookahead must be")
    if not torch_cuda():
        _one_line_error(*cli("--target", models[0], "--device", "cuda"), "CUDA is not available")
    _one_line_error(*cli("--gpus", "a,b"), "--gpus")
    _one_line_error(*cli("generate", "--target", models[0]), "no prompts")
    _one_line_error(*cli("submit", "--address", "http://127.0.0.1:1"), "after `--`")


def test_bench_runs_benchmarks_main(cli, tmp_path, monkeypatch):
    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    (bench_dir / "bench.py").write_text(
        "import json, pathlib\n"
        "def main(argv):\n"
        "    pathlib.Path('argv.json').write_text(json.dumps(argv))\n"
        "    return 3\n"
    )
    (tmp_path / "kernels").mkdir()  # a checkout's top-level folder of that name must not shadow HF's `kernels`
    (tmp_path / "kernels" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # as `python -m ssd.launch` run from there
    rc, _ = cli("bench", "--quick", "x")
    assert rc == 3
    assert json.loads((tmp_path / "argv.json").read_text()) == ["--quick", "x"]
    assert str(tmp_path) not in sys.path


def test_port_in_use(cli, models):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.time()
        rc, err = cli("--target", models[0], "--port", str(port))
    _one_line_error(rc, err, f"127.0.0.1:{port}", "port already in use")
    assert time.time() - t0 < 10  # refused before any model is loaded


def test_generate(models, tmp_path):
    target, draft = models
    inp = tmp_path / "prompts.jsonl"
    inp.write_text(json.dumps({"prompt": "def fib(n):", "id": "p1"}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    # --draft-vocab: the draft proposes only ids < 100 (+ eos); lossless, so the output below is unchanged
    r = run("generate", "--target", target, "--draft", draft, "--mode", "sd", "--dtype", "float32",
            "--max-len", "256", "--temperature", "0", "--max-tokens", "12", "--draft-vocab", "100",
            "--input", str(inp), "--output", str(out), "hello world")
    assert r.returncode == 0, r.stderr
    metrics_lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith('{"index"')]
    assert [m["index"] for m in metrics_lines] == [0, 1, 2]
    assert all(m["metrics"]["emitted_tokens"] >= 1 and "tau" in m["metrics"] for m in metrics_lines)
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r_.get("id") for r_ in recs] == [None, "p1", None]
    # Same greedy outputs as the in-process API.
    llm = LLM(target=target, draft=draft, mode="sd", dtype="float32", max_len=256)
    try:
        msgs = [{"role": "user", "content": "hi"}]
        chat = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        exp = llm.generate(["hello world", "def fib(n):", chat], SamplingParams(temperature=0, max_tokens=12))
    finally:
        llm.shutdown()
    assert [r_["text"] for r_ in recs] == [o.text for o in exp]
    assert [r_["token_ids"] for r_ in recs] == [o.token_ids for o in exp]
    for o in exp:  # the streamed text went to stdout
        assert o.text.strip() in r.stdout


@pytest.mark.parametrize("sig,ray", [
    pytest.param(signal.SIGINT, False, id="SIGINT-local"),
    # Workers as Ray actors: a local Ray instance (gcs, raylet, agents, two actor processes) must go too.
    pytest.param(signal.SIGTERM, True, id="SIGTERM-ray", marks=[pytest.mark.ray, pytest.mark.slow]),
])
def test_graceful_shutdown(models, sig, ray):
    target, draft = models
    port = free_port()
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [PY, "-m", "ssd.launch", "--target", target, "--draft", draft, "--mode", "sd", "--dtype", "float32",
         "--max-len", "256", "--port", str(port), "--log-json", "--ray" if ray else "--no-ray"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 150
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.3)
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        _, err = proc.communicate()
        assert rc == 0, err
        logs = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
        msgs = [m["msg"] for m in logs]
        assert "ssd ready" in msgs and "placement" in msgs and "stopped" in msgs
        ready = next(m for m in logs if m["msg"] == "ssd ready")
        assert ready["quantization"] is None and ready["draft_quantization"] is None  # tiny HF dirs: as stored
        placement = [m for m in logs if m["msg"] == "placement"]
        assert {p["worker"] for p in placement} == {"target", "draft"}
        assert {p["kind"] for p in placement} == {"RayHandle" if ray else "LocalHandle"}
        if ray:
            assert len(children) >= 2  # at least the two actor processes
        time.sleep(0.5)
        left = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"orphaned children: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_gpu_layout(monkeypatch):
    """--gpus mapping on a (pretend) 5-GPU machine: target on all but the last, draft on the last."""
    import torch

    from ssd.launch.cli import CLIError, config_kwargs, serve_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 5)

    def kw(*argv: str) -> dict:
        return config_kwargs(serve_parser().parse_args(list(argv)))

    k = kw("--target", "llama-70b", "--draft", "llama-1b", "--gpus", "0,1")
    assert (k["device"], k["draft_device"]) == ("cuda:0", "cuda:1")
    assert k["extra"]["gpu_ids"] == [0, 1] and k["extra"]["target_tp"] == 1
    k = kw("--target", "llama-70b", "--draft", "llama-1b", "--gpus", "0,1,2,3,4")
    assert k["extra"]["target_gpus"] == [0, 1, 2, 3] and k["extra"]["target_tp"] == 4
    assert k["draft_device"] == "cuda:4"
    k = kw("--target", "llama-70b", "--gpus", "2,3")  # no draft: target TP over both
    assert k["device"] == "cuda:2" and k["extra"]["target_tp"] == 2 and "draft_device" not in k
    with pytest.raises(CLIError, match="only 5 GPU"):
        kw("--target", "llama-70b", "--draft", "llama-1b", "--gpus", "0,5")
    with pytest.raises(CLIError, match="--target-tp 2 does not match"):
        kw("--target", "llama-70b", "--draft", "llama-1b", "--gpus", "0,1,2,3", "--target-tp", "2")
    assert "cuda_graphs" not in kw("--target", "llama-70b", "--gpus", "0")  # graphs on: the Config default
    assert kw("--target", "llama-70b", "--gpus", "0", "--no-cuda-graphs")["cuda_graphs"] is False


def test_borrow_flag():
    """--no-core-loans keeps auto's target on its own cores; without it the Config default holds."""
    from ssd.launch.cli import config_kwargs, serve_parser

    def kw(*argv: str) -> dict:
        return config_kwargs(serve_parser().parse_args(list(argv)))

    assert "core_loans" not in kw("--target", "qwen-coder-1.5b", "--draft", "qwen-coder-0.5b")
    assert kw("--target", "qwen-coder-1.5b", "--draft", "qwen-coder-0.5b",
              "--no-core-loans")["core_loans"] is False


def test_draft_timeout_flag():
    """--draft-timeout takes seconds, or 'none' for no timeout (Config turns infinity into None)."""
    from ssd.config import Config
    from ssd.launch.cli import config_kwargs, serve_parser

    def kw(*argv: str) -> dict:
        return config_kwargs(serve_parser().parse_args(list(argv)))

    assert kw("--draft-timeout", "2.5")["draft_timeout_s"] == 2.5
    for off in ("none", "inf"):
        t = kw("--draft-timeout", off)["draft_timeout_s"]
        assert Config(target="t", draft="d", draft_timeout_s=t).draft_timeout_s is None
    with pytest.raises(SystemExit):
        kw("--draft-timeout", "soon")


def test_quantization_flags():
    """--quantization / --draft-quantization take every mode the engine does (the CLI lists them without torch)."""
    from ssd.launch.cli import QUANTIZATIONS, config_kwargs, serve_parser
    from ssd.workers.models.quant import QUANT_MODES

    assert QUANTIZATIONS == QUANT_MODES

    def kw(*argv: str) -> dict:
        return config_kwargs(serve_parser().parse_args(list(argv)))

    k = kw("--quantization", "w4a8", "--draft-quantization", "w4a8-all")
    assert (k["quantization"], k["draft_quantization"]) == ("w4a8", "w4a8-all")
    assert kw("--draft-quantization", "w4a8-g64")["draft_quantization"] == "w4a8-g64"
    assert "quantization" not in kw() and kw("--quantization", "auto")["quantization"] == "auto"  # the engine's default
    assert kw("--quantization", "none")["quantization"] is None
    assert kw("--draft-quantization", "none")["draft_quantization"] is None
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--draft-quantization", "int3"])


@pytest.mark.parametrize("batch", [False, True])
def test_generate_a_request_that_fails_while_running_fails_alone(models, monkeypatch, capsys, batch):
    """A prompt whose request fails after it was accepted (here: its admission) gets its error line; the
    prompts after it still run (streamed, or in one batch), and the exit status says one failed."""
    from ssd.launch import cli

    llm = LLM(target=models[0], mode="ar", dtype="float32", max_len=128)
    admit = llm.engine._admit

    def failing_admit(seq):
        if seq.prompt_text == "BAD":
            raise RuntimeError("injected failure")
        admit(seq)

    monkeypatch.setattr(llm.engine, "_admit", failing_admit)
    monkeypatch.setattr(cli, "_load_llm", lambda kw: llm)
    rc = cli.generate(["--target", models[0], "--temperature", "0", "--max-tokens", "4",
                       *(["--batch"] if batch else []), "hello", "BAD", "world"])
    recs = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith('{"index"')]
    assert rc == 1
    assert [r.get("error", "") for r in recs] == ["", "RuntimeError: injected failure", ""] if batch else (
        [r["index"] for r in recs] == [0, 1, 2] and "injected failure" in recs[1]["error"])
    assert all(r["usage"]["completion_tokens"] == 4 for r in (recs[0], recs[2]))


def test_device_index_is_checked(cli, models):
    _one_line_error(*cli("--target", models[0], "--device", "cuda:abc"), "--device must be cpu, cuda or cuda:N")
