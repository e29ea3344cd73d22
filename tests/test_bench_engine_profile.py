"""benchmarks/engine_profile.py on a tiny model on the CPU: every mode's rounds, tokens and per-thread profiles."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_profiles_each_mode_and_thread(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine_profile.py"), "--device", "cpu", "--model", "tiny",
         "--modes", "ar,sd", "--tokens", "24", "--top", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["forward_ms"] > 0 and set(res["modes"]) == {"ar", "sd"}
    ar, sd = res["modes"]["ar"], res["modes"]["sd"]
    assert ar["tokens"] == sd["tokens"] == 24
    assert ar["rounds"] == 24 and sd["rounds"] < 24  # AR: a target forward per token; SD (draft == target) fewer
    assert abs(ar["ms_per_token"] * 24 - ar["wall_s"] * 1e3) < 1
    # Python < 3.12: one profiler per thread (coordinator, target, draft); 3.12+: one for all threads.
    threads = set(sd["top"])
    assert threads == {"coordinator", "target", "draft"} or threads == {"all"}
    assert all(len(rows) == 5 and rows[0]["tottime_s"] >= rows[-1]["tottime_s"] for rows in sd["top"].values())
    assert "== sd: 24 tokens" in r.stdout
