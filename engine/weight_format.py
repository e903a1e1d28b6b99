"""Which format each linear layer's weight is held in on a CPU (`--quantization`).

- `none`: the checkpoint's values in `--dtype`; fp32 stays on torch's GEMM (token-exact against transformers);
  bf16 stays on oneDNN's packed bf16 GEMM where the CPU computes bf16 natively (AMX, AVX512-BF16) and runs
  `cpu_linear.c` elsewhere, where oneDNN emulates bf16 several times slower than fp32.
- `q8_0`, `q4_0`: every linear weight quantized at load, round to nearest in blocks of 32 (ggml's formats).
- `gguf`: the tensors of the GGUF file the model came from, in the file's own types (Q8_0, Q4_0, Q4_1, F16,
  BF16, F32), never requantized (read by `engine.gguf_file`); the tied output layer reads the token embedding's
  blocks.

The embedding table and the norms stay in `--dtype`; so does the KV cache. The format is part of the KV layout's
fingerprint (`KVLayout.weights`): workers whose weights differ compute different numbers and refuse to pair.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.gguf_file import GGUFFile
from pdserve.kernels import cpu_isa, quant_linear
from pdserve.kernels.packed_linear import PackedLinear, can_pack, pack_linears
from pdserve.kernels.quant_linear import CpuLinear, QuantLinear

log = logging.getLogger(__name__)


def check(quantization: str, device: str) -> None:
    """ValueError for a format that is not one, or one this device does not run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and device != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on a CPU only; on a GPU use none (weights in --dtype)")


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
        blocks = GGUFFile(gguf).linears(model.config)  # type: ignore[arg-type]
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
