"""Weight-only int8 / int4 layers: kernels vs fp32 reference, int4 layout, GGUF Q4_K mapping, plumbing."""

import logging

import numpy as np
import pytest
import torch
from tiny_models import random_model

from ssd.config import Config
from ssd.workers.base import build_model
from ssd.workers.models.quant import (
    Int4Linear,
    Int8Linear,
    cuda_kernel_available,
    pack_int4,
    q4k_to_affine,
    quantize_model,
    reference_mode,
    unpack_int4,
)

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("n", [16, 32, 48, 64, 80, 96, 160])
def test_int4_pack_unpack_roundtrip(n):
    codes = torch.randint(0, 16, (n, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(unpack_int4(pack_int4(codes), n, 96), codes)


def test_int4_kernel_convention():
    """torch._weight_int4pack_mm_for_cpu computes w = (q - 8) * scale + zero, per (group of 32, column)."""
    g = torch.Generator().manual_seed(0)
    n, k = 32, 64
    codes = torch.randint(0, 16, (n, k), generator=g)
    sz = torch.randn(k // 32, n, 2, generator=g)
    y = torch._weight_int4pack_mm_for_cpu(torch.eye(k), pack_int4(codes), 32, sz)  # [k, n] = w.T
    scale = sz[..., 0].T.repeat_interleave(32, dim=1)
    zero = sz[..., 1].T.repeat_interleave(32, dim=1)
    torch.testing.assert_close(y.T, (codes.float() - 8) * scale + zero, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(cls, dtype):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 256, generator=g), torch.randn(96, generator=g)
    x = torch.randn(2, 5, 256, generator=g).to(dtype)
    lin = cls.from_float(w, b, dtype)
    y, ref = lin(x), lin.ref_forward(x)
    assert y.shape == ref.shape == (2, 5, 96) and y.dtype == dtype
    # The kernels accumulate in fp32 and round once to `dtype`: within a couple of output ulps.
    tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    # Round to nearest: int8 per-channel error ~0.5 %, int4 groups of 32 ~8 % (Gaussian weights).
    err = (torch.linalg.norm(w - lin.dequantize()) / torch.linalg.norm(w)).item()
    assert err < (0.01 if cls is Int8Linear else 0.1)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_are_row_independent(cls, dtype):
    g = torch.Generator().manual_seed(2)
    lin = cls.from_float(torch.randn(160, 512, generator=g), None, dtype)
    x = torch.randn(17, 512, generator=g).to(dtype)
    full = lin(x)
    for m in (1, 2, 5, 9):
        assert torch.equal(torch.cat([lin(x[i : i + m]) for i in range(0, 17, m)]), full)


def random_q4k_blocks(n_blocks: int, seed: int) -> np.ndarray:
    """Valid Q4_K super-blocks: random scale/min bytes and nibbles, finite fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    blocks[:, 0:2] = (rng.uniform(1e-4, 3e-3, n_blocks).astype(np.float16)).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = (rng.uniform(1e-4, 3e-3, n_blocks).astype(np.float16)).view(np.uint8).reshape(-1, 2)
    return blocks


def check_q4k_mapping(blocks: np.ndarray, n: int, k: int) -> None:
    import gguf

    want = torch.from_numpy(
        gguf.quants.dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType.Q4_K).reshape(n, k).copy()
    )
    codes, scale, offset = q4k_to_affine(torch.from_numpy(np.array(blocks)), n, k)  # a writable copy
    # fp32 scale/zero: exact up to fp32 rounding of zero = 8 * scale + offset and of the final fma.
    lin32 = Int4Linear.from_affine(codes, scale, offset, None, torch.float32)
    assert torch.equal(lin32.codes(), codes)
    atol = 4 * torch.finfo(torch.float32).eps * want.abs().max().item()
    torch.testing.assert_close(lin32.dequantize(), want, rtol=0, atol=atol)
    # ... and the kernel itself produces those weights.
    eye = torch.eye(k)[: min(k, 64)]
    torch.testing.assert_close(lin32(eye), lin32.dequantize()[:, : eye.shape[0]].T, rtol=1e-6, atol=1e-7)
    # bf16 activations need bf16 scale/zero: the error is that rounding alone, |q - 8| * ds + dz.
    lin16 = Int4Linear.from_affine(codes, scale, offset, None, torch.bfloat16)
    assert torch.equal(lin16.codes(), codes)
    s = scale.repeat_interleave(32, dim=1)
    z = (offset + 8 * scale).repeat_interleave(32, dim=1)
    s16 = lin16.scales_and_zeros[..., 0].float().T.repeat_interleave(32, dim=1)
    z16 = lin16.scales_and_zeros[..., 1].float().T.repeat_interleave(32, dim=1)
    bound = (codes.float() - 8).abs() * (s - s16).abs() + (z - z16).abs()
    assert ((lin16.dequantize() - want).abs() <= bound * 1.001 + 1e-7).all()


def test_q4k_maps_to_int4_without_rerounding():
    n, k = 48, 512
    check_q4k_mapping(random_q4k_blocks(n * k // 256, seed=3), n, k)


def real_gguf_tensor(alias: str, name: str, kind: str) -> tuple[np.ndarray, int, int]:
    """(raw data, N, K) of tensor `name` in the real GGUF `alias`, checked to be of GGML type `kind`."""
    import gguf

    from ssd.workers.loader import resolve_alias

    t = next(t for t in gguf.GGUFReader(resolve_alias(alias)).tensors if t.name == name)
    assert t.tensor_type == gguf.GGMLQuantizationType[kind]
    k, n = (int(x) for x in t.shape[:2])  # GGUF lists ne[] innermost first
    return np.asarray(t.data), n, k


@pytest.mark.real_model
def test_q4k_real_tensor_maps_exactly():
    check_q4k_mapping(*real_gguf_tensor("qwen-coder-1.5b", "blk.0.attn_q.weight", "Q4_K"))


def test_quantize_model_replaces_every_linear(caplog):
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=2).to(torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="ssd.quant"):
        quantize_model(model, "int4")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)  # head="int8" by default
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, Int4Linear)  # fused
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)
    assert model.batch_invariant
    errs = [r for r in caplog.records if "relative error" in r.getMessage()]
    assert len(errs) == 2 * 7 + 1


def test_quantize_model_skip_keeps_float_and_invariance_off():
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2).to(torch.bfloat16)
    quantize_model(model, "int8", head=None)
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert not model.batch_invariant
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(model, "int3")


def test_reference_mode_switches_layers():
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2).to(torch.bfloat16)
    quantize_model(model, "int8")
    lin = model.layers[0].mlp.down_proj
    x = torch.randn(3, 128).to(torch.bfloat16)
    with reference_mode(model):
        assert torch.equal(lin(x), lin.ref_forward(x))
    assert torch.equal(lin(x), torch._weight_int8pack_mm(x, lin.qweight, lin.scales))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("hidden", [64, 80])  # 80: int4 k/v blocks not whole packing blocks -> repacked
def test_fused_projections_match_separate(mode, hidden, device):
    torch.manual_seed(0)
    kw = dict(vocab=64, hidden=hidden, heads=hidden // 16, kv_heads=1, seed=5)
    fused = quantize_model(random_model(**kw).to(device, torch.bfloat16), mode)
    plain = quantize_model(random_model(**kw).to(device, torch.bfloat16), mode, fuse=False)
    attn, mlp = fused.layers[1].self_attn, fused.layers[1].mlp
    assert attn.qkv_proj is not None and attn.q_proj is None and mlp.gate_up_proj is not None
    x = torch.randn(5, hidden).to(device, torch.bfloat16)
    pa, pm = plain.layers[1].self_attn, plain.layers[1].mlp
    want = torch.cat([pa.q_proj(x), pa.k_proj(x), pa.v_proj(x)], dim=-1)
    torch.testing.assert_close(attn.qkv_proj.dequantize(), torch.cat([pa.q_proj.dequantize(), pa.k_proj.dequantize(),
                                                                      pa.v_proj.dequantize()]), rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_proj(x), want, rtol=0, atol=0)
    torch.testing.assert_close(mlp.gate_up_proj(x), torch.cat([pm.gate_proj(x), pm.up_proj(x)], dim=-1), rtol=0, atol=0)


def test_cuda_kernel_probe():
    assert cuda_kernel_available("int8") in (True, False)
    assert cuda_kernel_available("int4") in (True, False)
    assert not cuda_kernel_available("w4a8") and not cuda_kernel_available("w8a8")  # AVX2 kernels only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_cuda_layers_match_reference(cls):
    """On CUDA: int4 codes repacked for the tensor-core kernel unchanged (read back through the kernel),
    and both layers within the format's step of the dequantised fp32 reference."""
    torch.manual_seed(0)
    w = torch.randn(256, 512) * 0.05
    lin = cls.from_float(w, None, torch.bfloat16)
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    ref = lin.ref_forward(x).float()
    gpu = lin.on("cuda") if cls is Int4Linear else lin.to("cuda")
    if cls is Int4Linear:
        assert torch.equal(gpu.codes(), lin.codes())
        with pytest.raises(ValueError, match="packed for cuda"):
            gpu(x)  # a CPU input on a CUDA-packed layer
    got = gpu(x.cuda()).float().cpu()
    assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_int4_needs_bf16():
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=1).cuda()  # fp32
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_model(model, "int4")


def test_config_and_build_model_plumbing():
    with pytest.raises(ValueError, match="quantization"):
        Config(target="x", quantization="fp8")
    assert Config(target="x", quantization="int4").quantization == "int4"
    model, _ = build_model(random_model(vocab=64, hidden=64, heads=4, kv_heads=2), torch.bfloat16, "cpu", "int8")
    assert isinstance(model.lm_head, Int8Linear) and model.batch_invariant


@pytest.mark.real_model
def test_load_model_int4_uses_gguf_codes():
    """qwen-coder-0.5b: the Q4_K ffn_down layers become Int4Linear with the file's codes; the rest int8."""
    import gguf

    from ssd.workers.loader import load_model, resolve_alias

    lm = load_model("qwen-coder-0.5b", quantization="int4", progress=False)
    mods = dict(lm.model.named_modules())
    int4 = sorted(n for n, m in mods.items() if isinstance(m, Int4Linear))
    assert int4 and all(n.endswith("mlp.down_proj") for n in int4)
    assert not any(isinstance(m, torch.nn.Linear) for m in mods.values())
    assert lm.model.batch_invariant
    reader = gguf.GGUFReader(resolve_alias("qwen-coder-0.5b"))
    idx = int(int4[0].split(".")[1])
    t = next(t for t in reader.tensors if t.name == f"blk.{idx}.ffn_down.weight")
    k, n = (int(x) for x in t.shape[:2])
    codes, _, _ = q4k_to_affine(torch.from_numpy(np.asarray(t.data).copy()), n, k)
    assert torch.equal(mods[int4[0]].codes(), codes)


def _random_q4k_gguf(path, vocab: int, hidden: int = 256, ffn: int = 512, heads: int = 4, kv: int = 2) -> None:
    """A tiny qwen2 GGUF whose linear weights (the head too) are Q4_K blocks of random bytes with sane scales."""
    import gguf

    rng = np.random.default_rng(0)
    q4k = gguf.GGMLQuantizationType.Q4_K

    def blocks(n: int, k: int) -> np.ndarray:
        b = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
        for off in (0, 2):  # d and dmin, fp16
            b[:, off:off + 2] = (np.abs(rng.standard_normal(len(b))) * 3e-3 + 1e-4).astype(np.float16).view(
                np.uint8).reshape(-1, 2)
        return b.reshape(n, -1)

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", blocks(vocab, hidden), raw_dtype=q4k)
    hd = hidden // heads
    for part, (n, k) in {"attn_q": (hidden, hidden), "attn_k": (kv * hd, hidden), "attn_v": (kv * hd, hidden),
                         "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
                         "ffn_down": (hidden, ffn)}.items():
        w.add_tensor(f"blk.0.{part}.weight", blocks(n, k), raw_dtype=q4k)
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_q4k_codes_of_any_row_count_are_kept_where_the_kernel_takes_them(tmp_path):
    """W4A8 takes any row count (tiles of 8 rows, padded): a Q4_K head of 72 rows keeps the file's codes in
    w4a8-all. Torch's int4 kernel needs whole column blocks: in int4 the same head is int8, not an error."""
    import gguf

    from ssd.workers.loader import load_model
    from ssd.workers.models.blockquant import W4A8Linear

    path = tmp_path / "q4k.gguf"
    _random_q4k_gguf(path, vocab=72)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "output.weight")
    codes, _, _ = q4k_to_affine(torch.from_numpy(np.asarray(t.data).copy()), 72, 256)
    assert not Int4Linear.supports(72, 256)
    head = load_model(str(path), dtype=torch.bfloat16, cache_dir=str(tmp_path / "c"), progress=False,
                      quantization="w4a8-all").model.lm_head
    assert isinstance(head, W4A8Linear) and torch.equal(head.codes().to(torch.uint8), codes)
    lm = load_model(str(path), dtype=torch.bfloat16, cache_dir=str(tmp_path / "c"), progress=False,
                    quantization="int4")
    assert isinstance(lm.model.lm_head, Int8Linear) and isinstance(lm.model.layers[0].mlp.down_proj, Int4Linear)


def test_a_built_module_is_quantised_on_a_copy_and_never_twice():
    """One module as target (w4a8) and draft (w4a8-g64): each worker gets its own format and the caller's module
    keeps its floating-point layers; quantising a quantised model again is an error, not a silent no-op."""
    from ssd.workers.models.blockquant import W4A8Linear, W4G64A8Linear

    m = random_model(vocab=64, hidden=128, heads=4, kv_heads=2)
    target, _ = build_model(m, torch.bfloat16, "cpu", "w4a8")
    draft, _ = build_model(m, torch.bfloat16, "cpu", "w4a8-g64")
    assert isinstance(target.layers[0].mlp.down_proj, W4A8Linear)
    assert isinstance(draft.layers[0].mlp.down_proj, W4G64A8Linear)
    assert isinstance(m.layers[0].mlp.down_proj, torch.nn.Linear) and m.lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="already quantised .'w4a8'."):
        quantize_model(target, "int4")
    assert quantize_model(target, "w4a8") is target  # the same mode again: nothing to do
