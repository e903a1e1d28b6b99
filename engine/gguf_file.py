"""A Llama-family GGUF file's tensors under the Hugging Face names `LlamaForCausalLM` loads: dequantized to a dtype
(the `--quantization none` and quantized-at-load paths) or as the file's own blocks (`--quantization gguf`).

Read straight from the file (memory-mapped), one tensor at a time: a 1B-parameter Q4_0 file never becomes a 5 GB
fp32 checkpoint on disk, and `--quantization gguf` dequantizes only the token embedding. The values equal what
`transformers` makes of the same file (both dequantize with the `gguf` package's reference code and undo
llama.cpp's rotary interleaving of q/k rows); `tests/test_weight_format.py` compares them bit for bit.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve.engine.config import ModelConfig
from pdserve.kernels import quant_linear
from pdserve.kernels.quant_linear import Blocks

if TYPE_CHECKING:
    from gguf.constants import GGMLQuantizationType

BLOCK_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def _hf_order(n: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head's rows; the row order that puts
    them back as Hugging Face checkpoints (and this engine's rotary embedding) have them."""
    rows = torch.arange(n).view(heads, 2, n // heads // 2).transpose(1, 2).reshape(-1)
    order = torch.empty_like(rows)
    order[rows] = torch.arange(n)
    return order


@dataclass(frozen=True)
class Tensor:
    """Where one tensor lies in the file: `data` is its bytes, [rows, bytes per row], memory-mapped."""

    name: str
    shape: tuple[int, ...]  # as the weight has it: (rows, columns) for a matrix
    type: GGMLQuantizationType
    data: np.ndarray


_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian header fields in order (struct over the mapped bytes: the `gguf` package's
    reader turns each of a tokenizer's 100k strings into a NumPy view and takes seconds)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def value(self, kind: int, keep: bool) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS and not keep:
                self.pos += _SCALARS[item] * count
                return None
            return [self.value(item, keep) for _ in range(count)]
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[kind]
        return self.take(fmt)


class GGUFFile:
    """One GGUF file's scalar metadata and tensor index; tensor bytes stay memory-mapped until read."""

    def __init__(self, path: Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        c = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF" or c.take("4xI") < 2:
            raise ValueError(f"{path} is not a GGUF file of version 2 or later")
        n_tensors, n_fields = c.take("Q"), c.take("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key, kind = c.string(), c.take("I")
            value = c.value(kind, keep=not key.startswith("tokenizer."))
            if kind != _ARRAY:
                self.fields[key] = value
        index = []
        for _ in range(n_tensors):
            name, dims = c.string(), c.take("I")
            ne = [c.take("Q") for _ in range(dims)]
            index.append((name, ne, GGMLQuantizationType(c.take("I")), c.take("Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        whole = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: dict[str, Tensor] = {}
        for name, ne, qtype, offset in index:
            block, size = GGML_QUANT_SIZES[qtype]
            row_bytes = ne[0] // block * size
            rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
            data = whole[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors[name] = Tensor(name, tuple(reversed(ne)), qtype, data)
        # llama.cpp interleaves q/k rows for the architectures it runs with its "normal" rotary (Llama, Mistral)
        self.interleaved = self.fields.get("general.architecture", "llama") == "llama"

    def _rotary_heads(self, short: str, cfg: ModelConfig) -> int | None:
        if not self.interleaved:
            return None
        return cfg.num_heads if short == "attn_q" else cfg.num_kv_heads if short == "attn_k" else None

    def dequantized(self, name: str, dtype: torch.dtype, heads: int | None = None) -> torch.Tensor:
        """A tensor's values in `dtype` ([rows, columns] for matrices), q/k rows in Hugging Face order."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        array = dequantize(t.data, t.type)
        values = torch.from_numpy(array if array.flags.writeable else array.copy()).reshape(t.shape)
        if heads is not None:
            values = values[_hf_order(t.shape[0], heads)]
        return values.to(dtype).contiguous()

    def blocks(self, name: str, heads: int | None = None) -> Blocks:
        """A matrix in the file's own type, without converting; ValueError for a type no CPU kernel here runs."""
        t = self.tensors[name]
        kind = BLOCK_TYPES.get(t.type.name)
        if kind is None:
            raise ValueError(
                f"{self.path.name}: tensor {name} is {t.type.name}, which pdserve's CPU kernels do not run "
                f"(they run {', '.join(BLOCK_TYPES)}); use --quantization q8_0, q4_0 or none"
            )
        n, k = t.shape
        raw = torch.from_numpy(t.data.copy())
        if kind == "f16":
            b = Blocks("f32", n, k, raw.view(torch.float16).reshape(n, k).float())
        elif kind == "bf16":
            b = Blocks("bf16", n, k, raw.view(torch.bfloat16).reshape(n, k))
        elif kind == "f32":
            b = Blocks("f32", n, k, raw.view(torch.float32).reshape(n, k))
        else:
            b = quant_linear.from_gguf(raw.view(torch.uint8), kind, n, k)
        return b if heads is None else _reorder(b, _hf_order(n, heads))

    def output_name(self) -> str:
        """The output layer's tensor: its own, or the token embedding's where the file ties them."""
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    def state_dict(self, cfg: ModelConfig, dtype: torch.dtype, linears: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor `LlamaForCausalLM` loads, q/k/v and gate/up fused, in `dtype`; `linears=False` leaves out
        the layers' linear weights (the caller puts the file's blocks there)."""
        return dict(self._state(cfg, dtype, linears))

    def _state(self, cfg: ModelConfig, dtype: torch.dtype, linears: bool) -> Iterator[tuple[str, torch.Tensor]]:
        yield "model.embed_tokens.weight", self.dequantized("token_embd.weight", dtype)
        yield "model.norm.weight", self.dequantized("output_norm.weight", dtype)
        if "output.weight" in self.tensors and linears:
            yield "lm_head.weight", self.dequantized("output.weight", dtype)
        for i in range(cfg.num_layers):
            prefix = f"model.layers.{i}."
            for short, hf in NORMS.items():
                yield f"{prefix}{hf}.weight", self.dequantized(f"blk.{i}.{short}.weight", dtype)
            part: dict[str, torch.Tensor] = {}
            for short, hf in LINEARS.items():
                for kind in ("weight", "bias") if linears else ("bias",):
                    name = f"blk.{i}.{short}.{kind}"
                    if name in self.tensors:
                        part[f"{hf.split('.')[1]}.{kind}"] = self.dequantized(
                            name, dtype, self._rotary_heads(short, cfg)
                        )
            for fused, names in FUSED.items():
                for kind in ("weight", "bias"):
                    if all(f"{n}.{kind}" in part for n in names):
                        yield f"{prefix}{fused}.{kind}", torch.cat([part[f"{n}.{kind}"] for n in names])
            for single in ("self_attn.o_proj", "mlp.down_proj"):
                for kind in ("weight", "bias"):
                    if f"{single.split('.')[1]}.{kind}" in part:
                        yield f"{prefix}{single}.{kind}", part[f"{single.split('.')[1]}.{kind}"]

    def linears(self, cfg: ModelConfig) -> dict[str, Blocks]:
        """Every linear weight as Blocks, named as `LlamaForCausalLM`'s modules (q/k/v and gate/up fused)."""
        out: dict[str, Blocks] = {}
        for i in range(cfg.num_layers):
            part = {
                hf.split(".")[1]: self.blocks(f"blk.{i}.{short}.weight", self._rotary_heads(short, cfg))
                for short, hf in LINEARS.items()
            }
            prefix = f"model.layers.{i}."
            for fused, names in FUSED.items():
                out[prefix + fused] = quant_linear.concat([part[n] for n in names])
            out[prefix + "self_attn.o_proj"] = part["o_proj"]
            out[prefix + "mlp.down_proj"] = part["down_proj"]
        out["lm_head"] = self.blocks(self.output_name())
        return out


def _reorder(b: Blocks, order: torch.Tensor) -> Blocks:
    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[order].contiguous()

    q = take(b.q)
    assert q is not None
    return Blocks(b.fmt, b.n, b.k, q, take(b.d), take(b.m))
