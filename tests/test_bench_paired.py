"""benchmarks/paired.py: the rotating order and the paired summary."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from paired import rotation, summary  # noqa: E402


def test_every_mode_leads_equally_often():
    modes = ["sd", "auto", "ar"]
    orders = [rotation(modes, i) for i in range(6)]
    assert all(sorted(o) == sorted(modes) for o in orders)
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == sorted(modes * 2)


def test_summary_pairs_each_prompt_with_the_base():
    rows = [  # auto twice as fast on the first prompt, half as fast on the second: geomean 1, totals not
        {"sd": {"decode_tokens": 100, "decode_s": 4.0}, "auto": {"decode_tokens": 100, "decode_s": 2.0}},
        {"sd": {"decode_tokens": 100, "decode_s": 1.0}, "auto": {"decode_tokens": 100, "decode_s": 2.0}},
    ]
    s = summary(rows, "sd")
    assert s["sd"] == {"decode_tokens_per_s": 40.0, "vs_base_geomean": 1.0, "vs_base_total": 1.0, "rated_prompts": 2}
    assert s["auto"]["vs_base_geomean"] == pytest.approx(1.0)
    assert s["auto"]["vs_base_total"] == pytest.approx((200 / 4.0) / (200 / 5.0), abs=1e-3)
    assert s["auto"]["decode_tokens_per_s"] == 50.0
    # an answer that ends within its first round decodes nothing after it: out of the geomean, in the totals
    short = {"sd": {"decode_tokens": 0, "decode_s": 0.0}, "auto": {"decode_tokens": 3, "decode_s": 0.1}}
    s = summary([*rows, short], "sd")
    assert s["auto"]["vs_base_geomean"] == pytest.approx(1.0) and s["auto"]["rated_prompts"] == 2
    assert s["auto"]["decode_tokens_per_s"] == pytest.approx(203 / 4.1, abs=0.01)


def test_mode_variants_parse_their_settings():
    from paired import variant

    assert variant("sd") == ("sd", {})
    assert variant("ssd+candidates=quota+fanout=4+draft_vocab_context=false+saguaro_c=0.5") == (
        "ssd", {"candidates": "quota", "fanout": 4, "draft_vocab_context": False, "saguaro_c": 0.5})
    assert variant("sd+draft_quantization=none+k=None") == ("sd", {"draft_quantization": None, "k": None})
    with pytest.raises(ValueError, match="key=value"):
        variant("ssd+quota")
