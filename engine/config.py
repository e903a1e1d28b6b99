"""Model and engine configuration as plain dataclasses (importing this module does not import torch: the CLI
builds its flags from `EngineConfig` and must answer --help at once)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}

QUANTIZATIONS = ("none", "q8_0", "q4_0", "gguf")  # CPU weight formats (engine.weight_format)
# what quantized weights multiply: activations quantized to int8 blocks (llama.cpp's arithmetic) or as they are
ACTIVATIONS = ("q8", "exact")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        return getattr(torch, _DTYPES[name.lower()])
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    @property
    def linear_params(self) -> int:
        """Weights a token multiplies through: every layer's projections plus the LM head (2 FLOPs each)."""
        attention = self.hidden_size * (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp) + self.vocab_size * self.hidden_size

    @classmethod
    def from_hf(cls, config: dict, name: str = "model") -> ModelConfig:
        arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        if config.get("model_type") not in {"llama", "mistral", "qwen2"}:
            raise ValueError(f"model_type {config.get('model_type')!r} ({arch}) is not a supported Llama-family model")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=rope or None,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        config = json.loads((path / "config.json").read_text())
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                config["eos_token_id"] = eos
        return cls.from_hf(config, name=path.name)


@dataclass
class EngineConfig:
    """Knobs of one engine instance (one worker process)."""

    model: str | None = None
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_memory: int = 512 << 20
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto, flash-attn, triton, torch
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto (cuda when present)
    num_threads: int | None = None
    quantization: str = "none"  # CPU weight format: none, q8_0, q4_0, gguf (engine.weight_format)
    activations: str = "q8"  # with quantized weights: q8 (integer products, int8 activations) or exact
    fused_decode_layers: bool = True  # bf16 on CPU, packed weights: a decode step's layers one C call each
    speculative_tokens: int = 0  # decode: tokens guessed by prompt lookup and checked per step (0: off)
    speculative_draft: str = "none"  # decode: a draft model guesses too, the model in this weight format (CPU)
    fused_elementwise: bool = True  # CPU: C bf16 RMSNorm, rope, SiLU-and-mul, and greedy argmax (False: torch)
