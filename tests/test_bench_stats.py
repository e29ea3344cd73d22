"""benchmarks/bench.py: each prompt set's share of the engine's cumulative statistics; the decode rate's tokens
and seconds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench import decode_part, split_delta  # noqa: E402
from tiny_models import random_model  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402


def test_split_delta_keeps_this_runs_rounds_only():
    before = {"primary": {"hits": 5, "misses": 2}, "fast": {"hits": 1, "misses": 1}}
    after = {"primary": {"hits": 9, "misses": 2}, "fast": {"hits": 1, "misses": 1}, "neural": {"hits": 0, "misses": 3}}
    # "fast" saw no round in this run; "neural" is new since `before`
    assert split_delta(before, after) == {"primary": {"hits": 4, "misses": 0}, "neural": {"hits": 0, "misses": 3}}
    assert split_delta({}, {}) == {}


def test_decode_rate_starts_after_the_first_delivery():
    """AR decodes ar_steps tokens a call and SD emits its first round's accepted draft with the first token:
    those arrive at the first-token time, so the decode rate counts only the tokens after them."""
    target = random_model(vocab=40, layers=2, seed=3, scale=2.0)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for mode, kw in (("ar", {"ar_steps": 4}), ("sd", {"draft": target, "k": 3})):
        with LLM(target=target, mode=mode, dtype="float32", max_len=64, use_ray=False, **kw) as llm:
            o = llm.generate([[1, 2, 3]], sp)[0]
        first = o.metrics["first_tokens"]
        assert first == 4  # 4 AR steps; SD with draft == target: K = 3 accepted + 1
        n, secs = decode_part(o)
        assert n == 10 - first and secs == o.metrics["latency_s"] - o.metrics["ttft_s"] > 0
