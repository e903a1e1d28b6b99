"""The C decode-attention kernel for CPU (kernels/cpu_paged_attention.c) against the torch path it replaces."""

from __future__ import annotations

import platform
import re
import subprocess

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, CpuAttention, TorchAttention, select_backend
from pdserve.kernels import c_build, cpu_isa, cpu_paged_attention
from pdserve.kernels.paged_attention import decode_attention, decode_mask
from tests.cpu_levels import LEVELS, build_for


@pytest.fixture(scope="module", params=LEVELS)
def kernel(request, tmp_path_factory) -> cpu_paged_attention.CpuPagedAttention:
    """Every build this machine can run: each ISA level's (the plain-C loops, AVX2's, AVX-512's) and its own."""
    mp = pytest.MonkeyPatch()
    build_for(mp, request.param)
    built = cpu_paged_attention.load(tmp_path_factory.mktemp(f"kernels-{request.param}"))
    mp.undo()
    assert built is not None, "this machine has gcc: the kernel must build"
    return built


def _case(
    b: int, heads: int, kv_heads: int, dim: int, block_size: int, lens: list[int], dtype: torch.dtype, seed: int = 0
):
    gen = torch.Generator().manual_seed(seed)
    n_blocks = max(-(-n // block_size) for n in lens)
    pool = b * (n_blocks + 2) + 3
    k = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(pool, generator=gen)[: b * (n_blocks + 2)].view(b, n_blocks + 2)  # wider than needed
    q = torch.randn(b, heads, dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), n_blocks


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 8), (16, 1, 128, 32)]
    # 1 to 4 query heads a KV head at 64 and 128 values a head: each shape the bf16 pairs path has its own copy of
    + [(2 * g, 2, dim, 16) for g in (1, 2, 4) for dim in (64, 128)]
    + [(6, 2, 128, 16)],
)
def test_kernel_matches_gather_and_sdpa(kernel, dtype, tol, heads, kv_heads, dim, block_size):
    """Contexts of 1 token, part of a block, exactly a block and many blocks, any block order, grouped-query
    heads: the same output as gathering the blocks and running SDPA (both compared with an fp32 computation)."""
    lens = [1, block_size - 3, block_size, 5 * block_size + 7, 200]
    q, k, v, tables, lens_t, n_blocks = _case(len(lens), heads, kv_heads, dim, block_size, lens, dtype)
    scale = dim**-0.5
    got = kernel.decode(q, k, v, tables[:, :n_blocks], lens_t, max(lens), scale)
    mask = decode_mask(lens_t, n_blocks * block_size)
    exact = decode_attention(q.float(), k.float(), v.float(), tables[:, :n_blocks], mask, scale)
    torch_path = decode_attention(q, k, v, tables[:, :n_blocks], mask, scale)
    assert got.dtype == dtype and got.shape == q.shape
    kernel_err = (got.float() - exact).abs().max().item()
    torch_err = (torch_path.float() - exact).abs().max().item()
    assert kernel_err <= max(tol, 1.01 * torch_err), (kernel_err, torch_err)


def test_kernel_reads_strided_queries_and_is_deterministic(kernel):
    """q as a view into a wider tensor (as the fused QKV projection leaves it): same answer as a compact copy,
    bit for bit, every time, and the same row whatever else is in the batch."""
    q, k, v, tables, lens, n_blocks = _case(3, 8, 2, 64, 16, [40, 7, 100], torch.bfloat16, seed=3)
    wide = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    wide[:, :, 32:96] = q
    view = wide[:, :, 32:96]
    assert not view.is_contiguous()
    once = kernel.decode(view, k, v, tables, lens, 100, 0.125)
    assert torch.equal(once, kernel.decode(q.contiguous(), k, v, tables, lens, 100, 0.125))
    assert torch.equal(once, kernel.decode(q, k, v, tables, lens, 100, 0.125))
    alone = kernel.decode(q[1:2], k, v, tables[1:2], lens[1:2], 7, 0.125)
    assert torch.equal(alone[0], once[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 4, 64), (4, 2, 32), (8, 1, 64)]
)
def test_rows_of_a_sequence_checking_guesses_equal_each_row_alone(kernel, dtype, heads, kv_heads, dim):
    """A step that checks guesses has one row per guessed position, each over a prefix of the same blocks; the
    kernel reads those K rows once for the whole run. Every row must get, bit for bit, what it gets alone (greedy
    answers with and without speculation depend on it), and the answer SDPA gives: runs of 1 to 40 rows (longer than
    a run's cap), contexts that end inside and at the edge of a chunk, and rows that share blocks without being a
    run (a shorter context after a longer one)."""
    block_size, gen = 16, torch.Generator().manual_seed(11)
    runs = [(9, 31), (1, 7), (17, 14), (40, 100), (2, 16), (1, 50), (1, 20), (3, 20)]
    n_blocks = -(-max(base + rows for rows, base in runs) // block_size)
    pool = len(runs) * n_blocks + 2
    k = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    seq_tables = torch.randperm(pool, generator=gen)[: len(runs) * n_blocks].view(len(runs), n_blocks)
    seq_tables[6] = seq_tables[5]  # the last three share blocks: 50 tokens, then 20, then a run from 20
    seq_tables[7] = seq_tables[5]
    tables = torch.cat([seq_tables[i].expand(rows, -1) for i, (rows, _) in enumerate(runs)])
    lens = torch.tensor([base + 1 + r for rows, base in runs for r in range(rows)], dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    got = kernel.decode(q, k, v, tables, lens, int(lens.max()), dim**-0.5)
    for row in range(len(lens)):
        alone = kernel.decode(
            q[row : row + 1], k, v, tables[row : row + 1], lens[row : row + 1], int(lens[row]), dim**-0.5
        )
        assert torch.equal(alone[0], got[row]), row
    mask = decode_mask(lens, n_blocks * block_size)
    exact = decode_attention(q.float(), k.float(), v.float(), tables, mask, dim**-0.5)
    torch_err = (decode_attention(q, k, v, tables, mask, dim**-0.5).float() - exact).abs().max().item()
    assert (got.float() - exact).abs().max().item() <= max(2e-6 if dtype == torch.float32 else 1e-2, 1.01 * torch_err)


def test_unsupported_layouts_take_the_torch_path(kernel):
    """float16, or a head size the kernel's lanes do not divide: `supports` says no and the backend falls back."""
    q, k, *_ = _case(1, 4, 2, 64, 16, [5], torch.float16)
    assert not kernel.supports(q, k)
    q, k, *_ = _case(1, 4, 2, 40, 16, [5], torch.float32)
    assert not kernel.supports(q, k)
    q, k, *_ = _case(1, 4, 2, 64, 16, [5], torch.bfloat16)
    assert kernel.supports(q, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_mixed_batch_matches_torch_backend(kernel, dtype):
    """A prompt chunk between decode rows, through the whole backend (store, then attend)."""
    gen = torch.Generator().manual_seed(5)
    block_size, kv_heads, heads, dim = 16, 3, 9, 64
    lengths_q, lengths_k = [1, 37, 1, 20], [70, 37, 5, 90]
    pool = 40
    layer = torch.randn(2, pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(pool, generator=gen)[:24].view(4, 6)
    qsl, slots = [0], []
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        qsl.append(qsl[-1] + lq)
        slots += [int(tables[i, t // block_size]) * block_size + t % block_size for t in range(lk - lq, lk)]
    meta = AttentionMetadata(torch.tensor(slots), qsl, lengths_k, tables)
    t = qsl[-1]
    q, k, v = (torch.randn(t, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    ref_layer = layer.clone()
    want = TorchAttention()(q, k, v, ref_layer, meta, 0.125)
    got = CpuAttention(kernel)(q, k, v, layer, meta, 0.125)
    assert torch.equal(layer, ref_layer)
    torch.testing.assert_close(got, want, atol=1e-2 if dtype != torch.float32 else 2e-6, rtol=0)


def test_auto_takes_the_kernel_on_cpu_and_the_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert select_backend("auto").name == "cpu"
    built = list((tmp_path / "kernels").glob("cpu_paged_attention-*.so"))
    assert len(built) == 1
    before = built[0].stat().st_mtime_ns
    assert select_backend("cpu").name == "cpu"
    assert built[0].stat().st_mtime_ns == before  # loaded, not rebuilt


def test_without_a_compiler_auto_keeps_torch_and_cpu_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert select_backend("auto").name == "torch"
    with pytest.raises(ValueError, match="C compiler"):
        select_backend("cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_greedy_with_the_kernel_equals_the_torch_backend(tiny_model_dir, tiny_hf_model, dtype):
    """The whole engine (chunked prefill, continuous batching, prompts of several lengths) gives the same tokens
    with the kernel as with the torch path: exactly in fp32; in bf16, wherever the two part, the tokens they chose
    are the fp32 model's top two within bf16 rounding of each other (which way a near-tie goes depends on how each
    path rounds, and torch's own bf16 path differs by CPU level: under PDSERVE_CPU_ISA=avx2 or portable it parts
    from the kernel on this random tiny model, whose logits are flat)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.sampling_params import SamplingParams

    prompts = [[5, 17, 99, 3], list(range(10, 47)), [200] * 20, [i % 256 for i in range(300, 390)]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "cpu"):
        engine = EngineCore(
            EngineConfig(
                model=str(tiny_model_dir),
                dtype=dtype,
                block_size=16,
                num_blocks=64,
                max_num_batched_tokens=48,
                attention_backend=backend,
            )
        )
        assert engine.runner.backend.name == backend
        outputs[backend] = engine.generate(prompts, params)
    assert all(len(o) == 24 for o in outputs["torch"])
    if dtype == "float32":
        assert outputs["cpu"] == outputs["torch"]
        return
    for prompt, kernel, reference in zip(prompts, outputs["cpu"], outputs["torch"]):
        if kernel == reference:
            continue
        k = next(i for i, (a, b) in enumerate(zip(kernel, reference)) if a != b)
        with torch.no_grad():
            logits = tiny_hf_model(torch.tensor([prompt + kernel[:k]])).logits[0, -1]
        top = logits.topk(2)
        assert {kernel[k], reference[k]} == set(top.indices.tolist()), (k, kernel, reference)
        margin = float(top.values[0] - top.values[1])
        assert margin <= 0.02 * float(logits.abs().max()), f"tokens part at step {k} on a margin of {margin}"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 prefetch instructions")
@pytest.mark.parametrize("march", sorted({*cpu_isa.MARCH.values(), "native"}))
def test_every_build_keeps_its_prefetches(tmp_path, march):
    """The kernel waits on memory without its prefetches, and gcc once deleted them all (a helper whose only effect
    was prefetching counted as pure, so its calls were dead code): the assembly of every build must hold them."""
    compiler, _ = c_build._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    asm = tmp_path / "attention.s"
    argv = [a for a in c_build.flags(march) if a not in ("-shared", "-fPIC")]
    subprocess.run([compiler, *argv, "-S", str(cpu_paged_attention.SOURCE), "-o", str(asm)], check=True, timeout=120)
    assert len(re.findall(r"\bprefetch", asm.read_text())) >= 4
