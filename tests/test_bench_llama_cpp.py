"""benchmarks/llama_cpp.py: reading llama.cpp's own timings, the commands, and a whole run against fake tools."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import llama_cpp  # noqa: E402

LOOKUP_LOG = """\
0.06.737.757 I encoded  137 tokens in    1.438 seconds, speed:  118.258 t/s
0.06.737.774 I decoded   33 tokens in    3.963 seconds, speed:    8.327 t/s
0.06.737.785 I n_draft      = 3
0.06.737.791 I n_predict    = 33
0.06.737.796 I n_drafted    = 12
0.06.737.814 I n_accept     = 2
0.06.737.819 I accept       = 16.667%
"""

COMPLETION_LOG = (
    "0.06.273.743 I common_perf_print: prompt eval time =    1291.13 ms /   137 tokens "
    "(    9.42 ms per token,   106.11 tokens per second)\n"
    "0.06.273.750 I common_perf_print:        eval time =    3680.61 ms /    31 runs   "
    "(  118.73 ms per token,     8.42 tokens per second)\n"
)


def test_parse_speculative_tool():
    got = llama_cpp.parse("ngram", LOOKUP_LOG)
    assert got == {"tokens": 33, "decode_tokens": 32, "seconds": 3.963, "prompt_seconds": 1.438,
                   "drafted": 12, "accepted": 2}


def test_parse_completion_keeps_prompt_and_decode_apart():
    got = llama_cpp.parse("ar", COMPLETION_LOG)
    assert got == {"tokens": 32, "decode_tokens": 31, "seconds": 3.68061, "prompt_seconds": 1.29113}


@pytest.mark.parametrize("mode", ["ar", "ngram", "draft"])
def test_parse_without_timings_raises(mode):
    with pytest.raises(ValueError, match="no llama.cpp timings"):
        llama_cpp.parse(mode, "llama_model_load: error loading model\n")


def test_commands_pass_the_prompt_verbatim():
    prompt = 'def f():\n    """a\\nb"""\n'
    cmd = llama_cpp.command("/bin", "draft", "t.gguf", "d.gguf", prompt, 96, 2)
    assert cmd[0] == "/bin/llama-speculative-simple"
    assert cmd[cmd.index("-p") + 1] == prompt and "--no-escape" in cmd and "-f" not in cmd
    assert cmd[cmd.index("-md") + 1] == "d.gguf" and cmd[cmd.index("-td") + 1] == "2"
    assert "-no-cnv" in llama_cpp.command("/bin", "ar", "t.gguf", "d.gguf", prompt, 96, 2)
    assert "-md" not in llama_cpp.command("/bin", "ngram", "t.gguf", "d.gguf", prompt, 96, 2)


def _fake_tool(path: Path, log: str) -> None:
    path.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{log}EOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_run_sums_prompts_per_set(tmp_path):
    _fake_tool(tmp_path / "llama-lookup", LOOKUP_LOG)
    _fake_tool(tmp_path / "llama-completion", COMPLETION_LOG)
    out = {m: llama_cpp.run(tmp_path, m, "t.gguf", "d.gguf", {"he": ["a", "b"], "mt": ["c"]}, 32, 2)
           for m in ("ar", "ngram")}
    assert out["ngram"]["he"]["tokens"] == 66
    assert out["ngram"]["he"]["decode_tokens_per_s"] == round(64 / (2 * 3.963), 2)
    assert out["ngram"]["he"]["acceptance_rate"] == round(4 / 24, 3)
    assert out["ngram"]["mt"]["tokens_per_s"] == round(33 / (3.963 + 1.438), 2)
    assert out["ar"]["mt"]["decode_tokens_per_s"] == round(31 / 3.68061, 2)
    assert "acceptance_rate" not in out["ar"]["he"]


def test_run_checks_tools_before_running(tmp_path):
    with pytest.raises(ValueError, match="expected one of"):
        llama_cpp.run(tmp_path, "beam", "t", "d", {"he": ["a"]}, 8, 1)
    with pytest.raises(FileNotFoundError, match="llama-speculative-simple"):
        llama_cpp.run(tmp_path, "draft", "t", "d", {"he": ["a"]}, 8, 1)


def test_run_reports_a_failing_tool(tmp_path):
    tool = tmp_path / "llama-lookup"
    tool.write_text("#!/bin/sh\necho 'load failed' >&2\nexit 3\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="exited 3:\nload failed"):
        llama_cpp.run(tmp_path, "ngram", "t", "d", {"he": ["a"]}, 8, 1)


def test_a_crashing_tool_names_the_build_that_ran(tmp_path):
    tool = tmp_path / "llama-completion"
    tool.write_text("#!/bin/sh\necho 'threadpool init' >&2\nkill -SEGV $$\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match=r"exited -11 \(a segmentation fault: .*-mno-amx-int8.*\):\nthreadpool init"):
        llama_cpp.run(tmp_path, "ar", "t", "d", {"he": ["a"]}, 8, 1)
