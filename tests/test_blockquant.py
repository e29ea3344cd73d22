"""Block-quantised W4A8 / W4G64A8 / W5A8 / W6A8 / W8A8 layers (AVX2 kernel, ssd/kernels/cpu): kernel vs torch
reference, row independence, rounding bounds, Q4_K, Q5_0 and Q6_K codes kept, model plumbing."""

import numpy as np
import pytest
import torch
from test_quant import random_q4k_blocks, real_gguf_tensor
from tiny_models import random_model

from ssd.kernels import cpu as qk
from ssd.workers.models.blockquant import W4A8Linear, W4G64A8Linear, W5A8Linear, W6A8Linear, W8A8Linear
from ssd.workers.models.quant import Int8Linear, q4k_to_affine, q5_0_codes, q6k_codes, quantize_model

pytestmark = pytest.mark.skipif(not qk.available(), reason=f"block-quantised kernel: {qk.unavailable_reason()}")

CLASSES = [W4A8Linear, W5A8Linear, W6A8Linear, W8A8Linear]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantisation_matches_reference_bitwise(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 160, generator=g) * torch.logspace(-3, 2, 160)).to(dtype)
    x[3, 32:64] = 0  # an all-zero block: dx = 0, xq = 0
    x[4, 0:32] = torch.linspace(-1, 1, 32).to(dtype)  # ties at .5 after scaling (round half to even)
    for got, want in zip(qk.quantize_rows(x), qk.ref_quantize_rows(x)):
        assert torch.equal(got, want)
    xq, dx, _ = qk.quantize_rows(x)
    assert dx[3, 1] == 0 and (xq[3, 32:64] == 0).all()
    assert xq.abs().max() == 127


def test_non_finite_and_tiny_activation_blocks():
    """A block holding a NaN or an infinity quantises to dx = NaN, xq = 0 (every output it feeds is NaN, on
    every build: no INT_MIN from converting NaN); one so small that 1 / dx overflows counts as zero."""
    x = torch.ones(6, 64)
    x[0, 5] = float("nan")  # max drops NaN operands: found apart, at any position
    x[1, 31] = float("nan")
    x[2, 40] = float("inf")
    x[3, :32] = 1e-37  # 1 / (1e-37 / 127) overflows
    x[4, 33] = -float("inf")
    xq, dx, sx = qk.quantize_rows(x)
    rq, rdx, rsx = qk.ref_quantize_rows(x)
    assert torch.equal(xq, rq) and torch.equal(dx.isnan(), rdx.isnan()) and torch.equal(sx.isnan(), rsx.isnan())
    fin = dx.isfinite()
    assert torch.equal(dx[fin], rdx[fin]) and torch.equal(sx[fin], rsx[fin])
    assert dx.isnan().tolist() == [[True, False], [True, False], [False, True], [False, False], [False, True],
                                   [False, False]]
    assert (xq[:2, :32] == 0).all() and (xq[2, 32:] == 0).all() and dx[3, 0] == 0 and (xq[3, :32] == 0).all()
    g = torch.Generator().manual_seed(0)
    for cls in CLASSES:
        y = cls.from_float(torch.randn(24, 64, generator=g), None, torch.float32)(x)
        assert y[[0, 1, 2, 4]].isnan().all() and y[[3, 5]].isfinite().all(), cls.__name__


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17])  # around the kernel's 8-row chunks
# K in blocks of 32: 3 (less than one group of 8), 9 (a group and an odd block: q4's half-empty
# pair), 28 (a half group at the end, as K = 896), 32 (whole groups)
@pytest.mark.parametrize("k", [96, 288, 896, 1024])
def test_kernel_matches_reference(cls, dtype, m, k):
    g = torch.Generator().manual_seed(m)
    w, b = torch.randn(72, k, generator=g), torch.randn(72, generator=g)
    lin = cls.from_float(w, b, dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    y, ref = lin(x), lin.ref_forward(x)
    assert y.shape == ref.shape == (m, 72) and y.dtype == dtype
    # Same math (exact integer block sums, fp32 scaling); only fp32 summation order differs.
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    # and the model it defines is close to the float layer: activation + weight rounding only.
    full = torch.nn.functional.linear(x.float(), w, b)
    rel = (torch.linalg.norm(y.float() - full) / torch.linalg.norm(full)).item()
    assert rel < {W4A8Linear: 0.12, W5A8Linear: 0.06, W6A8Linear: 0.03, W8A8Linear: 0.02}[cls]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [288, 512, 896])  # a half-empty q4 pair / whole groups / a half group
def test_rows_are_independent_bitwise(cls, dtype, threads, k):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(2)
        lin = cls.from_float(torch.randn(161, k, generator=g), None, dtype)  # N odd: uneven thread split
        x = torch.randn(17, k, generator=g).to(dtype)
        full = lin(x)
        for step in (1, 2, 3, 4, 5, 9):
            assert torch.equal(torch.cat([lin(x[i : i + step]) for i in range(0, 17, step)]), full)
        perm = torch.randperm(17, generator=g)
        assert torch.equal(lin(x[perm]), full[perm])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("m", [1, 8])  # single tiles / tile pairs in the AVX-512 build
def test_thread_split_keeps_the_bits(cls, m):
    """1, 2 and 3 threads give the same bits (3 threads: uneven shares of the tiles / rows; N large enough
    that every thread takes several weight chunks)."""
    old = torch.get_num_threads()
    g = torch.Generator().manual_seed(5)
    lin = cls.from_float(torch.randn(1601, 512, generator=g), None, torch.bfloat16)
    x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(lin(x))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_rounding_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-4, 1, 64)[:, None]
    w[0, :32] = 0.5  # a constant block
    q4 = W4A8Linear.from_float(w)
    step4 = q4.scale.float().repeat_interleave(32, dim=1)
    # offset rounded down, scale up (fp16, subnormal for the tiny rows): no code clamps.
    err4 = (q4.dequantize() - w).abs()
    assert (err4 <= 0.5 * step4 * 1.01).all()
    assert torch.equal(q4.dequantize()[0, :32], torch.full((32,), 0.5))
    q8 = W8A8Linear.from_float(w)
    step8 = q8.scale.float().repeat_interleave(32, dim=1)
    assert ((q8.dequantize() - w).abs() <= 0.5 * step8 * 1.01).all()
    w[1, :64] = -0.25  # a constant group
    g64 = W4G64A8Linear.from_float(w)
    assert g64.scale.shape == g64.offset.shape == (64, 256 // 64)
    step64 = g64.scale.float().repeat_interleave(64, dim=1)
    assert ((g64.dequantize() - w).abs() <= 0.5 * step64 * 1.01).all()
    assert torch.equal(g64.dequantize()[1, :64], torch.full((64,), -0.25))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(40, 128), (13, 640), (44, 896)])  # 5 tiles (pairs + an odd one); padded; 14 groups
def test_q4g64_is_q4_with_each_scale_repeated_bitwise(dtype, threads, n, k):
    """A scale and offset per 64 weights: the kernel's integer sums and float steps stay per block of 32, so every
    output has the bits of the W4A8Linear whose two blocks of a group share the group's scale and offset, at
    every row count (single tiles, tile pairs, several passes) and thread count; near the float reference."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n + k)
        lin = W4G64A8Linear.from_float(torch.randn(n, k, generator=g), torch.randn(n, generator=g), dtype)
        q4 = lin.as_q4()
        assert type(q4) is W4A8Linear and torch.equal(q4.dequantize(), lin.dequantize())
        x = torch.randn(21, k, generator=g).to(dtype)
        y = lin(x)
        assert torch.equal(y, q4(x))
        for m in (1, 2, 3, 5, 8, 9, 17):
            assert torch.equal(lin(x[:m]), y[:m])
            assert torch.equal(q4(x[:m]), y[:m])
        ref = lin.ref_forward(x)
        tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    finally:
        torch.set_num_threads(old)


def test_q4g64_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="not a multiple of 64"):
        W4G64A8Linear.from_float(torch.randn(8, 96))
    with pytest.raises(ValueError, match="one per 64"):
        W4G64A8Linear(torch.zeros(8, 128, dtype=torch.uint8), torch.ones(8, 4), torch.zeros(8, 4), None)
    lin = W4G64A8Linear.from_float(torch.randn(8, 128))
    with pytest.raises(ValueError, match="offset"):
        qk.linear(torch.zeros(1, 128), lin.qweight, lin.scale_bits.view(torch.float16), None, fmt="q4g64", n=8)


def test_q4k_codes_kept_and_weights_up_to_fp16_scales():
    import gguf

    n, k = 32, 512
    blocks = random_q4k_blocks(n * k // 256, seed=4)
    want = torch.from_numpy(
        gguf.quants.dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType.Q4_K).reshape(n, k).copy()
    )
    codes, scale, offset = q4k_to_affine(torch.from_numpy(np.array(blocks)), n, k)
    lin = W4A8Linear.from_affine(codes, scale, offset, None, torch.float32)
    assert torch.equal(lin.codes(), codes)
    # Only scale = d * sc and offset = -dmin * m are rounded (to fp16): error <= q * ds + do.
    s = scale.repeat_interleave(32, dim=1)
    o = offset.repeat_interleave(32, dim=1)
    s16 = lin.scale.float().repeat_interleave(32, dim=1)
    o16 = lin.offset.float().repeat_interleave(32, dim=1)
    bound = codes.float() * (s - s16).abs() + (o - o16).abs()
    assert ((lin.dequantize() - want).abs() <= bound * 1.001 + 1e-7).all()


def random_blocks(n_blocks: int, size: int, d_at: int, d_max: float, seed: int) -> np.ndarray:
    """Valid GGUF blocks of `size` bytes: random bytes, but a finite fp16 d (|d| <= d_max) at byte d_at."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    d = rng.uniform(d_max / 30, d_max, n_blocks) * rng.choice([-1, 1], n_blocks)
    blocks[:, d_at : d_at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


def random_q5_0_blocks(n_blocks: int, seed: int) -> np.ndarray:
    return random_blocks(n_blocks, 22, 0, 3e-3, seed)  # fp16 d, high bits, nibbles


@pytest.mark.parametrize("k", [512, 288])  # 288: an odd number of blocks (the last pair half empty)
def test_q5_0_codes_kept_exactly(k):
    import gguf

    n = 8
    blocks = random_q5_0_blocks(n * k // 32, seed=k)
    want = torch.from_numpy(
        gguf.quants.dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType.Q5_0).reshape(n, k).copy()
    )
    codes, scale = q5_0_codes(torch.from_numpy(np.array(blocks)), n, k)
    assert codes.max() <= 31 and scale.dtype == torch.float16
    lin = W5A8Linear.from_q5(codes, scale, None, torch.float32)
    assert torch.equal(lin.codes(), codes)
    assert torch.equal(lin.dequantize(), want)  # d * (q - 16): exact in fp32
    x = torch.randn(3, k)
    torch.testing.assert_close(lin(x), lin.ref_forward(x), rtol=1e-5, atol=1e-5 * lin.ref_forward(x).abs().max().item())


@pytest.mark.parametrize("cls,bits", [(W5A8Linear, 1), (W6A8Linear, 2)])
def test_high_bit_pack_layout(cls, bits):
    # 11 rows (a whole tile of 8 and a zero-padded one of 3), 2 blocks
    codes = torch.randint(0, 16 << bits, (11, 64), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    packed = cls.pack(codes)
    size = 128 + 32 * bits
    assert packed.shape == (2, 2 * size)
    block = packed[0, size : 2 * size]  # tile 0, block 1
    # the low 4 bits as W4A8 packs them
    assert torch.equal(block[:128], W4A8Linear.pack(codes[:8, 32:64] & 0x0F)[0])
    # then planes: bits b(v % vpp) .. of byte 4r + j of plane v // vpp are the high bits of
    # q[r][8c + 4h + j], v = 2c + h (vpp = 8 / b vectors per plane)
    vpp = 8 // bits
    for v in range(8):
        c, h = divmod(v, 2)
        vec = codes[:8, 32 + 8 * c + 4 * h : 32 + 8 * c + 4 * h + 4].reshape(32)  # [row, j]
        plane = block[128 + 32 * (v // vpp) : 160 + 32 * (v // vpp)]
        assert torch.equal((plane >> (bits * (v % vpp))) & ((1 << bits) - 1), vec >> 4)
    assert (packed[1].view(2, size)[:, :128].reshape(2, 4, 8, 4)[:, :, 3:] == 0).all()  # padding rows
    lin = cls(codes, torch.ones(11, 64 // cls.SUB), None)
    assert torch.equal(lin.codes(), codes) and lin.scale_bits.shape == (2, 64 // cls.SUB, 8)
    code_max = (16 << bits) - 1
    with pytest.raises(ValueError, match=f"0..{code_max}"):
        cls(torch.full((1, 32), code_max + 1, dtype=torch.uint8), torch.ones(1, 32 // cls.SUB), None)
    with pytest.raises(ValueError, match=f"one per {cls.SUB}"):
        cls(codes, torch.ones(11, 1), None)


def test_pack_layout():
    # 11 rows: a whole tile of 8 and a tile holding 3 (zero-padded); 2 blocks
    codes = torch.randint(0, 16, (11, 64), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    packed = W4A8Linear.pack(codes)
    assert packed.shape == (2, 2 * 128)
    for tile, row, block, chunk, j in [(0, 0, 0, 0, 0), (0, 5, 1, 2, 3), (1, 2, 0, 3, 1), (0, 7, 1, 3, 3)]:
        q = codes[8 * tile + row, 32 * block :]
        byte = packed[tile, 128 * block + 32 * chunk + 4 * row + j].item()
        assert byte == q[8 * chunk + j].item() | (q[8 * chunk + 4 + j].item() << 4)
    assert (packed[1].view(2, 4, 8, 4)[:, :, 3:] == 0).all()  # padding rows
    scale, offset = torch.rand(11, 2) + 0.5, torch.rand(11, 2)
    lin = W4A8Linear(codes, scale, offset, None, torch.float32)
    assert torch.equal(lin.codes(), codes)
    assert torch.equal(lin.scale, scale.half()) and torch.equal(lin.offset, offset.half())
    assert torch.equal(lin.scale_bits.view(torch.float16)[0, 1], scale[:8, 1].half())  # a block's 8 rows side by side
    assert lin.scale_bits.shape == (2, 2, 8) and (lin.offset_bits[1, :, 3:] == 0).all()
    with pytest.raises(ValueError, match="one per 32"):
        W4A8Linear(codes, torch.ones(11, 4), torch.ones(11, 4), None)


def test_q8_pack_layout():
    """q8 tiles: byte 32 v + 4 r + j of a tile's block holds row r's code 4 v + j, plus 128; padding rows
    hold q = 0 (128); codes() gives back the signed codes, both extremes included."""
    codes = torch.randint(-127, 128, (11, 64), generator=torch.Generator().manual_seed(8)).to(torch.int8)
    codes[0, :4] = torch.tensor([-128, -127, 0, 127], dtype=torch.int8)
    packed = W8A8Linear.pack(codes)
    assert packed.shape == (2, 2 * 256) and packed.dtype == torch.uint8
    for tile, row, block, v, j in [(0, 0, 0, 0, 0), (0, 5, 1, 2, 3), (1, 2, 0, 7, 1), (0, 7, 1, 6, 2)]:
        byte = packed[tile, 256 * block + 32 * v + 4 * row + j].item()
        assert byte == codes[8 * tile + row, 32 * block + 4 * v + j].item() + 128
    assert (packed[1].view(2, 8, 8, 4)[:, :, 3:] == 128).all()  # padding rows
    scale = torch.rand(11, 2) + 0.5
    lin = W8A8Linear(codes, scale, None, torch.float32)
    assert torch.equal(lin.codes(), codes) and torch.equal(lin.scale, scale.half())
    assert torch.equal(lin.dequantize(), codes.float() * scale.half().float().repeat_interleave(32, dim=1))
    with pytest.raises(ValueError, match="int8"):
        W8A8Linear(codes.to(torch.int16), scale, None)
    with pytest.raises(ValueError, match="one per 32"):
        W8A8Linear(codes, torch.ones(11, 1), None)


@pytest.mark.parametrize("cls", CLASSES)
def test_some_rows_unpack_as_all_rows(cls):
    """codes(rows) / scale_of(rows) (/ offset_of) unpack only the rows' tiles: the same as indexing the whole."""
    g = torch.Generator().manual_seed(3)
    lin = cls.from_float(torch.randn(37, 64, generator=g), None, torch.float32)
    for rows in (torch.tensor([36, 0, 9, 9, 17]), torch.arange(37), torch.tensor([5])):
        assert torch.equal(lin.codes(rows), lin.codes()[rows])
        assert torch.equal(lin.scale_of(rows), lin.scale[rows])
        if cls is W4A8Linear:
            assert torch.equal(lin.offset_of(rows), lin.offset[rows])


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("n", [8, 13, 72])
def test_tiles_any_row_count_and_batch_invariant(cls, n):
    """Rows in tiles of 8 (a padded last tile for 13): every row count M gives each row the bits of M = 1."""
    g = torch.Generator().manual_seed(n)
    lin = cls.from_float(torch.randn(n, 96, generator=g), torch.randn(n, generator=g), torch.float32)
    x = torch.randn(11, 96, generator=g)
    y = lin(x)
    ref = lin.ref_forward(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for m in (1, 3, 4, 5, 8, 11):
        assert torch.equal(lin(x[:m]), y[:m])
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(11)]), y)


def test_quantize_model_w4a8_plumbing():
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=2).to(torch.bfloat16)
    quantize_model(model, "w4a8")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, W8A8Linear)  # the head keeps 8 bits
    assert isinstance(model.layers[0].self_attn.qkv_proj, W4A8Linear)  # fused
    assert isinstance(model.layers[0].mlp.gate_up_proj, W4A8Linear)
    assert model.batch_invariant
    m8 = quantize_model(random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=1), "w8a8")
    assert all(isinstance(m, W8A8Linear) for m in m8.modules() if hasattr(m, "qweight"))


def test_quantize_model_w4a8_all_puts_every_layer_in_q4():
    """w4a8-all: the head in q4 too, q5 / q6 codes rounded to q4 instead of kept, q4 codes (Q4_K) kept."""
    g = torch.Generator().manual_seed(9)
    model = random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=1).to(torch.bfloat16)
    o = model.layers[0].self_attn.o_proj.weight
    affine = {"layers.0.self_attn.o_proj": (torch.randint(0, 16, tuple(o.shape), generator=g, dtype=torch.uint8),
                                            torch.rand(o.shape[0], o.shape[1] // 32, generator=g) * 0.01,
                                            torch.zeros(o.shape[0], o.shape[1] // 32))}
    down = model.layers[0].mlp.down_proj.weight
    q5 = {"layers.0.mlp.down_proj": (torch.randint(0, 32, tuple(down.shape), generator=g, dtype=torch.uint8),
                                     torch.full((down.shape[0], down.shape[1] // 32), 0.01).half())}
    quantize_model(model, "w4a8-all", affine_int4=affine, q5=q5)
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "qweight")}
    assert layers and all(type(m) is W4A8Linear for m in layers.values()), {n: type(m) for n, m in layers.items()}
    assert isinstance(model.lm_head, W4A8Linear) and model.batch_invariant
    assert torch.equal(model.layers[0].self_attn.o_proj.codes(), affine["layers.0.self_attn.o_proj"][0])
    assert model.quantization == "w4a8-all"
    kept = quantize_model(random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=1).to(torch.bfloat16),
                          "w4a8", q5=q5)
    assert isinstance(kept.layers[0].mlp.down_proj, W5A8Linear)  # plain w4a8 keeps the 5 bits


def test_quantize_model_w4a8_g64():
    """w4a8-g64: every layer (the head too) in q4 with a scale per 64, q / k / v and gate / up fused; inputs that
    are not whole groups of 64 (hidden 96) stay in q4 per 32."""
    model = random_model(vocab=64, hidden=128, heads=4, kv_heads=2, layers=2).to(torch.bfloat16)
    quantize_model(model, "w4a8-g64")
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "qweight")}
    assert layers and all(type(m) is W4G64A8Linear for m in layers.values()), {n: type(m) for n, m in layers.items()}
    assert isinstance(model.layers[0].self_attn.qkv_proj, W4G64A8Linear) and model.batch_invariant
    odd = quantize_model(random_model(vocab=64, hidden=96, heads=4, kv_heads=2, layers=1), "w4a8-g64")
    assert type(odd.layers[0].self_attn.qkv_proj) is W4A8Linear


def test_fused_projection_equals_separate():
    g = torch.Generator().manual_seed(5)
    parts = [W4A8Linear.from_float(torch.randn(n, 96, generator=g), torch.randn(n, generator=g)) for n in (64, 32)]
    from ssd.workers.models.blockquant import concat_block_linears

    fused = concat_block_linears(parts)
    x = torch.randn(3, 96, generator=g).bfloat16()
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))
    assert concat_block_linears([parts[0], W8A8Linear.from_float(torch.randn(8, 96))]) is None
    g64 = [W4G64A8Linear.from_float(torch.randn(n, 128, generator=g), None) for n in (13, 16)]  # repacked from codes
    x = torch.randn(3, 128, generator=g).bfloat16()
    fused = concat_block_linears(g64)
    assert type(fused) is W4G64A8Linear and torch.equal(fused(x), torch.cat([p(x) for p in g64], dim=1))


@pytest.mark.parametrize("cls", [W4A8Linear, W5A8Linear, W6A8Linear])
@pytest.mark.parametrize("sizes", [(16, 8, 13), (13, 8), (8, 5, 3)])
def test_fused_tiled_layers_equal_the_layer_packed_from_their_codes(cls, sizes):
    """Parts filling whole tiles stack their packed tiles as they are; a part ending inside a tile (not
    the last) is repacked from codes. Either way: the buffers of one layer built from the joined codes."""
    from ssd.workers.models.blockquant import concat_block_linears

    g = torch.Generator().manual_seed(sum(sizes))
    parts = [cls.from_float(torch.randn(n, 64, generator=g), torch.randn(n, generator=g)) for n in sizes]
    fused = concat_block_linears(parts)
    assert type(fused) is cls and (fused.out_features, fused.in_features) == (sum(sizes), 64)
    joined = torch.cat([p.codes() for p in parts])
    want = cls.pack(joined)
    assert torch.equal(fused.qweight, want) and torch.equal(fused.codes(), joined)
    assert torch.equal(fused.scale, torch.cat([p.scale for p in parts]))
    if cls is W4A8Linear:
        assert torch.equal(fused.offset, torch.cat([p.offset for p in parts]))
    assert torch.equal(fused.bias, torch.cat([p.bias for p in parts]))
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))


def test_shapes_the_kernel_cannot_take_stay_int8():
    model = random_model(vocab=64, hidden=48, heads=4, kv_heads=2, layers=1)  # K = 48: not whole blocks
    quantize_model(model, "w4a8")
    assert isinstance(model.layers[0].self_attn.o_proj, Int8Linear)


def test_bad_input_is_a_clear_error():
    lin = W8A8Linear.from_float(torch.randn(8, 64))
    with pytest.raises(ValueError, match="fp32/bf16"):
        qk.quantize_rows(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="shape"):
        lin(torch.zeros(2, 48))


def test_model_to_dtype_keeps_the_quantised_weights():
    """`model.to(dtype)` casts floating-point buffers; the fp16 scales are stored as bits and survive."""
    g = torch.Generator().manual_seed(6)
    lin4 = W4A8Linear.from_float(torch.randn(32, 64, generator=g), torch.randn(32, generator=g), torch.float32)
    lin8 = W8A8Linear.from_float(torch.randn(32, 64, generator=g), None, torch.float32)
    x = torch.randn(2, 64, generator=g)
    for lin in (lin4, lin8):
        before, w_before = lin(x), lin.dequantize()
        lin.to(torch.bfloat16)
        assert lin.scale.dtype == torch.float16 and torch.equal(lin.dequantize(), w_before)
        tol = 2**-6
        torch.testing.assert_close(lin(x.bfloat16()).float(), before, rtol=tol, atol=tol * before.abs().max().item())


@pytest.mark.real_model
def test_real_05b_w4a8_all_is_q4_throughout():
    """qwen-coder-0.5b with "w4a8-all": every linear layer (the head too) in q4 tiles, the Q4_K layers' codes as
    "w4a8" keeps them, and fewer bytes than "w4a8" (whose Q5_0 / Q6_K layers and w8a8 head keep their bits)."""
    from ssd.workers.loader import load_model

    def load(mode):
        return load_model("qwen-coder-0.5b", dtype=torch.bfloat16, quantization=mode, progress=False).model

    def nbytes(model):
        return sum(b.numel() * b.element_size() for m in model.modules() if hasattr(m, "qweight") for b in m.buffers())

    small, full = load("w4a8-all"), load("w4a8")
    assert all(type(m) is W4A8Linear for m in small.modules() if hasattr(m, "qweight"))
    q4k = [n for n, m in full.named_modules() if type(m) is W4A8Linear]
    assert q4k, "the file's Q4_K layers"
    for name in q4k:
        assert torch.equal(small.get_submodule(name).codes(), full.get_submodule(name).codes()), name
    assert nbytes(small) < 0.8 * nbytes(full)
    g64 = load("w4a8-g64")
    assert all(type(m) is W4G64A8Linear for m in g64.modules() if hasattr(m, "qweight"))  # 896 and 4864: whole groups
    assert nbytes(g64) < 0.92 * nbytes(small)


@pytest.mark.real_model
def test_real_05b_q5_0_layers_load_exactly():
    """qwen-coder-0.5b's Q4_K_M GGUF stores q/k/o/gate/up as Q5_0: w4a8 keeps their 5-bit codes."""
    import gguf

    from ssd.workers.loader import load_model

    data, n, k = real_gguf_tensor("qwen-coder-0.5b", "blk.0.ffn_gate.weight", "Q5_0")
    want = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q5_0).reshape(n, k).copy())
    model = load_model("qwen-coder-0.5b", dtype=torch.bfloat16, quantization="w4a8", progress=False).model
    gate_up = model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, W5A8Linear)
    assert torch.equal(gate_up.dequantize()[:n], want)  # gate rows first, exactly the file's weights


@pytest.mark.parametrize("build", qk.supported_isas())
@pytest.mark.parametrize("cls,top", [(W4A8Linear, 15), (W4G64A8Linear, 15), (W5A8Linear, 31), (W6A8Linear, 63),
                                     (W8A8Linear, 127), (W8A8Linear, -127), (W8A8Linear, -128)])
def test_tiles_largest_codes_do_not_overflow_int16(cls, top, build, monkeypatch):
    """Every code at its extreme against activations all +-127, in every build this CPU runs: the int16 partial
    sums are at their bound (q4: 8 * 2 * 15 * 127, q5: 4 * 2 * 31 * 127, q6: 2 * 2 * 63 * 127, q8 without
    VNNI: 2 * 128 * 127) and must not wrap; q8 with VNNI starts each sum at -128 * sum(xq)."""
    lib = qk.load(build)
    monkeypatch.setattr(qk, "_lib", lambda: lib)
    if cls in (W4A8Linear, W4G64A8Linear):
        groups = 64 // cls.SUB
        lin = cls(torch.full((16, 64), top, dtype=torch.uint8), torch.ones(16, groups), torch.zeros(16, groups), None,
                  torch.float32)
    elif cls is W8A8Linear:
        lin = W8A8Linear(torch.full((16, 64), top, dtype=torch.int8), torch.ones(16, 2), None, torch.float32)
    else:
        lin = cls(torch.full((16, 64), top, dtype=torch.uint8), torch.ones(16, 64 // cls.SUB), None, torch.float32)
    for sign in (1.0, -1.0):
        x = torch.full((1, 64), sign)
        torch.testing.assert_close(lin(x), lin.ref_forward(x), rtol=0, atol=0)
        x8 = x.expand(8, 64).contiguous()  # the multi-row kernels (16 weight rows: a pair of tiles on AVX-512)
        torch.testing.assert_close(lin(x8), lin.ref_forward(x8), rtol=0, atol=0)


def random_q6k_blocks(n_blocks: int, seed: int) -> np.ndarray:
    return random_blocks(n_blocks, 210, 208, 3e-4, seed)  # codes, int8 scales, then fp16 d


def check_q6k_codes(blocks: np.ndarray, n: int, k: int) -> W6A8Linear:
    """The codes reproduce gguf's dequantisation exactly with d * sc in fp32; W6A8Linear keeps them, and
    its weights differ only by the fp16 rounding of d * sc."""
    import gguf

    want = gguf.quants.dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType.Q6_K)
    want = torch.from_numpy(want.reshape(n, k).copy())
    codes, scale = q6k_codes(torch.from_numpy(np.array(blocks)), n, k)
    assert codes.max() <= 63 and scale.shape == (n, k // 16) and scale.dtype == torch.float16
    raw = torch.from_numpy(np.array(blocks)).reshape(-1, 210)
    d = raw[:, 208:210].contiguous().view(torch.float16).float()
    exact = (d * raw[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, k // 16)  # d * sc in fp32
    assert torch.equal((codes.float() - 32).view(n, -1, 16) * exact[..., None], want.view(n, -1, 16))
    lin = W6A8Linear(codes, scale, None, torch.float32)
    assert torch.equal(lin.codes(), codes)
    bound = 32 * (exact - scale.float()).abs().repeat_interleave(16, dim=1)
    assert ((lin.dequantize() - want).abs() <= bound * 1.001 + 1e-12).all()
    return lin


def test_q6k_codes_kept_and_weights_up_to_fp16_scales():
    lin = check_q6k_codes(random_q6k_blocks(16 * 512 // 256, seed=6), 16, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    ref = lin.ref_forward(x)
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.real_model
def test_real_15b_q6k_layers_load_as_q6():
    """qwen-coder-1.5b's Q4_K_M GGUF stores the head, v and half of down as Q6_K: w4a8 keeps their codes."""
    from ssd.workers.loader import load_model

    check_q6k_codes(*real_gguf_tensor("qwen-coder-1.5b", "blk.0.ffn_down.weight", "Q6_K"))
    model = load_model("qwen-coder-1.5b", dtype=torch.bfloat16, quantization="w4a8", progress=False).model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, W6A8Linear) and isinstance(model.lm_head, W6A8Linear)
    data, n, k = real_gguf_tensor("qwen-coder-1.5b", "blk.0.ffn_down.weight", "Q6_K")
    assert torch.equal(down.codes(), q6k_codes(torch.from_numpy(np.array(data)), n, k)[0])


@pytest.mark.parametrize("build", [name for name in qk.ISA_FLAGS if name != "avx2"])
def test_vnni_builds_give_the_avx2_bits(build, monkeypatch):
    """The VNNI builds only compute the integer block sums with fewer instructions: every layer kind
    and a whole quantised model (fused decoder layers) give the avx2 build's bits."""
    if build not in qk.supported_isas():
        pytest.skip(f"this CPU cannot run the {build} build")
    libs = {name: qk.load(name) for name in ("avx2", build)}
    if build == "amx":  # q4 and q5 products of 12 or more rows below (13, 16, 21; the 20-token prefill) use the tiles
        assert libs[build].ssd_amx_min_rows(-1) == 12, "the OS refused AMX's tile state"

    def run(fn):
        out = {}
        for name, lib in libs.items():
            monkeypatch.setattr(qk, "_lib", lambda lib=lib: lib)
            out[name] = fn()
        return out["avx2"], out[build]

    g = torch.Generator().manual_seed(11)
    xnan = torch.ones(3, 64)
    xnan[0, 7], xnan[1, 40] = float("nan"), float("inf")
    for cls in CLASSES:  # non-finite activations: NaN outputs on both builds, the finite row the same bits
        lin = cls.from_float(torch.randn(16, 64, generator=g), None, torch.float32)
        base, fast = run(lambda lin=lin: lin(xnan))
        assert torch.equal(base.isnan(), fast.isnan()) and base[:2].isnan().all()
        assert torch.equal(base[2], fast[2])
    for cls in CLASSES:
        # 40 rows: 5 tiles (the AVX-512 build's pairs plus an odd tile); 44: 6 tiles, the last pair
        # 12 rows. M: 1 to 8 rows in one pass, then 9 and 13 in two (the amx build: 16 in one, 21 in two).
        # K = 288, 352, 896: 9, 11 and 28 blocks (a half-empty pair of tiles at 40 rows).
        for n, k in ((40, 288), (24, 352), (44, 896)):
            lin = cls.from_float(torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.bfloat16)
            for m in (1, 3, 5, 8, 9, 13, 16, 21):
                x = torch.randn(m, k, generator=g).bfloat16()
                base, fast = run(lambda lin=lin, x=x: lin(x))
                assert torch.equal(base, fast), (cls.__name__, k, m)
    for n, k in ((40, 384), (44, 896)):  # q4g64: 6 and 14 groups
        lin = W4G64A8Linear.from_float(torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.bfloat16)
        for m in (1, 3, 8, 9, 16, 21):
            x = torch.randn(m, k, generator=g).bfloat16()
            base, fast = run(lambda lin=lin, x=x: lin(x))
            assert torch.equal(base, fast), ("q4g64", k, m)
    from ssd.workers.model_runner import ModelRunner

    model = quantize_model(random_model(vocab=64, hidden=64, heads=4, kv_heads=2, layers=2).to(torch.bfloat16), "w4a8")

    def forward():
        runner = ModelRunner(model, max_slots=1, max_len=64)
        slot = runner.allocate()
        prefill = runner.forward([slot], [list(range(3, 23))])
        logits = torch.cat([prefill[0], runner.forward([slot], [[5, 9, 2, 7]])[0]])  # [24, V]
        assert model._fused is not None  # the layers ran as one C call (ssd_decoder_layers)
        return logits

    base, fast = run(forward)
    assert torch.equal(base, fast)


def test_kernel_build_choice(monkeypatch):
    assert qk.isa() == qk.supported_isas()[0] and qk.supported_isas()[-1] == "avx2"
    monkeypatch.setenv("SSD_CPU_ISA", "avx2")
    assert qk.isa() == "avx2"
    monkeypatch.setenv("SSD_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="expected one of"):
        qk.isa()
    missing = [name for name in qk.ISA_FLAGS if name not in qk.supported_isas()]
    if missing:
        monkeypatch.setenv("SSD_CPU_ISA", missing[0])
        with pytest.raises(ValueError, match="this CPU lacks"):
            qk.isa()
