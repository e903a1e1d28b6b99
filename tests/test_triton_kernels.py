"""Every Triton kernel against its plain-torch reference, on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before the kernels are defined: `tests/conftest.py` sets it for the whole run, and
only where there is no CUDA device. With one, these tests skip and `test_kernels_cuda.py` runs the same kernels
compiled (an interpreter set here, at import, would have turned those into interpreted runs too).
Shapes stay tiny (the interpreter runs each program in Python); dtypes are fp32/fp16.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CUDA device is present: test_kernels_cuda.py runs the kernels compiled",
)

from pdserve.kernels.cache_ops import pack_blocks, store_kv, unpack_blocks  # noqa: E402
from pdserve.kernels.paged_attention import paged_attention  # noqa: E402
from pdserve.kernels.triton_kv_blocks import pack_blocks as triton_pack  # noqa: E402
from pdserve.kernels.triton_kv_blocks import unpack_blocks as triton_unpack  # noqa: E402
from pdserve.kernels.triton_paged_attention import paged_decode_attention  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def random_paged_cache(lengths, block_size, kv_heads, dim, dtype, gen, spare=3):
    """A layer cache holding each sequence's context in randomly chosen, non-contiguous blocks."""
    need = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(need) + spare
    layer = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n].int()
        at += n
    return layer, table


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_decode_attention_matches_reference(block_size, heads, kv_heads, dtype):
    gen = torch.Generator().manual_seed(block_size * 100 + heads * 10 + kv_heads)
    dim = 32
    lengths = [1, block_size - 1, block_size, block_size + 3, 2 * block_size + 5][: 3 + heads % 3]
    layer, table = random_paged_cache(lengths, block_size, kv_heads, dim, dtype, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    got = paged_decode_attention(q, layer[0], layer[1], table, torch.tensor(lengths, dtype=torch.int32), scale)
    starts = list(range(len(lengths) + 1))
    want = paged_attention(q.float(), layer.float(), starts, lengths, table.long(), scale)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_paged_decode_attention_head_dim_not_a_power_of_two():
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 19]
    layer, table = random_paged_cache(lengths, 16, 2, 24, torch.float32, gen)
    q = torch.randn(2, 4, 24, generator=gen)
    got = paged_decode_attention(q, layer[0], layer[1], table, torch.tensor(lengths, dtype=torch.int32), 0.2)
    want = paged_attention(q, layer, [0, 1, 2], lengths, table.long(), 0.2)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_pack_unpack_match_reference(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    layer = torch.randn(2, 12, block_size, 2, 16, generator=gen).to(dtype)
    ids = torch.tensor([7, 2, 9, 3, 11], dtype=torch.int32)
    packed = triton_pack(layer, ids)
    assert torch.equal(packed, pack_blocks(layer, ids))
    dst = torch.zeros_like(layer)
    want = torch.zeros_like(layer)
    targets = torch.tensor([0, 5, 1, 10, 4], dtype=torch.int64)
    triton_unpack(packed, dst, targets)
    unpack_blocks(packed, want, targets)
    assert torch.equal(dst, want)
    untouched = [b for b in range(12) if b not in targets.tolist()]
    assert not dst[:, untouched].any()


def test_kv_pack_of_a_cache_slice_reads_the_right_layer():
    """The transfer packs `kv_cache[layer]`, a view into the all-layer tensor."""
    cache = torch.randn(3, 2, 6, 16, 2, 8)
    ids = torch.tensor([4, 1], dtype=torch.int64)
    assert torch.equal(triton_pack(cache[1], ids), pack_blocks(cache[1], ids))


def test_decode_after_store_kv_reads_what_was_written():
    """store_kv then the Triton decode kernel: the engine's decode step on the same cache layout."""
    gen = torch.Generator().manual_seed(3)
    layer = torch.zeros(2, 8, 16, 2, 16)
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    n = 20
    k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    slots = torch.tensor([int(table[0, t // 16]) * 16 + t % 16 for t in range(n)])
    store_kv(k, v, layer, slots)
    q = torch.randn(1, 4, 16, generator=gen)
    got = paged_decode_attention(q, layer[0], layer[1], table, torch.tensor([n], dtype=torch.int32), 0.25)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = torch.softmax(torch.einsum("hd,thd->ht", q[0], kk) * 0.25, -1)
    torch.testing.assert_close(got[0], torch.einsum("ht,thd->hd", want, vv), atol=2e-5, rtol=1e-4)


def test_backend_selection_on_cpu():
    from pdserve.engine.attention import available_backends, select_backend

    cpu = torch.device("cpu")
    assert select_backend("auto", cpu).name == "cpu"  # the interpreter is never picked for speed
    assert available_backends(cpu, 16) == ["triton", "cpu", "torch"]  # TRITON_INTERPRET=1 (conftest)
    assert select_backend("triton", cpu).name == "triton"
    with pytest.raises(ValueError, match="flash-attn"):
        select_backend("flash-attn", cpu)
    with pytest.raises(ValueError, match="choose from"):
        select_backend("xformers", cpu)


@pytest.mark.parametrize("block_size", [16, 32])
def test_engine_greedy_with_triton_backend_equals_torch_backend(tiny_model_dir, block_size):
    """The whole engine (chunked prefill + continuous batching) gives the same tokens through the Triton
    decode kernel as through the torch reference."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.sampling_params import SamplingParams

    prompts = [[5, 17, 99, 3], list(range(10, 47)), [200] * 20]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        engine = EngineCore(
            EngineConfig(
                model=str(tiny_model_dir),
                block_size=block_size,
                num_blocks=32,
                max_num_batched_tokens=24,
                attention_backend=backend,
            )
        )
        assert engine.runner.backend.name == backend
        outputs[backend] = engine.generate(prompts, params)
    assert outputs["triton"] == outputs["torch"]
    assert all(len(o) == 6 for o in outputs["torch"])


def test_flash_attn_is_offered_only_for_the_dtypes_it_supports(monkeypatch):
    """flash-attn runs fp16/bf16 only: with fp32 (or a block size it cannot page) auto falls back to Triton."""
    import pdserve.engine.attention as attention

    monkeypatch.setattr(attention, "_has", lambda module: True)
    cuda = torch.device("cuda")
    assert attention.available_backends(cuda, 256, torch.bfloat16)[0] == "flash-attn"
    assert attention.available_backends(cuda, 256, torch.float16)[0] == "flash-attn"
    assert attention.available_backends(cuda, 256, torch.float32) == ["triton", "torch"]
    assert attention.available_backends(cuda, 16, torch.bfloat16) == ["triton", "torch"]
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        attention.select_backend("flash-attn", cuda, 256, torch.float32)
