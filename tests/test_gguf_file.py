"""A GGUF other than the built-in one: the benchmark's random-weight generator writes a Llama file in a real
model's layout (Q4_0 everywhere, tied output, llama.cpp's q/k row order), and the engine serves it read straight
from the file, token for token what transformers computes from the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.benchmarks import random_gguf
from pdserve.engine import EngineConfig, EngineCore, SamplingParams
from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_file import GGUFFile
from pdserve.engine.model_store import gguf_source, resolve_model, transformers_dir
from pdserve.kernels import quant_linear
from tests.cpu_levels import require_built

SHAPE = random_gguf.SHAPES["tiny"]
PROMPTS = [[1, 9, 4000, 77, 12, 30000], [5, 17, 99, 3, 42, 1000, 2000, 3000, 4000, 5000, 6000]]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> tuple:
    """(the GGUF file, the directory resolve_model makes of it), in a cache of the test's own."""
    root = tmp_path_factory.mktemp("random-gguf")
    path = random_gguf.write(SHAPE, root / "tiny-random.Q4_0.gguf")
    with pytest.MonkeyPatch.context() as mp:  # the model's files in a cache of its own; the kernels' stay shared
        mp.setenv("PDSERVE_CACHE", str(root / "cache"))
        model_dir = resolve_model(str(path))
    return path, model_dir


def test_the_file_has_the_shape_and_the_bytes(random_model):
    path, model_dir = random_model
    f = GGUFFile(path)
    assert f.fields["general.architecture"] == "llama" and f.fields["llama.block_count"] == SHAPE.layers
    assert f.fields["llama.vocab_size"] == SHAPE.vocab and "output.weight" not in f.tensors
    for name, rows, cols in SHAPE.linears():
        t = f.tensors[name]
        assert t.shape == (rows, cols) and t.type.name == "Q4_0", name
    blocks = f.linears(ModelConfig.from_dir(model_dir))
    assert sum(b.nbytes for b in blocks.values()) == SHAPE.nbytes()
    w = quant_linear.dequantize(blocks["model.layers.0.mlp.down_proj"])
    assert 0.015 < float(w.std()) < 0.025  # what the generator aims at (0.02)


def test_resolving_it_keeps_config_and_tokenizer_not_weights(random_model):
    path, model_dir = random_model
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (256, 2, 4, 2)
    assert cfg.vocab_size == SHAPE.vocab and cfg.tie_word_embeddings
    assert gguf_source(model_dir) == path.resolve()
    assert not list(model_dir.glob("*.safetensors"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == SHAPE.vocab and tok.decode([SHAPE.vocab - 1]) == f"<|extra_{SHAPE.vocab - 49153}|>"


def _greedy(cfg: EngineConfig, n: int = 10) -> list[list[int]]:
    core = EngineCore(cfg)
    seqs = [core.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    while core.has_work:
        for out in core.step():
            assert out.error is None
    return [list(s.output_ids) for s in seqs]


def test_fp32_from_the_file_is_token_exact_against_transformers(random_model):
    """The engine dequantizes the file itself; transformers converts it its own way; greedy tokens agree."""
    from transformers import AutoModelForCausalLM

    _, model_dir = random_model
    hf = AutoModelForCausalLM.from_pretrained(str(transformers_dir(model_dir)), dtype=torch.float32).eval()
    want = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        want.append(out[0, len(p) :].tolist())
    assert _greedy(EngineConfig(model=str(model_dir), dtype="float32")) == want


def test_served_from_its_own_blocks(random_model, tmp_path):
    """`--quantization gguf` runs the file's Q4_0 blocks against int8 activations: the linear layers are never
    dequantized, the KV fingerprint says so, and greedy tokens mostly agree with the exact product's."""
    _, model_dir = random_model
    require_built(quant_linear.load(tmp_path), "cpu_linear.c")
    q8 = EngineCore(EngineConfig(model=str(model_dir), dtype="bfloat16", quantization="gguf", activations="q8"))
    assert q8.layout.weights == "gguf+q8"
    from pdserve.engine.weight_format import weight_bytes

    assert weight_bytes(q8.runner.model) == SHAPE.nbytes()
    got = _greedy(EngineConfig(model=str(model_dir), dtype="bfloat16", quantization="gguf", activations="q8"))
    exact = _greedy(EngineConfig(model=str(model_dir), dtype="bfloat16", quantization="gguf", activations="exact"))
    assert all(len(g) == 10 for g in got)
    same = sum(a == b for g, e in zip(got, exact) for a, b in zip(g, e))
    print(f"int8 vs exact activations on random weights: {same}/{sum(map(len, got))} greedy tokens equal")
    assert np.mean([g[0] == e[0] for g, e in zip(got, exact)]) >= 0.5
