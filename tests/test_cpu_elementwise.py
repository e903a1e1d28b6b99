"""The one-pass C element-wise kernels for bf16 on CPU (kernels/cpu_elementwise.c) and the greedy argmax, against
the torch ops."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_elementwise
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary import apply_rope, rope_cache, rope_for_positions
from tests.cpu_levels import LEVELS, build_for


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> cpu_elementwise.CpuElementwise:
    built = cpu_elementwise.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "this machine has gcc: the kernels must build"
    return built


def _bf16(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _at_most_steps_apart(a: torch.Tensor, b: torch.Tensor, steps: int = 1) -> None:
    """Equal almost everywhere, and elsewhere at most `steps` bfloat16 values apart (a rounding each)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    assert (ai - bi).abs().max().item() <= steps
    assert (a != b).float().mean().item() < 1e-3


@pytest.mark.parametrize("rows", [1, 7, 2048])
def test_rms_norm(ops, rows):
    x, w = _bf16(rows, 576), _bf16(576, seed=1, scale=1.0)
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    _at_most_steps_apart(got, rms_norm(x, w, 1e-5), 2)  # two roundings after the sum
    wide = _bf16(rows, 640, seed=2)[:, 32:608]  # rows of a wider tensor
    _at_most_steps_apart(ops.rms_norm(wide, w, 1e-5), rms_norm(wide, w, 1e-5), 2)


@pytest.mark.parametrize("rows", [1, 33, 1024])
def test_silu_and_mul(ops, rows):
    gu = _bf16(rows, 2 * 768)
    gu[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # exp's clamps and zeros
    got = ops.silu_and_mul(gu)
    assert got.shape == (rows, 768)
    _at_most_steps_apart(got, silu_and_mul(gu))


@pytest.mark.parametrize("rows", [1, 5, 512])
def test_rope_is_bit_exact_and_in_place(ops, rows):
    heads, kv_heads, dim = 9, 3, 64
    qkv = _bf16(rows, (heads + 2 * kv_heads) * dim)
    view = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    cos, sin = rope_for_positions(rope_cache(dim, 4096, 100000.0), torch.randint(0, 4096, (rows,)), torch.bfloat16)
    want = apply_rope(view, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    got = ops.apply_rope(view, cos, sin)
    assert got.data_ptr() == view.data_ptr() and torch.equal(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # the V part is untouched


def test_other_dtypes_and_layouts_take_the_torch_ops(ops):
    x = torch.randn(4, 64)
    assert torch.equal(ops.rms_norm(x, torch.ones(64), 1e-6), rms_norm(x, torch.ones(64), 1e-6))
    assert torch.equal(ops.silu_and_mul(x), silu_and_mul(x))
    odd = _bf16(3, 40)  # hidden size not a multiple of 16
    assert torch.equal(ops.rms_norm(odd, _bf16(40, seed=1), 1e-6), rms_norm(odd, _bf16(40, seed=1), 1e-6))


@pytest.fixture(scope="module", params=LEVELS)
def level_ops(request, tmp_path_factory) -> cpu_elementwise.CpuElementwise:
    """The kernels built for one CPU level this machine can execute (the cap chooses -march)."""
    mp = pytest.MonkeyPatch()
    build_for(mp, request.param)
    built = cpu_elementwise.load(tmp_path_factory.mktemp(f"kernels-{request.param}"))
    mp.undo()
    assert built is not None, "this machine has gcc: the kernels must build"
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 17), (40, 1000), (2, 1)])
def test_argmax_is_torchs_first_maximum_and_flags_non_finite_rows(level_ops, dtype, rows, vocab):
    ops = level_ops
    x = (torch.randn(rows, vocab + 5, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)[:, 3 : 3 + vocab]
    if vocab > 1:
        x[0, vocab // 2] = x[0, vocab - 1] = x[0].max() + 1  # a tie: the first one wins, as in torch
    tokens, bad = ops.argmax(x)
    assert tokens == x.float().argmax(-1).tolist() and bad == set()
    if rows >= 3:
        x[1, 0] = float("nan")
        x[2] = float("-inf")  # nothing finite
        x[-1, -1] = float("inf")
        tokens, bad = ops.argmax(x)
        assert bad == {1, 2, rows - 1}
        assert tokens[3:-1] == x[3:-1].float().argmax(-1).tolist()
    assert ops.argmax(x.to(torch.float16)) is None and ops.argmax(x.t()) is None  # the sampler's torch path


def test_engine_greedy_tokens_with_and_without_the_kernels(tiny_model_dir):
    """The whole engine in bf16 (chunked prefill, continuous batching) gives the same tokens with the C kernels
    as with the torch ops."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.sampling_params import SamplingParams

    prompts = [[5, 17, 99, 3], list(range(10, 47)), [200] * 20, [i % 256 for i in range(300, 390)]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for fused in (False, True):
        engine = EngineCore(
            EngineConfig(
                model=str(tiny_model_dir),
                dtype="bfloat16",
                block_size=16,
                num_blocks=64,
                max_num_batched_tokens=64,
                fused_elementwise=fused,
            )
        )
        norm_op = engine.runner.model.model.norm.op
        assert isinstance(getattr(norm_op, "__self__", None), cpu_elementwise.CpuElementwise) == fused
        assert (engine.runner.sampler.argmax is not None) == fused
        outputs[fused] = engine.generate(prompts, params)
    assert outputs[True] == outputs[False]
