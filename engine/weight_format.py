"""Which format each linear layer's weight is held in on a CPU (`--quantization`), and reading a GGUF file's own.

- `none`: the checkpoint's values in `--dtype`; fp32 stays on torch's GEMM (token-exact against transformers);
  bf16 stays on oneDNN's packed bf16 GEMM where the CPU computes bf16 natively (AMX, AVX512-BF16) and runs
  `cpu_linear.c` elsewhere, where oneDNN emulates bf16 several times slower than fp32.
- `q8_0`, `q4_0`: every linear weight quantized at load, round to nearest in blocks of 32 (ggml's formats).
- `gguf`: the tensors of the GGUF file the model came from, in the file's own types (Q8_0, Q4_0, Q4_1, F16,
  BF16, F32), never requantized; the tied output layer reads the token embedding's blocks.

The embedding table and the norms stay in `--dtype`; so does the KV cache. The format is part of the KV layout's
fingerprint (`KVLayout.weights`): workers whose weights differ compute different numbers and refuse to pair.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from pdserve.engine.config import QUANTIZATIONS, ModelConfig
from pdserve.kernels import cpu_isa, quant_linear
from pdserve.kernels.packed_linear import PackedLinear, can_pack, pack_linears
from pdserve.kernels.quant_linear import Blocks, CpuLinear, QuantLinear

log = logging.getLogger(__name__)

_GGUF_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def check(quantization: str, device: str) -> None:
    """ValueError for a format that is not one, or one this device does not run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and device != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on a CPU only; on a GPU use none (weights in --dtype)")


def _unpermute(b: Blocks, heads: int) -> Blocks:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head's rows; put them back in the
    order Hugging Face checkpoints (and this engine's rotary embedding) use."""
    rows = torch.arange(b.n).view(heads, 2, b.n // heads // 2).transpose(1, 2).reshape(-1)
    order = torch.empty_like(rows)
    order[rows] = torch.arange(b.n)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[order].contiguous()

    q = take(b.q)
    assert q is not None
    return Blocks(b.fmt, b.n, b.k, q, take(b.d), take(b.m))


def gguf_linears(path: Path, cfg: ModelConfig) -> dict[str, Blocks]:
    """Every linear weight of a Llama-family GGUF file as Blocks, named as `LlamaForCausalLM`'s modules
    (q/k/v and gate/up fused); ValueError naming a tensor whose type no kernel here runs."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def blocks(name: str) -> Blocks:
        t = tensors[name]
        kind = _GGUF_TYPES.get(t.tensor_type.name)
        if kind is None:
            raise ValueError(
                f"{path.name}: tensor {name} is {t.tensor_type.name}, which pdserve's CPU kernels do not run "
                f"(they run {', '.join(_GGUF_TYPES)}); use --quantization q8_0, q4_0 or none"
            )
        k, n = (int(x) for x in t.shape[:2])
        raw = torch.from_numpy(t.data.copy())
        if kind == "f16":
            return Blocks("f32", n, k, raw.view(torch.float16).reshape(n, k).float())
        if kind == "bf16":
            return Blocks("bf16", n, k, raw.view(torch.bfloat16).reshape(n, k))
        if kind == "f32":
            return Blocks("f32", n, k, raw.view(torch.float32).reshape(n, k))
        return quant_linear.from_gguf(raw.view(torch.uint8), kind, n, k)

    out: dict[str, Blocks] = {}
    for i in range(cfg.num_layers):
        part: dict[str, Blocks] = {}
        for short, hf in _GGUF_NAMES.items():
            b = blocks(f"blk.{i}.{short}.weight")
            if short in ("attn_q", "attn_k"):
                b = _unpermute(b, cfg.num_heads if short == "attn_q" else cfg.num_kv_heads)
            part[hf.split(".")[1]] = b
        prefix = f"model.layers.{i}."
        for fused, names in _FUSED.items():
            out[prefix + fused] = quant_linear.concat([part[n] for n in names])
        out[prefix + "self_attn.o_proj"] = part["o_proj"]
        out[prefix + "mlp.down_proj"] = part["down_proj"]
    out["lm_head"] = blocks("output.weight" if "output.weight" in tensors else "token_embd.weight")
    return out


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def native_bf16_gemm() -> bool:
    """Whether oneDNN's bf16 GEMM has hardware under it here (AMX or AVX512-BF16): then it beats an fp32 GEMM
    for prompts; elsewhere it emulates bf16 and runs several times slower than fp32."""
    return cpu_isa.level() == "avx512" and bool({"amx_bf16", "avx512_bf16"} & cpu_isa.cpu_flags())


def fingerprint(quantization: str, activations: str) -> str:
    """What the KV layout's fingerprint calls these weights: int8 activations compute other KV values than exact
    ones, so workers that differ in either refuse to pair."""
    return quantization if quantization == "none" or activations == "exact" else f"{quantization}+q8"


def apply(
    model: nn.Module,
    quantization: str,
    dtype: torch.dtype,
    kernels: CpuLinear | None,
    gguf: Path | None = None,
    activations: str = "exact",
) -> str:
    """Put every linear layer of a CPU model in its format (`check` it first); returns what runs them, for the
    start-up log. `activations`: "q8" runs Q8_0 and 4-bit blocks as integer products with activations quantized
    to int8 (cpu_linear_q8.h)."""
    linears = _linears(model)
    if quantization == "none" and dtype == torch.float32:
        return "linear layers: torch fp32 GEMM"
    if quantization == "none" and (dtype != torch.bfloat16 or kernels is None):
        packed = pack_linears(model)
        if packed:
            return f"linear layers: oneDNN packed {str(dtype).removeprefix('torch.')} ({packed})"
        log.warning(
            "this CPU has no native %s matrix unit for oneDNN and no C kernel was built: linear layers run on "
            "plain torch, usually slower than --dtype float32 here",
            str(dtype).removeprefix("torch."),
        )
        return "linear layers: torch (no kernel for this dtype here)"
    if kernels is None:
        raise ValueError(
            f"--quantization {quantization} needs the C kernels, which could not be built (no C compiler?)"
        )
    if quantization == "gguf":
        if gguf is None:
            raise ValueError("--quantization gguf needs a model that came from a .gguf file")
        blocks = gguf_linears(gguf, model.config)  # type: ignore[arg-type]
        missing = sorted(set(linears) - set(blocks))
        if missing:
            raise ValueError(f"{gguf.name} has no weights for {missing[:3]}")
    formats: Counter[str] = Counter()
    for name, lin in linears.items():
        if quantization == "gguf":
            b = blocks[name]
        elif quantization == "none":  # where oneDNN has bf16 hardware, prompts run on it over the same tensor
            b = quant_linear.quantize(lin.weight.detach(), "bf16_rows" if native_bf16_gemm() else "bf16")
        else:
            b = quant_linear.quantize(lin.weight.detach().float(), quantization)
        # bf16_rows: oneDNN's packed copy for prompt rows and big batches (10-25% faster than on the plain tensor)
        prompt = PackedLinear(lin) if b.fmt == "bf16_rows" and can_pack(lin.weight) else None
        layer = QuantLinear(b, lin.bias, kernels, prompt, activations)
        _replace(model, name, layer)
        formats[layer.packing] += 1
    what = ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items()))
    if set(formats) == {"bf16_rows"}:
        return (
            f"linear layers: {what}; cpu_linear.c ({kernels.isa}) up to {kernels.bf16_rows_decode} rows, "
            "oneDNN's packed bf16 GEMM above (the weights are held twice)"
        )
    if set(formats) & set(quant_linear.Q8_ACTIVATIONS.values()):
        return (
            f"linear layers: {what} (_q8: int8 activations, integer dot products: {kernels.q8_isa}); "
            f"cpu_linear.c ({kernels.isa}) up to {kernels.prompt_rows} rows for the others, the fp32 GEMM over the "
            "dequantized weight above"
        )
    if kernels.bf16_dot and dtype == torch.bfloat16 and set(formats) & {"q8_0", "q4_0", "q4_1"}:
        return (
            f"linear layers: {what}; cpu_linear.c ({kernels.isa}; bf16 pair products) at any row count for Q8_0 and "
            f"4-bit blocks, up to {kernels.prompt_rows} rows for the others, the fp32 GEMM over the dequantized weight "
            "above"
        )
    return (
        f"linear layers: {what}; cpu_linear.c ({kernels.isa}) up to {kernels.prompt_rows} rows, "
        "the fp32 GEMM over the dequantized weight above"
    )


def decode_linears(model: nn.Module) -> list[nn.Linear | QuantLinear | PackedLinear]:
    """The linear layers a decode step multiplies by: not the prompt-rows copies some QuantLinears hold."""
    second = {id(m.prompt) for m in model.modules() if isinstance(m, QuantLinear) and m.prompt is not None}
    return [m for m in model.modules() if isinstance(m, nn.Linear | QuantLinear | PackedLinear) and id(m) not in second]


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads for the linear layers' weights (what the weight-bytes limit counts)."""
    total = 0
    for m in decode_linears(model):
        if isinstance(m, QuantLinear):
            total += m.nbytes
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, PackedLinear):
            total += m.in_features * m.out_features * 2
    return total
