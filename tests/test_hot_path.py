"""The decode hot path, after warm-up, holds on to nothing new and copies nothing large.

On CPU there is no caching allocator to watch (torch.cuda.max_memory_allocated has no CPU twin),
and eager PyTorch allocates each op's output, so "allocates nothing" cannot mean zero malloc
calls. What this checks, from torch.profiler's per-op memory accounting (profile_memory=True),
for steady-state decode steps of a quantised (batch-invariant) model:
  1. net zero: every byte allocated during a step is freed by its end once the returned logits
     are dropped (no cache, table or buffer grows per step);
  2. the same number of allocations every step (no step-dependent extra work);
  3. no single allocation as large as one layer's KV-cache slab for a slot or a weight matrix:
     keys/values are read as views of the cache (no gather), weights are never dequantised.
The block modes (w4a8, w8a8) run a decode step's layers in one C call (fused.py), whose own buffers the
profiler does not see: for them this covers the Python side of the step only.
"""

import pytest
import torch
from tiny_models import random_model
from torch.profiler import ProfilerActivity, profile

from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.quant import quantize_model

HIDDEN, HEADS, KV_HEADS, VOCAB, MAX_LEN, PROMPT = 256, 4, 2, 512, 512, 100


def step_allocations(runner, slots, toks):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = runner.forward(slots, [[t] for t in toks], last_only=True)
        nxt = logits.argmax(-1).tolist()
        del logits
    events = list(prof.events())
    allocs = [e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0]
    net = sum(e.self_cpu_memory_usage for e in events)
    return nxt, allocs, net


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8", "w8a8"])
@pytest.mark.parametrize("slots", [[0], [1, 0]], ids=["one_seq", "two_seqs_reversed_slots"])
def test_decode_step_steady_state(mode, slots):
    model = quantize_model(
        random_model(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, layers=2).to(torch.bfloat16), mode
    )
    assert model.batch_invariant
    runner = ModelRunner(model, max_slots=2, max_len=MAX_LEN)
    for s in (runner.allocate(), runner.allocate()):
        runner.forward([s], [list(range(3, 3 + PROMPT))])
    toks = [5] * len(slots)
    for _ in range(3):  # warm-up
        toks, _, _ = step_allocations(runner, slots, toks)
    counts = []
    for _ in range(4):
        toks, allocs, net = step_allocations(runner, slots, toks)
        assert net == 0, f"{net} bytes allocated in a decode step were still held after it"
        counts.append(len(allocs))
        # A gather of one layer's keys for one sequence at its present context (~100 tokens, bf16): 25 KiB
        kv_gather = KV_HEADS * PROMPT * (HIDDEN // HEADS) * 2
        weight = HIDDEN * HIDDEN  # smallest int8 weight matrix here (o_proj is 256 x 256): 64 KiB
        assert max(allocs) < min(kv_gather, weight) // 4, f"a {max(allocs)}-byte allocation in the hot path"
    assert len(set(counts)) == 1, f"allocations per step vary: {counts}"
