"""Integer products with int8 activations (`--activations q8`, cpu_linear_q8.h): their own correctness rule.

(a) Arithmetic: at every CPU level this machine can execute, the activations' Q8 blocks and each block's integer sum
of products equal a NumPy reference of the same quantize-then-dot arithmetic exactly, and the fp32 result equals
that reference up to fp32 rounding, on random and ragged shapes and on the built-in model's own GGUF tensors.
(b) Quality: the built-in model's perplexity over a fixed public-domain text (tests/data/public_domain.txt) is
within 2% of the exact product's (the same GGUF blocks against bf16 activations), and greedy decoding mostly
agrees (the rate is printed, not asserted: a near-tie may go either way).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.kernels import quant_linear
from pdserve.kernels.quant_linear import Q8_ACTIVATIONS, Blocks, QuantLinear
from tests.cpu_levels import LEVELS, build_for, require_built

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
SHAPES = [(1, 16, 32), (1, 37, 100), (2, 40, 70), (3, 576, 576), (5, 19, 33), (8, 48, 64), (13, 130, 96), (70, 33, 160)]


@pytest.fixture(scope="module", params=LEVELS)
def kernels(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    build_for(mp, request.param)
    lib = quant_linear.load(tmp_path_factory.mktemp(f"q8-{request.param}"))
    mp.undo()
    require_built(lib, f"cpu_linear.c ({request.param})")
    return lib


def reference_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of x as Q8 blocks, in fp32 as the kernel computes them: d = max|x| / 127, q = rint(x * (1 / d))."""
    m, k = x.shape
    nb = -(-k // 32)
    xb = np.zeros((m, nb * 32), np.float32)
    xb[:, :k] = x
    xb = xb.reshape(m, nb, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int32)
    return q.astype(np.int8).reshape(m, -1), d, q.sum(-1).astype(np.int32)


def reference_product(b: Blocks, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The integer block sums I [m, n, nb], each block's scaled term [m, n, nb] (float64) of the Q8 arithmetic, and
    the size of what fp32 rounds in it (both parts of a Q4_1 term)."""
    q, d, s = reference_q8(x)
    nb = d.shape[1]
    codes = b.q.numpy().astype(np.int64)  # [n, nb, 32]: int8 quants, or 4-bit codes 0..15
    ints = np.einsum("nbk,mbk->mnb", codes, q.reshape(len(x), nb, 32).astype(np.int64))
    assert b.d is not None
    scale = b.d.float().numpy().astype(np.float64)[None] * d.astype(np.float64)[:, None]
    if b.fmt == "q8_0":
        return ints, scale * ints, np.abs(scale * ints)
    if b.fmt == "q4_0":
        y = scale * (ints - 8 * s[:, None, :])
        return ints, y, np.abs(y)
    assert b.m is not None
    low = b.m.float().numpy()[None] * (d.astype(np.float64) * s)[:, None, :]
    return ints, scale * ints + low, np.abs(scale * ints) + np.abs(low)


def check(kernels, b: Blocks, x: torch.Tensor) -> None:
    packing = Q8_ACTIVATIONS[b.fmt]
    packed = quant_linear.pack_q8(b)
    xq, xd, xs = kernels.quantize_q8(x)
    rq, rd, rs = reference_q8(x.float().numpy())
    assert np.array_equal(xq.numpy(), rq) and np.array_equal(xd.numpy(), rd) and np.array_equal(xs.numpy(), rs)
    ints, terms, size = reference_product(b, x.float().numpy())
    assert np.array_equal(kernels.block_dots_q8(packed, packing, b.n, b.k, xq).numpy(), ints)
    got = kernels.linear(x, packed, packing, b.n, None).double().numpy()
    # fp32 rounding: a few ulps of each block's term, and of each partial sum over the blocks
    bound = (terms.shape[-1] + 4) * np.finfo(np.float32).eps * size.sum(-1) + 1e-30
    if x.dtype == torch.bfloat16:  # bf16 in, bf16 out: the result rounded once more
        bound += np.abs(terms.sum(-1)) * 2.0**-8
    assert (np.abs(got - terms.sum(-1)) <= bound).all(), np.abs(got - terms.sum(-1)).max()
    back = kernels.dequantize(packed, packing, b.n, b.k)
    assert torch.equal(back.t(), quant_linear.dequantize(b))


@pytest.mark.parametrize("fmt", list(Q8_ACTIVATIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_integer_sums_and_products_equal_the_reference(kernels, fmt, shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen) * torch.linspace(0.05, 2, k)  # blocks of different ranges
    x = torch.randn(m, k, generator=gen) * 3
    x[0, : min(k, 32)] = 0  # an all-zero block: scale 0, quants 0
    blocks = quant_linear.quantize(w, fmt)
    check(kernels, blocks, x)
    check(kernels, blocks, x.bfloat16())  # bf16 activations are quantized as they are


@pytest.mark.parametrize("fmt", list(Q8_ACTIVATIONS))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels, fmt):
    """Bit for bit, whatever the batch: a step's rows take the tile unit from 8 rows on (AMX-INT8) in passes of
    16, vpdpbusd below and for a last pass of fewer than 8 (17, 33), and both scale the same integer sums by the
    same operations in the same order. Speculation's checks and continuous batching rely on it (a guess is kept
    only where it is the row's own pick)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 70, 200
    blocks = quant_linear.quantize(torch.randn(n, k, generator=gen), fmt)
    packed, packing = quant_linear.pack_q8(blocks), Q8_ACTIVATIONS[fmt]
    x = torch.randn(40, k, generator=gen).bfloat16()
    alone = torch.cat([kernels.linear(x[i : i + 1], packed, packing, n, None) for i in range(len(x))])
    for m in (4, 8, 10, 12, 16, 17, 21, 24, 33, 40):
        assert torch.equal(kernels.linear(x[:m], packed, packing, n, None), alone[:m]), m


def test_the_layer_picks_the_integer_packing_and_keeps_plain_formats(kernels):
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 96, generator=gen), torch.randn(4, 96, generator=gen)
    layer = QuantLinear(quant_linear.quantize(w, "q4_1"), None, kernels, activations="q8")
    assert layer.packing == "q4_1_q8" and layer.fmt == "q4_1"
    _, terms, _ = reference_product(quant_linear.quantize(w, "q4_1"), x.numpy())
    assert np.allclose(layer(x).double().numpy(), terms.sum(-1), rtol=1e-5, atol=1e-4)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer(torch.randn(600, 96)).shape == (600, 40)  # a prompt's rows
    plain = QuantLinear(quant_linear.quantize(w, "bf16"), None, kernels, activations="q8")
    assert plain.packing == "bf16"  # nothing to quantize against: the exact product
    with pytest.raises(ValueError, match="activations"):
        QuantLinear(quant_linear.quantize(w, "q8_0"), None, kernels, activations="int4")


def test_the_built_in_model_tensors(kernels, model_dir):
    """Every format the built-in GGUF holds (Q4_1 projections, the Q8_0 head), against hidden-state-like rows."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.gguf_file import GGUFFile
    from pdserve.engine.model_store import gguf_source

    gguf = gguf_source(model_dir)
    assert gguf is not None
    blocks = GGUFFile(gguf).linears(ModelConfig.from_dir(model_dir))
    gen = torch.Generator().manual_seed(0)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.7.mlp.down_proj", "lm_head"):
        b = blocks[name]
        if name == "lm_head":  # 49152 rows: a slice of them keeps the reference quick
            b = Blocks(b.fmt, 4096, b.k, b.q[:4096], b.d[:4096] if b.d is not None else None)
        x = torch.randn(3, b.k, generator=gen) * torch.exp(torch.randn(b.k, generator=gen))  # outlier columns
        check(kernels, b, x)


def _perplexity_and_greedy(model_dir: Path, activations: str, ids: list[int], prompts: list[list[int]]):
    from pdserve.engine import EngineConfig, EngineCore, SamplingParams
    from pdserve.engine.attention import AttentionMetadata

    core = EngineCore(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            quantization="gguf",
            activations=activations,
            kv_cache_memory=256 << 20,
            max_num_seqs=len(prompts),
        )
    )
    runner = core.runner
    bs = runner.layout.block_size
    table = torch.arange(-(-len(ids) // bs)).unsqueeze(0)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, 512):  # a fresh cache: block i is slot range i * bs .. (i + 1) * bs
            end = min(len(ids), start + 512)
            pos = torch.arange(start, end)
            meta = AttentionMetadata(pos.clone(), [0, end - start], [end], table)
            hidden = runner.model(torch.tensor(ids[start:end]), pos, runner.kv_cache, meta, runner.backend)
            logp = torch.log_softmax(runner.model.compute_logits(hidden).float(), -1)
            targets = torch.tensor(ids[start + 1 : end + 1])
            nll -= logp[: len(targets)].gather(1, targets[:, None]).sum().item()
            count += len(targets)
    runner.kv_cache.zero_()
    greedy = core.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    return math.exp(nll / count), count, greedy


def test_perplexity_over_a_public_domain_text_is_within_2_percent_of_the_exact_product(model_dir):
    from pdserve.gateway.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    ids = tok.encode(TEXT.read_text())
    assert len(ids) >= 2000
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}])
        for p in (
            "Write a haiku about the sea.",
            "What is the capital of France?",
            "Explain what a hash table is in two sentences.",
            "List three prime numbers.",
            "Translate 'good morning' into Spanish.",
            "Why is the sky blue?",
        )
    ]
    exact, n, greedy_exact = _perplexity_and_greedy(model_dir, "exact", ids, prompts)
    q8, _, greedy_q8 = _perplexity_and_greedy(model_dir, "q8", ids, prompts)
    same = sum(a == b for g, h in zip(greedy_exact, greedy_q8) for a, b in zip(g, h))
    prefix = sum(
        next((i for i, (a, b) in enumerate(zip(g, h)) if a != b), len(g)) for g, h in zip(greedy_exact, greedy_q8)
    )
    total = sum(len(g) for g in greedy_exact)
    print(
        f"\nperplexity over {n} tokens: exact {exact:.4f}, q8 {q8:.4f} ({100 * (q8 / exact - 1):+.2f}%); greedy "
        f"tokens equal at the same position {same}/{total}, identical prefixes {prefix}/{total}"
    )
    assert abs(q8 / exact - 1) <= 0.02
