"""paired.py with one more mode setting, `engine_tuner=true`: that engine's K / B tuner chooses from the
engine-wide acceptance and hit-rate estimates only (as before the tuners kept them per request), so the two
can be compared prompt by prompt in one run.

    python benchmarks/tuner_scope.py --modes ssd+engine_tuner=true,ssd --placement a --quantization w4a8 \\
        --draft-vocab 32768 --n-mtbench 20 --max-tokens 128 --out results/ab_tuner_scope.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import paired  # noqa: E402

from ssd import LLM  # noqa: E402


class ScopedLLM(LLM):
    def __init__(self, *args, engine_tuner: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tuner = self.engine.mode.tuner if engine_tuner else None
        if engine_tuner and tuner is None:
            raise ValueError("engine_tuner=true needs a mode with an auto-configured tuner (no k or fanout given)")
        if tuner is not None:
            per_request = tuner.choose
            tuner.choose = lambda seq_ids=(): per_request(())  # the engine-wide estimates, whatever the batch


if __name__ == "__main__":
    paired.LLM = ScopedLLM
    raise SystemExit(paired.main())
