"""`cpu_decoder_layer.c`: a decode step's layers in one C call each give the eager layers' numbers bit for bit
(hidden states, logits, every K/V written) at every CPU level this machine can execute, and the engine's tokens
stay the same; steps it does not take (prompt rows, too many rows) keep the eager path."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from tests.cpu_levels import LEVELS, build_for

PROMPTS = [[5, 17, 99, 3], list(range(10, 47)), [200] * 20, [i % 256 for i in range(300, 390)], [7]]


def _engine(model_dir, quantization: str, fused: bool, **kw) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            block_size=16,
            num_blocks=64,
            max_num_batched_tokens=64,
            quantization=quantization,
            fused_decode_layers=fused,
            **kw,
        )
    )


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    """Kernels built for one CPU level (the cap chooses -march and cpu_linear's tiles)."""
    build_for(monkeypatch, request.param)
    return request.param


def _count_fused_steps(engine: EngineCore) -> list[int]:
    layers = engine.runner.model.decode_layers
    assert layers is not None, "the fused decode path was not bound"
    rows: list[int] = []
    run = layers.run

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return run(x, *args, **kwargs)

    layers.run = counted  # type: ignore[method-assign]
    return rows


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_fused_decode_steps_give_the_same_tokens(tiny_model_dir, level, quantization):
    """Greedy and sampled tokens, continuously batched with chunked prefill, equal the layer-by-layer engine's."""
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
    ]
    outputs = {}
    for fused in (False, True):
        engine = _engine(tiny_model_dir, quantization, fused)
        if fused:
            rows = _count_fused_steps(engine)
        else:
            assert engine.runner.model.decode_layers is None
        outputs[fused] = [engine.generate(PROMPTS, p) for p in params]
    assert outputs[True] == outputs[False]
    assert rows and max(rows) == len(PROMPTS)  # decode steps of every batch size up to all five ran fused


def _decode_batch(engine: EngineCore):
    """Prefill every prompt, then schedule one pure decode step."""
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    batch = engine.schedule()
    assert all(n == 1 for n in batch.num_new_tokens) and len(batch.seqs) == len(PROMPTS)
    return batch


def test_a_fused_step_equals_the_eager_step_bit_for_bit(tiny_model_dir, level):
    """Layer by layer (with a hook), the whole stack in one call, and the eager path: the same bits."""
    engine = _engine(tiny_model_dir, "q4_0", True)
    runner = engine.runner
    inputs = runner.prepare(_decode_batch(engine))
    before = runner.kv_cache.clone()
    hooked: list[int] = []
    fused_logits = runner.forward(inputs, hooked.append)
    fused_cache = runner.kv_cache.clone()
    assert hooked == list(range(runner.config.num_layers))  # the layer hook still runs after every layer
    runner.kv_cache.copy_(before)
    stack_logits = runner.forward(inputs)  # no hook: the whole stack in one C call
    assert torch.equal(runner.kv_cache, fused_cache)
    assert torch.equal(stack_logits, fused_logits)
    layers, runner.model.decode_layers = runner.model.decode_layers, None
    runner.kv_cache.copy_(before)
    eager_logits = runner.forward(inputs)
    runner.model.decode_layers = layers
    assert not torch.equal(before, fused_cache)
    assert torch.equal(fused_cache, runner.kv_cache)
    assert torch.equal(fused_logits, eager_logits)


def test_steps_it_does_not_take_keep_the_eager_path(tiny_model_dir):
    engine = _engine(tiny_model_dir, "none", True)  # bf16 weights: a bounded number of decode rows on every CPU
    layers = engine.runner.model.decode_layers
    assert layers is not None
    x = torch.zeros(layers.max_rows + 1, layers.shape.hidden, dtype=torch.bfloat16)
    assert not layers.takes(x, engine.runner.kv_cache)  # more rows than cpu_linear.c's decode tiles
    assert not layers.takes(x[:2].float(), engine.runner.kv_cache)
    assert not layers.takes(x[:2], engine.runner.kv_cache.float())
    assert layers.takes(x[:2], engine.runner.kv_cache)
    rows = _count_fused_steps(engine)
    engine.generate([list(range(10, 60))], SamplingParams(max_tokens=1, temperature=0.0))
    assert rows == []  # a prompt-only step (and its one sampled token) ran layer by layer


def test_other_backends_and_dtypes_are_not_fused(tiny_model_dir):
    assert _engine(tiny_model_dir, "q8_0", True, attention_backend="torch").runner.model.decode_layers is None
    fp32 = EngineCore(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_blocks=64, quantization="q8_0"))
    assert fp32.runner.model.decode_layers is None
