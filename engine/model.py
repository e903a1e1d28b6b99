"""The Llama-family decoder (Llama 2/3, Mistral, SmolLM, Qwen2) over a paged KV cache.

Module and parameter names follow Hugging Face so checkpoints load by name; q/k/v and gate/up projections are
fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_file import GGUFFile
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.cpu_decoder_layer import DecodeLayers, LayerShape, LayerWeights
from pdserve.kernels.quant_linear import QuantLinear
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary import apply_rope, rope_cache, rope_for_positions

Op = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op: Op = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.rope_op: Op = apply_rope

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk = self.rope_op(
            qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), *rope
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = backend(q, k, v, kv_layer, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_op: Op = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_op(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, kv_layer, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_layer, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Forward over a flat batch of tokens; `layer_hook(l)` runs after layer l has written its KV."""

    rope: torch.Tensor  # a buffer: the rotary cos/sin table for every position

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.decode_layers: DecodeLayers | None = None
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer(
            "rope",
            rope_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        layer_hook=None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = rope_for_positions(self.rope, positions, x.dtype)
        fused = self.decode_layers
        if fused is not None and len(meta.seq_lens) == x.shape[0] and fused.takes(x, kv_caches):
            # one token per sequence: the whole layer stack in C (one call, or one a layer with a hook)
            x = fused.run(x, *rope, kv_caches, meta.slot_mapping, meta.block_tables, meta.seq_lens, layer_hook)
            return self.model.norm(x)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, kv_caches[i], meta, backend)
            if layer_hook is not None:
                layer_hook(i)
        return self.model.norm(x)

    def use_ops(self, rms_norm_op: Op, rope_op: Op, act_op: Op) -> None:
        """Run the element-wise steps with these (same signatures as `rms_norm`, `apply_rope`, `silu_and_mul`;
        the rope op may work in place)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.op = rms_norm_op
            elif isinstance(module, Attention):
                module.rope_op = rope_op
            elif isinstance(module, MLP):
                module.act_op = act_op

    def layer_weights(self) -> list[LayerWeights] | str:
        """Every layer's norms and packed projections, as `DecodeLayers` takes them; or why they cannot be."""
        out: list[LayerWeights] = []
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
            if not (
                isinstance(qkv, QuantLinear)
                and isinstance(o, QuantLinear)
                and isinstance(gate_up, QuantLinear)
                and isinstance(down, QuantLinear)
            ):
                return "linear layers not on cpu_linear.c"
            norms = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            out.append(LayerWeights(*norms, qkv, o, gate_up, down))
        return out

    def layer_shape(self) -> LayerShape:
        c = self.config
        return LayerShape(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler converts what it needs (greedy decoding takes the argmax as is)."""
        return self.lm_head(hidden)


def _fused_state_dict(files: list[Path], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                raw[name] = st.get_tensor(name)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if "rotary_emb" in name:
            continue
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if f".{parts[0]}." in name:
                state[name.replace(parts[0], fused)] = torch.cat([raw[name.replace(parts[0], p)] for p in parts])
                break
        else:
            if not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
                state[name] = tensor
    return state


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    gguf: Path | None = None,
    linears: bool = True,
) -> LlamaForCausalLM:
    """Load a Llama-family model directory: its config.json, and the weights from its *.safetensors or, given
    `gguf`, from that file. `linears=False` leaves the layers' linear weights on the meta device, for a caller
    that puts other weights there (`weight_format.apply` with the GGUF's own blocks)."""
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if gguf is not None:
        state = GGUFFile(gguf).state_dict(cfg, dtype, linears)
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        state = _fused_state_dict(files, cfg)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False, assign=True)
    missing = [
        n
        for n, p in model.named_parameters()
        if p.is_meta and (linears or not (n.endswith(".weight") and _is_linear(model, n)))
    ]
    if missing:
        raise ValueError(f"checkpoint {gguf or path} lacks {missing[:4]}")
    model.rope = rope_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if linears:
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.rope = model.rope.to(dtype)  # the file's tensors came in dtype; a module-wide .to cannot move meta ones
    return model.eval().requires_grad_(False)


def _is_linear(model: nn.Module, param: str) -> bool:
    return isinstance(model.get_submodule(param.rpartition(".")[0]), nn.Linear)
