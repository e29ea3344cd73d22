"""GPU smoke test: AR / SD / SSD with the target and the draft on different GPUs; greedy outputs equal.

    bash scripts/gpu_smoke.sh            # needs >= 2 CUDA devices (1 works: both share it)

Tiny random models are built in-process (no downloads). Prints one line per mode and exits
non-zero on any mismatch.
"""

from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, "tests")
from tiny_models import random_model  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to smoke-test")
        return 2
    n = torch.cuda.device_count()
    print(f"{n} CUDA device(s): {[torch.cuda.get_device_name(i) for i in range(n)]}")
    target = random_model(vocab=512, layers=4, hidden=256, heads=8, kv_heads=2, seed=1, scale=2.0)
    draft = random_model(vocab=512, layers=2, hidden=128, heads=4, kv_heads=2, seed=2, scale=2.0)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(40, 60))]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    gpu_ids = list(range(min(n, 2)))
    ref = None
    ok = True
    for mode in ("ar", "sd", "ngram", "ssd", "auto"):
        kw = dict(device="cuda", dtype="float32", max_batch=4, max_len=256, use_ray=True,
                  extra={"gpu_ids": gpu_ids})
        t0 = time.perf_counter()
        with LLM(target=target, draft=None if mode in ("ar", "ngram") else draft, mode=mode, k=4, **kw) as llm:
            outs = [o.token_ids for o in llm.generate(prompts, sp)]
            st = llm.stats()
        dt = time.perf_counter() - t0
        ref = outs if ref is None else ref
        same = outs == ref
        ok &= same
        print(f"{mode:6s} equal_to_ar={same} tau={st['tau']:.2f} hit_rate={st['cache_hit_rate']} "
              f"policy={st['policy']} wall={dt:.1f}s")
    print("GPU SMOKE", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
