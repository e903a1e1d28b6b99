"""`--quantization`: the engine serves a GGUF's own blocks (and q8_0 / q4_0 made at load) and says so in its KV
layout, so workers that would compute different numbers never pair."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.engine import EngineConfig, EngineCore, SamplingParams
from pdserve.engine.gguf_file import GGUFFile
from pdserve.engine.model import load_model
from pdserve.engine.model_store import gguf_source
from pdserve.kernels import quant_linear
from pdserve.kernels.kv_layout import LayoutMismatch
from pdserve.kernels.quant_linear import QuantLinear
from tests.cpu_levels import require_built

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 253, 1690, 30],
    [1, 2683, 2683, 2683, 28, 198, 1399, 281, 3250, 355],
    list(range(300, 364)),
    [1, 9690, 198, 2683, 314, 253, 3864, 28, 3600, 30, 1042, 13, 43, 55, 12],
]


QKV = ("q_proj", "k_proj", "v_proj")


def _transformers_fused(hf_model) -> dict[str, torch.Tensor]:
    """transformers' tensors under this engine's names (q/k/v and gate/up concatenated)."""
    ref = dict(hf_model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for name, t in ref.items():
        if ".q_proj." in name:
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([ref[name.replace("q_proj", p)] for p in QKV])
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, ref[name.replace("gate_proj", "up_proj")]])
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            out[name] = t
    return out


def test_gguf_read_directly_is_what_transformers_makes_of_the_file(model_dir, hf_model):
    """The engine reads the GGUF itself (its own index, the `gguf` package's dequantization, q/k rows un-permuted)
    and gets every tensor transformers converts from the same file, bit for bit; its blocks dequantize to the
    same linear weights."""
    gguf = gguf_source(model_dir)
    assert gguf is not None and gguf.suffix == ".gguf"
    model = load_model(model_dir, torch.float32, gguf=gguf)
    want = _transformers_fused(hf_model)
    got = model.state_dict()
    assert set(got) == set(want)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    blocks = GGUFFile(gguf).linears(model.config)
    assert len(blocks) == 4 * model.config.num_layers + 1
    assert blocks["lm_head"].fmt == "q8_0" and blocks["model.layers.0.self_attn.qkv_proj"].fmt == "q4_1"
    for name, b in blocks.items():
        assert torch.equal(quant_linear.dequantize(b), want[name + ".weight"]), name
    file_bytes = sum(b.nbytes for b in blocks.values())
    assert 80e6 < file_bytes < 100e6  # about what the file holds, not the 540 MB of fp32


def test_a_gguf_model_needs_no_converted_weights(model_dir):
    """What `resolve_model` keeps of a GGUF is its config and tokenizer; with `--quantization gguf` the layers'
    linear weights are never dequantized (the meta device holds them until the file's blocks replace them)."""
    model = load_model(model_dir, torch.bfloat16, gguf=gguf_source(model_dir), linears=False)
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert qkv.weight.is_meta and not model.model.embed_tokens.weight.is_meta
    assert model.model.norm.weight.dtype == torch.bfloat16


def _generate(cfg: EngineConfig, logprobs: int | None = None) -> tuple[EngineCore, list[list[int]], list]:
    core = EngineCore(cfg)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    seqs = [core.add_request(p, params) for p in PROMPTS]
    samples: dict[int, list] = {id(s): [] for s in seqs}
    while core.has_work:
        for out in core.step():
            assert out.error is None
            samples[id(out.seq)].append(out.sample)
    return core, [s.output_ids for s in seqs], [samples[id(s)] for s in seqs]


@pytest.mark.parametrize("seqs", [4, 1])
def test_served_gguf_tokens_equal_the_fp32_engine_on_the_same_weights(model_dir, seqs):
    """Greedy tokens from the file's own Q4_1/Q8_0 blocks equal those of the fp32 engine over the dequantized
    weights, except where the fp32 engine's top two logits are within rounding of each other (asserted, not
    skipped: a real difference fails). One sequence at a time, decode steps take the kernels' one-row paths."""
    base = dict(model=str(model_dir), dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=seqs)
    core, got, _ = _generate(EngineConfig(**base, quantization="gguf", activations="exact"))
    assert core.layout.weights == "gguf"
    layers = [m for m in core.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 121 and {m.fmt for m in layers} == {"q4_1", "q8_0"}
    _, want, samples = _generate(EngineConfig(**base), logprobs=2)
    exact = 0
    for g, w, s in zip(got, want, samples):
        if g == w:
            exact += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
        top = s[i].top_logprobs
        margin = top[0][1] - top[1][1]
        assert g[i] == top[1][0] and margin < 1e-3, (i, g[i], top)
    assert exact >= len(PROMPTS) - 1


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantized_at_load_serves_and_names_its_format(tiny_model_dir, fmt):
    core = EngineCore(
        EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory=8 << 20, quantization=fmt)
    )
    assert {m.fmt for m in core.runner.model.modules() if isinstance(m, QuantLinear)} == {fmt}
    out = core.generate([[1, 5, 9, 13]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0]) == 5
    assert {m.packing for m in core.runner.model.modules() if isinstance(m, QuantLinear)} == {f"{fmt}_q8"}
    fp32 = EngineCore(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory=8 << 20))
    exact = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory=8 << 20, quantization=fmt, activations="exact"
        )
    )
    assert (fp32.layout.weights, core.layout.weights, exact.layout.weights) == ("none", f"{fmt}+q8", fmt)
    for a, b in ((fp32, core), (core, exact)):  # other weights, or other activations: other KV values
        assert a.layout.fingerprint != b.layout.fingerprint
        with pytest.raises(LayoutMismatch, match="weights"):
            a.layout.check_compatible(b.layout)


def test_gguf_needs_a_gguf_model_and_a_cpu(tiny_model_dir):
    from pdserve.cli.errors import CLIError
    from pdserve.cli.services import engine_config
    from pdserve.options import EngineOptions

    with pytest.raises(CLIError, match="needs a model that is a .gguf file"):
        engine_config(EngineOptions(model=str(tiny_model_dir), quantization="gguf", kv_cache_memory=8 << 20))
    with pytest.raises(CLIError, match="runs on a CPU only"):
        engine_config(EngineOptions(model=str(tiny_model_dir), quantization="q8_0", device="cuda"))
    cfg = engine_config(EngineOptions(model=str(tiny_model_dir), quantization="q8_0", kv_cache_memory=8 << 20))
    assert cfg.quantization == "q8_0"
    with pytest.raises(ValueError, match="not one of"):
        EngineCore(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=8 << 20, quantization="q3_k"))
    # a draft model's weights are checked the same way, under its own flag's name
    with pytest.raises(CLIError, match="--speculative-draft gguf needs a model that is a .gguf file"):
        engine_config(EngineOptions(model=str(tiny_model_dir), speculative_draft="gguf", kv_cache_memory=8 << 20))
    with pytest.raises(CLIError, match="--speculative-draft q4_0 runs on a CPU only"):
        engine_config(EngineOptions(model=str(tiny_model_dir), speculative_draft="q4_0", device="cuda"))
    cfg = engine_config(EngineOptions(model="default", speculative_draft="gguf", kv_cache_memory=8 << 20))
    assert cfg.speculative_draft == "gguf"


def test_the_flag_reaches_every_command():
    from pdserve.cli.main import build_parser

    parser = build_parser()
    for argv in (["up"], ["prefill"], ["decode"], ["generate", "hi", "--local"]):
        args = parser.parse_args([*argv, "--quantization", "gguf"])
        assert isinstance(args, argparse.Namespace) and args.quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--quantization", "q2_k"])


def test_bf16_runs_the_c_kernel_for_decode_rows_everywhere(tiny_model_dir, tmp_path, monkeypatch):
    """bf16 without --quantization: `cpu_linear.c` in bf16 for decode rows on every CPU; where the CPU has a bf16
    matrix unit (AMX or AVX512-BF16) the weight stays as torch holds it (bf16_rows) and prompt rows run oneDNN's
    bf16 GEMM on that same tensor, elsewhere (oneDNN would emulate bf16) it is packed for the C kernel."""
    from pdserve.engine import weight_format

    kernels = quant_linear.load(tmp_path)
    require_built(kernels, "cpu_linear.c")
    for native, fmt in ((False, "bf16"), (True, "bf16_rows")):
        monkeypatch.setattr(weight_format, "native_bf16_gemm", lambda native=native: native)
        model = load_model(tiny_model_dir, torch.bfloat16)
        assert f"{fmt}; cpu_linear.c" in weight_format.apply(model, "none", torch.bfloat16, kernels)
        assert {m.fmt for m in model.modules() if isinstance(m, QuantLinear)} == {fmt}
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.packed.data_ptr() == embedding.data_ptr()  # the tied head is not copied
    x = torch.randn(kernels.bf16_rows_decode + 5, 64).bfloat16()  # prompt rows: oneDNN where it packs bf16
    head = model.lm_head
    want = torch.nn.functional.linear(x.float(), embedding.float()).bfloat16()
    assert torch.allclose(head(x).float(), want.float(), atol=0.05, rtol=0.02)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert weight_format.weight_bytes(model) == sum(m.nbytes for m in quant)  # the prompt copy is not read by decode
