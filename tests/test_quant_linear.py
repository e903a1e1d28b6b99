"""Weight formats and `cpu_linear.c`: at every CPU level this machine can execute, a product over packed weights
equals the fp32 product of the dequantized weights up to fp32 summation order, for every format, ragged shapes
and both activation dtypes; GGUF blocks are read as the file holds them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_isa, quant_linear
from pdserve.kernels.quant_linear import FORMATS, Blocks, QuantLinear
from tests.cpu_levels import LEVELS, build_for, require_built

SHAPES = [  # (rows, out, in): every tile height of 1 to 8 rows, several tiles, more than a 64-row chunk,
    # 9+ and 32+ rows (vdpbf16ps reading each block's pairs from L1)
    (1, 16, 32),
    (1, 37, 100),
    (2, 40, 70),
    (3, 576, 576),
    (4, 24, 64),
    (5, 19, 33),
    (6, 50, 96),
    (7, 17, 40),
    (8, 48, 64),
    (13, 130, 96),
    (12, 40, 100),
    (40, 40, 100),
    (70, 33, 160),
]


@pytest.fixture(scope="module", params=LEVELS)
def kernels(request, tmp_path_factory):
    """`cpu_linear.c` built for one level (the cap chooses -march), as the engine would load it there."""
    mp = pytest.MonkeyPatch()
    build_for(mp, request.param)
    lib = quant_linear.load(tmp_path_factory.mktemp(f"kernels-{request.param}"))
    mp.undo()
    require_built(lib, f"cpu_linear.c ({request.param})")
    return lib


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What fp32 summation-order error can reach: a few ulps of sum |x||w|."""
    return 64 * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T) + 1e-30


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_product_is_the_fp32_product_of_the_dequantized_weights(kernels, fmt, shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, bias = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    blocks = quant_linear.quantize(w, fmt)
    dense = quant_linear.dequantize(blocks)
    packed = quant_linear.pack(blocks, kernels.q4_chunks)
    out = kernels.linear(x, packed, fmt, n, bias)
    ref = x.double() @ dense.double().T + bias.double()
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= _bound(x, dense) + 1e-6).all(), (out - ref).abs().max()
    # bf16 activations in and out: the same product, rounded once at the end
    xb = x.bfloat16()
    outb = kernels.linear(xb, packed, fmt, n, bias)
    refb = (xb.double() @ dense.double().T + bias.double()).bfloat16()
    assert outb.dtype == torch.bfloat16
    assert ((outb.double() - refb.double()).abs() <= refb.double().abs() * 2**-7 + _bound(xb.float(), dense)).all()
    # the whole weight back as fp32: what prompt shapes multiply
    back = kernels.dequantize(packed, fmt, n, k)
    assert back.shape == (k, n) and torch.allclose(back.t(), dense, rtol=2e-7, atol=0)


def test_4_bit_quants_are_laid_out_for_the_vector_width(kernels, request):
    """AVX-512 builds read 4-bit quants in 64-byte chunks, the others a byte per (k pair, column); pack writes the
    layout the build reports, and both hold the same quants."""
    level = request.node.callspec.params["kernels"]
    wide = "avx512f" in cpu_isa.cpu_flags() if level == "native" else level == "avx512"
    assert kernels.q4_chunks == wide
    blocks = quant_linear.quantize(torch.randn(20, 70), "q4_1")
    chunks, nibbles = quant_linear.pack(blocks, True), quant_linear.pack(blocks, False)
    assert chunks.numel() == nibbles.numel() and not torch.equal(chunks, nibbles)
    assert torch.equal(
        chunks.bitwise_and(15).sum() + chunks.bitwise_right_shift(4).sum(),
        nibbles.bitwise_and(15).sum() + nibbles.bitwise_right_shift(4).sum(),
    )


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_quantization_rounds_to_the_nearest_level_of_each_block(fmt):
    w = torch.randn(24, 96) * torch.linspace(0.01, 3, 96)  # blocks of very different ranges
    b = quant_linear.quantize(w, fmt)
    assert b.d is not None and b.q.shape == (24, 3, 32)
    step = b.d.float().abs().repeat_interleave(32, dim=1)
    err = (quant_linear.dequantize(b) - w).abs()
    # half a step (fp16 scales round a little); q4_0's levels run from -8 to 7 steps, with the largest magnitude
    # on the -8 side, so the other side's extreme can lose up to a whole step, as in ggml
    within = 1.0 if fmt == "q4_0" else 0.5
    assert (err <= step * within + step * 1e-2 + 1e-3 * w.abs()).all()
    assert b.nbytes == 24 * 3 * {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]


def test_gguf_blocks_are_read_as_ggml_lays_them_out():
    """A Q4_1 and a Q8_0 block written byte by byte as ggml does (fp16 scale, fp16 minimum, nibbles: element j
    low, j + 16 high; int8 values) read back as those values."""
    d, m = torch.tensor([0.5], dtype=torch.float16), torch.tensor([-2.0], dtype=torch.float16)
    q = torch.arange(32) % 16
    qs = (q[:16] | (q[16:] << 4)).to(torch.uint8)
    raw = torch.cat([d.view(torch.uint8), m.view(torch.uint8), qs]).view(1, 20)
    b = quant_linear.from_gguf(raw, "q4_1", 1, 32)
    assert torch.equal(quant_linear.dequantize(b)[0], 0.5 * q.float() - 2.0)
    q8 = torch.arange(-16, 16, dtype=torch.int8)
    raw8 = torch.cat([d.view(torch.uint8), q8.view(torch.uint8)]).view(1, 34)
    assert torch.equal(quant_linear.dequantize(quant_linear.from_gguf(raw8, "q8_0", 1, 32))[0], 0.5 * q8.float())


def test_fused_parts_of_different_formats_are_held_exactly():
    a = quant_linear.quantize(torch.randn(16, 64), "q4_1")
    b = quant_linear.quantize(torch.randn(8, 64), "q8_0")
    both = quant_linear.concat([a, b])
    assert both.fmt == "f32" and torch.equal(
        quant_linear.dequantize(both), torch.cat([quant_linear.dequantize(a), quant_linear.dequantize(b)])
    )
    same = quant_linear.concat([a, quant_linear.quantize(torch.randn(32, 64), "q4_1")])
    assert same.fmt == "q4_1" and same.n == 48


@pytest.mark.parametrize("fmt", ["q4_1", "bf16_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_runs_prompt_shapes_through_a_gemm_with_the_same_result(kernels, dtype, fmt):
    """Prompt rows: the fp32 GEMM over the dequantized weight, or (bf16_rows) torch's GEMM on the same tensor."""
    w = torch.randn(40, 96)
    blocks = quant_linear.quantize(w, fmt)
    layer = QuantLinear(blocks, torch.randn(40), kernels)
    x = torch.randn(3, kernels.prompt_rows + 7, 96).to(dtype)  # batched 3-d input, many rows
    ref = F.linear(x.float(), quant_linear.dequantize(blocks), layer.bias)
    out = layer(x)
    assert out.shape == (3, kernels.prompt_rows + 7, 40) and out.dtype == dtype
    assert torch.allclose(out.float(), ref, atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-2)
    decode = layer(x[:, :2])  # decode rows: the C kernel
    assert torch.allclose(decode.float(), ref[:, :2], atol=1e-4 if dtype == torch.float32 else 0.1, rtol=1e-2)
    strided = layer(x[0, :, :48].float().repeat(1, 2)[:5])  # a row stride that is not the width: copied first
    assert strided.shape == (5, 40)


def test_blocks_of_every_format_are_packed_into_whole_groups():
    for fmt in FORMATS:
        b: Blocks = quant_linear.quantize(torch.randn(17, 40), fmt)
        if fmt == "bf16_rows":  # the weight as torch holds it, no groups
            assert quant_linear.pack(b, False).numel() == 17 * 40 * 2
            continue
        per = {"f32": 2048, "bf16": 1024, "q8_0": 544, "q4_0": 288, "q4_1": 320}[fmt]
        assert quant_linear.pack(b, False).numel() == 2 * 2 * per  # 2 groups of 16 rows x 2 blocks of 32


def test_the_native_build_multiplies_bf16_pairs_where_the_cpu_can(tmp_path, monkeypatch):
    """vdpbf16ps paths exist only in a -march=native build on a CPU with AVX512-BF16 (no ISA level includes it),
    and AMX tile paths only in one on a CPU with AMX-BF16, so the "native" rows above are what test them."""
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    lib = quant_linear.load(tmp_path)
    require_built(lib, "cpu_linear.c (native)")
    has = cpu_isa.detected() == "avx512" and "avx512_bf16" in cpu_isa.cpu_flags()
    assert lib.bf16_dot == has
    assert lib.tiles == (has and {"amx_tile", "amx_bf16"} <= cpu_isa.cpu_flags())  # the AMX paths, likewise
    assert lib.bf16_rows_decode == (64 if lib.tiles or lib.bf16_dot else 8)
    monkeypatch.setenv(cpu_isa.ENV, "avx512")
    capped = quant_linear.load(tmp_path / "capped")
    assert capped is not None and not capped.bf16_dot and not capped.tiles


@pytest.mark.parametrize("fmt,activations", [("bf16", "exact"), ("bf16_rows", "exact"), ("q4_1", "q8")])
def test_a_row_is_the_same_in_every_step_of_its_span(kernels, fmt, activations):
    """`invariant_spans`: within each span of row counts (on AMX, bf16_rows from 4 rows on is the tile unit's) a
    row's output is bit for bit the same whatever the step's number of rows, so a step of 8 rows may take guess
    rows up to the span's end and give the 8 rows what the 8-row step gives them."""
    n, k = 200, 160
    gen = torch.Generator().manual_seed(12)
    w, x = torch.randn(n, k, generator=gen), torch.randn(72, k, generator=gen).bfloat16()
    lin = QuantLinear(quant_linear.quantize(w, fmt), None, kernels, activations=activations)
    assert lin.invariant_spans[0] == (1, lin.invariant_rows)
    for first, last in lin.invariant_spans:
        last = min(last, len(x))
        whole = lin(x[:last])
        for m in sorted({first, first + 1, (first + last) // 2, last} & set(range(first, last + 1))):
            assert torch.equal(lin(x[:m]), whole[:m]), f"{m} rows in span {first}..{last}"
    if kernels.tiles and fmt == "bf16_rows":
        assert lin.invariant_spans == ((1, quant_linear.AMX_ROWS - 1), (quant_linear.AMX_ROWS, lin.bf16_rows))


@pytest.mark.parametrize(
    "fmt,activations",
    [("bf16", "exact"), ("bf16_rows", "exact"), ("f32", "exact"), ("q8_0", "q8"), ("q4_0", "q8"), ("q4_1", "q8")],
)
def test_a_row_is_what_it_is_alone_up_to_the_claimed_rows(kernels, fmt, activations):
    """`invariant_rows` is what speculative decoding trusts: a step of up to that many bf16 rows gives every row
    exactly (bit for bit) what a step of that row alone gives, so a checked guess picks what a one-row step picks."""
    n, k = 200, 160  # a ragged last group and block
    gen = torch.Generator().manual_seed(11)
    w, x = torch.randn(n, k, generator=gen), torch.randn(40, k, generator=gen).bfloat16()
    lin = QuantLinear(quant_linear.quantize(w, fmt), None, kernels, activations=activations)
    rows = min(lin.invariant_rows, len(x))
    assert rows >= 1
    alone = torch.cat([lin(x[i : i + 1]) for i in range(rows)])
    for m in sorted({2, 3, 4, 5, 7, rows} - {r for r in (2, 3, 4, 5, 7) if r > rows}):
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"
