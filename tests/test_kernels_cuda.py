"""The GPU path: Triton kernels and flash-attn adapters on CUDA against the torch reference, and the whole
engine's greedy output per backend. Skipped cleanly where there is no CUDA device (CI, this machine)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_flash = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")

DTYPES = [torch.float16, torch.bfloat16]


def test_kernels_run_compiled_not_interpreted():
    """conftest turns Triton's interpreter on only without CUDA: here the kernels must be compiled."""
    import os

    assert os.environ.get("TRITON_INTERPRET") != "1"


TOL = dict(atol=2e-2, rtol=2e-2)


def _cache(lengths, block_size, kv_heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lengths]
    layer = torch.randn(2, sum(need) + 4, block_size, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(layer.shape[1], generator=gen)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n].int()
        at += n
    return layer.cuda(), table.cuda()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 8, 64), (32, 8, 128), (9, 3, 64)])
def test_paged_decode_kernel(dtype, block_size, heads, kv_heads, dim):
    from pdserve.kernels.paged_attention import paged_attention
    from pdserve.kernels.triton_paged_attention import paged_decode_attention

    lengths = [1, 15, 16, 17, 300, 1000]
    layer, table = _cache(lengths, block_size, kv_heads, dim, dtype)
    q = torch.randn(len(lengths), heads, dim, device="cuda", dtype=dtype)
    got = paged_decode_attention(
        q, layer[0], layer[1], table, torch.tensor(lengths, dtype=torch.int32, device="cuda"), dim**-0.5
    )
    want = paged_attention(q.float(), layer.float(), list(range(len(lengths) + 1)), lengths, table.long(), dim**-0.5)
    torch.testing.assert_close(got.float(), want, **TOL)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack(dtype):
    from pdserve.kernels.cache_ops import pack_blocks
    from pdserve.kernels.triton_kv_blocks import pack_blocks as tpack
    from pdserve.kernels.triton_kv_blocks import unpack_blocks as tunpack

    layer = torch.randn(2, 64, 16, 8, 128, device="cuda", dtype=dtype)
    ids = torch.randperm(64, device="cuda")[:20]
    packed = tpack(layer, ids)
    assert torch.equal(packed, pack_blocks(layer, ids))
    dst = torch.zeros_like(layer)
    tunpack(packed, dst, ids)
    assert torch.equal(dst[:, ids], layer[:, ids])


def _mixed_meta(lengths_q, lengths_k, block_size, kv_heads, dim, dtype):
    from pdserve.engine.attention import AttentionMetadata

    layer, table = _cache(lengths_k, block_size, kv_heads, dim, dtype, seed=1)
    qsl = [0]
    for n in lengths_q:
        qsl.append(qsl[-1] + n)
    slots = torch.cat(
        [
            table[i, (torch.arange(lk - lq, lk, device="cuda") // block_size)] * block_size
            + torch.arange(lk - lq, lk, device="cuda") % block_size
            for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k))
        ]
    ).long()
    return layer, AttentionMetadata(slots, qsl, list(lengths_k), table.long())


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=needs_triton), pytest.param("flash-attn", marks=needs_flash)]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_batch_matches_torch(backend, dtype):
    from pdserve.engine.attention import TorchAttention, select_backend

    block_size = 256 if backend == "flash-attn" else 16
    lengths_q, lengths_k = [1, 37, 1, 300], [700, 37, 5, 812]
    layer, meta = _mixed_meta(lengths_q, lengths_k, block_size, 4, 64, dtype)
    t = sum(lengths_q)
    q = torch.randn(t, 16, 64, device="cuda", dtype=dtype)
    k = torch.randn(t, 4, 64, device="cuda", dtype=dtype)
    v = torch.randn(t, 4, 64, device="cuda", dtype=dtype)
    ref_layer = layer.clone()
    want = TorchAttention()(q, k, v, ref_layer, meta, 0.125)
    got = select_backend(backend, torch.device("cuda"), block_size)(q, k, v, layer, meta, 0.125)
    assert torch.equal(layer, ref_layer)  # both stored the new K/V identically
    torch.testing.assert_close(got, want, **TOL)
    decode_only = _mixed_meta([1, 1, 1], [700, 5, 812], block_size, 4, 64, dtype)
    q1, k1, v1 = q[:3].contiguous(), k[:3].contiguous(), v[:3].contiguous()
    want1 = TorchAttention()(q1, k1, v1, decode_only[0].clone(), decode_only[1], 0.125)
    got1 = select_backend(backend, torch.device("cuda"), block_size)(q1, k1, v1, decode_only[0], decode_only[1], 0.125)
    torch.testing.assert_close(got1, want1, **TOL)


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=needs_triton), pytest.param("flash-attn", marks=needs_flash)]
)
def test_engine_greedy_per_backend_equals_torch_backend(model_dir, backend):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.sampling_params import SamplingParams

    block_size = 256 if backend == "flash-attn" else 16
    prompts = [list(range(100, 100 + n)) for n in (3, 40, 130, 600)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    out = {}
    for name in ("torch", backend):
        engine = EngineCore(
            EngineConfig(
                model=str(model_dir),
                dtype="float32",
                device="cuda",
                block_size=block_size,
                kv_cache_memory=512 << 20,
                attention_backend=name,
            )
        )
        assert engine.runner.backend.name == name
        out[name] = engine.generate(prompts, params)
    assert out[backend] == out["torch"]
