"""Whole decoder layers in one C call (workers/models/fused.py, kernels/cpu/decoder_layer.cpp).

The fused path must give exactly the bits of the torch path with the same kernels (decode, K+1
blocks, batches with padding, tree nodes), fall back to the torch path whenever it cannot run
(torch-kernel linears, q/k norms, reference mode), and notice when the model's modules change.
"""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_model

from ssd.kernels import cpu as cpu_kernels
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models import fused
from ssd.workers.models.dense import DenseLinear, use_dense_kernels
from ssd.workers.models.quant import quantize_model, reference_mode

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")

VOCAB = 256


def tiny(mode: str, dtype: torch.dtype = torch.bfloat16, arch: str = "qwen2"):
    m = random_model(vocab=VOCAB, hidden=128, heads=4, kv_heads=2, layers=3, seed=5, arch=arch).to(dtype)
    return use_dense_kernels(m) if mode == "dense" else quantize_model(m, mode)


def script(model, use_fused: bool) -> list[torch.Tensor]:
    """Logits of a fixed mix of forwards: prefill, decode, a 9-token block, two rows with padding, a tree."""
    model.use_fused_layers = use_fused
    r = ModelRunner(model, max_slots=3, max_len=256)
    a, b = r.allocate(), r.allocate()
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, VOCAB, (120,), generator=g).tolist()
    out = [r.forward([a], [toks[:70]]), r.forward([b], [toks[70:100]])]  # prefills (> 64 tokens: torch SDPA)
    out.append(r.forward([a], [[toks[100]]]))  # decode
    out.append(r.forward([a], [toks[101:110]]))  # verification block
    two = r.forward([b, a], [toks[110:113], toks[113:120]])  # rows of different lengths: padding
    out += [two[0, :3], two[1]]  # (what padding positions hold is undefined)
    out.append(r.forward([b], [[1, 2, 3, 4]], parents=[[-1, 0, 0, 1]]))  # tree nodes
    return out


@pytest.mark.parametrize("mode", ["w4a8", "w8a8", "w4a8-g64", "dense"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_path_gives_the_torch_path_bits(mode, dtype):
    model = tiny(mode, dtype)
    if mode == "w4a8-g64":  # every linear in the group-64 format (kind 5 in the C layers)
        kinds = {fused._linear_kind(m) for m in model.modules() if hasattr(m, "qweight")}
        assert kinds == {5}, kinds
    ref = script(model, use_fused=False)
    assert model._fused is None
    got = script(model, use_fused=True)
    assert model._fused is not None, "the fused path did not run"
    for i, (x, y) in enumerate(zip(ref, got)):
        assert torch.equal(x, y), f"forward {i}: max diff {(x - y).abs().max().item()}"


def test_q_k_v_quantised_differently_run_apart_with_the_same_bits():
    """As in the Q4_K_M qwen-coder-1.5b GGUF: v_proj at 8 bits, q/k at 4, so q/k/v stay three layers."""
    m = random_model(vocab=VOCAB, hidden=128, heads=4, kv_heads=2, layers=3, seed=5).to(torch.bfloat16)
    model = quantize_model(m, "w4a8", overrides={f"layers.{i}.self_attn.v_proj": "w8a8" for i in range(3)})
    assert all(layer.self_attn.qkv_proj is None for layer in model.layers)
    ref = script(model, use_fused=False)
    got = script(model, use_fused=True)
    assert model._fused is not None and all(d.qkv_parts == 3 for d in model._fused.layers)
    for i, (x, y) in enumerate(zip(ref, got)):
        assert torch.equal(x, y), f"forward {i}: max diff {(x - y).abs().max().item()}"


def test_q5_layers_as_in_the_05b_gguf_give_the_same_bits():
    """As in the Q4_K_M qwen-coder-0.5b GGUF: q/k/o/gate/up Q5_0 (W5A8Linear), v Q5_0 or 8-bit, down 4-bit."""
    from ssd.workers.models.blockquant import W5A8Linear

    m = random_model(vocab=VOCAB, hidden=128, heads=4, kv_heads=2, layers=3, seed=5).to(torch.bfloat16)
    q5 = {}
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith(("down_proj", "lm_head")):
            if name.endswith("v_proj") and name.startswith("layers.1."):
                continue
            lin = W5A8Linear.from_float(mod.weight.float())
            q5[name] = (lin.codes(), lin.scale)
    model = quantize_model(m, "w4a8", q5=q5, overrides={"layers.1.self_attn.v_proj": "w8a8"})
    assert isinstance(model.layers[0].self_attn.qkv_proj, W5A8Linear)  # fused q/k/v, all q5
    assert isinstance(model.layers[0].mlp.gate_up_proj, W5A8Linear)
    ref = script(model, use_fused=False)
    got = script(model, use_fused=True)
    kinds = [
        [d.kind for d in (layer.q, layer.o, layer.gate_up, layer.down)]
        + ([layer.k.kind, layer.v.kind] if layer.qkv_parts == 3 else [])
        for layer in model._fused.layers
    ]
    assert kinds[0] == [3, 3, 3, 1] and kinds[1] == [3, 3, 3, 1, 3, 2]  # layer 1: q5 q and k, 8-bit v
    for i, (x, y) in enumerate(zip(ref, got)):
        assert torch.equal(x, y), f"forward {i}: max diff {(x - y).abs().max().item()}"


def test_falls_back_where_it_cannot_run():
    int8 = tiny("int8")
    cache = torch.zeros(1, dtype=torch.bfloat16)
    assert "Int8Linear" in fused.why_not(int8, cache, cache)
    script(int8, use_fused=True)  # runs, on the torch path
    assert int8._fused is None

    qwen3 = tiny("dense", arch="qwen3")
    r = ModelRunner(qwen3, max_slots=1, max_len=64)
    assert "q/k norms" in fused.why_not(qwen3, r.kv.k, r.kv.v)

    model = tiny("w4a8")
    ref = script(model, use_fused=True)
    assert model._fused is not None
    with reference_mode(model):  # the reference path must really run the reference linears
        script(model, use_fused=True)
        assert model._fused is None
    again = script(model, use_fused=True)
    assert model._fused is not None  # back on the fused path once reference mode ends
    assert all(torch.equal(x, y) for x, y in zip(ref, again))


def test_a_swapped_module_is_noticed():
    model = tiny("dense")
    script(model, use_fused=True)
    old = model._fused
    mlp = model.layers[1].mlp
    mlp.down_proj = DenseLinear(mlp.down_proj.weight.detach().clone() * 2, None)
    got = script(model, use_fused=True)
    assert model._fused is not None and model._fused is not old
    ref = script(model, use_fused=False)
    assert all(torch.equal(x, y) for x, y in zip(ref, got))


def test_replaced_tensors_are_noticed():
    """A parameter whose data moved (same Parameter object) and a re-registered buffer both rebuild the descriptors."""
    model = tiny("w4a8")
    script(model, use_fused=True)
    first = model._fused
    norm = model.layers[0].input_layernorm
    norm.weight.data = norm.weight.data.clone() * 2  # same Parameter, new storage
    got = script(model, use_fused=True)
    assert model._fused is not None and model._fused is not first
    assert all(torch.equal(x, y) for x, y in zip(script(model, use_fused=False), got))
    second = model._fused
    gate_up = model.layers[1].mlp.gate_up_proj
    gate_up.qweight = gate_up.qweight.flip(0).contiguous()  # a new buffer object
    got = script(model, use_fused=True)
    assert model._fused is not None and model._fused is not second
    assert all(torch.equal(x, y) for x, y in zip(script(model, use_fused=False), got))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_silu_mul_matches_torch(dtype):
    gu = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(0)) * 4
    # 300 columns: a partial 8-lane chunk per row; extremes: exp's clamps, zero, subnormal results.
    gu[0, :8] = torch.tensor([-100.0, -88.5, -87.0, -30.0, 0.0, 30.0, 88.5, 100.0])
    gu = gu.to(dtype)
    got = cpu_kernels.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up  # torch's exp may differ from libm's in the last fp32 bit
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_kernels.silu_mul(gu[:, :-1])
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_kernels.silu_mul(gu.half())


def test_decoder_layers_rejects_mismatched_input():
    model = tiny("dense")
    r = ModelRunner(model, max_slots=1, max_len=64)
    f = fused.FusedLayers(model, r.kv.k, r.kv.v)
    plan = cpu_kernels.RowPlan.from_rows([(0, 0, 0, 1)])
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    cos = torch.zeros(1, 32, dtype=torch.bfloat16)
    w = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="decoder_layers"):
        f.run(x, cos[:, :16], cos, w, w, plan)  # RoPE rows of the wrong width
    with pytest.raises(ValueError, match="decoder_layers"):
        f.run(x.float(), cos, cos, w, w, plan)  # activations in another dtype than the tables
    with pytest.raises(ValueError, match="fused decoder layers unavailable"):
        fused.FusedLayers(tiny("int8"), r.kv.k, r.kv.v)


def test_silu_mul_bf16_rounds_each_op_as_torch():
    """bf16: silu in fp32, rounded to bf16, times up in fp32, rounded again (torch's op-by-op rounding):
    checked bitwise against torch applied to the kernel's own fp32 silu (up = 1 gives it exactly)."""
    gu = (torch.randn(3, 2 * 203, generator=torch.Generator().manual_seed(1)) * 6).bfloat16()
    gate, up = gu.float().chunk(2, dim=-1)
    silu32 = cpu_kernels.silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=-1))
    want = (silu32.bfloat16().float() * up).bfloat16()
    assert torch.equal(cpu_kernels.silu_mul(gu), want)


def test_fused_layers_give_the_same_bits_from_any_thread_and_team_size():
    """A forward's layers run in one OpenMP region with a barrier of their own (decoder_layer.cpp): the bits
    are those of one thread whatever the calling thread, a second OpenMP team in the process (the main
    thread's, as for an in-process worker), or more threads than cores (the barrier yields)."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny("w4a8")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = script(model, use_fused=True)

        def run(n: int) -> list[torch.Tensor]:
            torch.set_num_threads(n)
            return script(model, use_fused=True)

        torch.set_num_threads(2)
        torch.randn(512, 512) @ torch.randn(512, 512)  # the main thread's own OpenMP team
        with ThreadPoolExecutor(1) as pool:
            for n in (2, 3, 4):
                got = pool.submit(run, n).result()
                for i, (x, y) in enumerate(zip(ref, got)):
                    assert torch.equal(x, y), f"{n} threads, forward {i}: max diff {(x - y).abs().max().item()}"
    finally:
        torch.set_num_threads(threads)


def test_one_token_steps_take_the_lean_path_with_the_same_bits(monkeypatch):
    """A one-token forward of one sequence (a decode step) runs ModelRunner's OneTokenStep: the same logits and cache
    as the general forward; trees, other shapes and a model off the fused layers go the general way."""
    model = tiny("w4a8")
    lean, general = ModelRunner(model, max_slots=2, max_len=64), ModelRunner(model, max_slots=2, max_len=64)
    general.one_token = None
    assert lean.one_token is not None
    calls = []
    real = lean.one_token.hidden
    monkeypatch.setattr(lean.one_token, "hidden", lambda *a: calls.append(a) or real(*a))
    for r in (lean, general):
        r.allocate()
        r.forward([0], [[3, 1, 4, 1, 5]])
    tok, outs = 9, {id(lean): [], id(general): []}
    for step in range(6):
        for r in (lean, general):
            last_only = step % 2 == 0
            outs[id(r)].append(r.forward([0], [[tok]], last_only=last_only))
        tok = int(outs[id(lean)][-1].reshape(-1, VOCAB)[-1].argmax())
    assert len(calls) == 6
    for x, y in zip(outs[id(lean)], outs[id(general)]):
        assert x.shape == y.shape and torch.equal(x, y)
    assert lean.length(0) == general.length(0) == 11
    assert torch.equal(lean.kv.k[:, 0, :, :11], general.kv.k[:, 0, :, :11])
    assert torch.equal(lean.kv.v[:, 0, :, :11], general.kv.v[:, 0, :, :11])
    lean.forward([0], [[7]], parents=[[-1]])  # a tree node: the general path, not asked
    assert len(calls) == 6
    model.use_fused_layers = False
    lean.truncate(0, 11)
    general.truncate(0, 11)
    assert torch.equal(lean.forward([0], [[7]]), general.forward([0], [[7]]))
    assert len(calls) == 7  # asked, and declined: the model is off the fused layers
