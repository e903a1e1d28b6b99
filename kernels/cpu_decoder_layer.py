"""A whole decoder layer of a bfloat16 decode step in one C call (`cpu_decoder_layer.c`).

At batch 1 a 135M model's layer does about 0.2 ms of arithmetic and, run op by op from Python, spent as long again
dispatching its dozen torch and ctypes calls: half of a gguf decode step. `DecodeLayers` binds the library to one
model's packed weights and KV cache once; a step then sets the rows' cache slots, block tables and rotary rows
once and makes one call per layer. Numbers are those of the eager path bit for bit (the C code calls the same
kernels with the same roundings), so it is a speed-up, not a second implementation to keep in step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels import c_build
from pdserve.kernels.quant_linear import CODES, QuantLinear

SOURCE = Path(__file__).with_name("cpu_decoder_layer.c")
_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
LANES, MAX_HEAD_DIM, MAX_GROUP = 16, 256, 16  # what cpu_elementwise.c and cpu_paged_attention.c take


class _Layer(ctypes.Structure):
    _fields_ = [
        ("ln1", _P),
        ("ln2", _P),
        ("w_qkv", _P),
        ("w_o", _P),
        ("w_gu", _P),
        ("w_down", _P),
        ("fmt_qkv", _I32),
        ("fmt_o", _I32),
        ("fmt_gu", _I32),
        ("fmt_down", _I32),
        ("b_qkv", _P),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _I32) for name in ("T", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size")),
        ("max_len", _I32),
        ("threads", _I32),
        ("eps", _F),
        ("scale", _F),
        ("cos", _P),
        ("sin", _P),
        ("cs_stride", _I64),
        ("slots", _P),
        ("tables", _P),
        ("table_stride", _I64),
        ("lens", _P),
    ]


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float

    def unsupported(self) -> str | None:
        """Why the C kernels cannot take this shape, or None."""
        if self.hidden % LANES or self.head_dim % LANES or self.head_dim > MAX_HEAD_DIM:
            return f"hidden size {self.hidden} / head dim {self.head_dim} (needs multiples of {LANES}, dim <= 256)"
        if self.heads % self.kv_heads or self.heads // self.kv_heads > MAX_GROUP:
            return f"{self.heads} query heads over {self.kv_heads} KV heads"
        return None


@dataclass
class LayerWeights:
    """One layer's norms (bf16 [hidden]) and its four packed projections."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: QuantLinear
    o: QuantLinear
    gate_up: QuantLinear
    down: QuantLinear

    def unsupported(self, shape: LayerShape) -> str | None:
        for norm in (self.ln1, self.ln2):
            if norm.dtype != torch.bfloat16 or not norm.is_contiguous() or norm.numel() != shape.hidden:
                return "a norm weight that is not bf16 [hidden]"
        q_kv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        want = {
            "qkv": (shape.hidden, q_kv),
            "o": (shape.heads * shape.head_dim, shape.hidden),
            "gate_up": (shape.hidden, 2 * shape.inter),
            "down": (shape.inter, shape.hidden),
        }
        for name, (k, n) in want.items():
            lin: QuantLinear = getattr(self, name)
            if (lin.in_features, lin.out_features) != (k, n) or (name != "qkv" and lin.bias is not None):
                return f"{name} projection of another shape"
        return None


class DecodeLayers:
    """The library bound to one model's layers: `run` takes a decode step's residual stream through them all."""

    def __init__(self, lib: ctypes.CDLL, shape: LayerShape, layers: list[LayerWeights], max_rows: int) -> None:
        self._fn = lib.decoder_layer_bf16
        self._fn.argtypes, self._fn.restype = [_P, _P, _P], ctypes.c_int
        self._stack = lib.decoder_layers_bf16
        self._stack.argtypes = [_P, ctypes.c_int, _P, _P, ctypes.POINTER(ctypes.c_int32)]
        self._stack.restype = ctypes.c_int
        self._failed = ctypes.c_int32(0)
        self.shape, self.max_rows = shape, max_rows
        self._weights = layers  # keeps every pointer below alive
        self._layers = (_Layer * len(layers))()
        for c, w in zip(self._layers, layers):
            c.ln1, c.ln2 = w.ln1.data_ptr(), w.ln2.data_ptr()
            c.w_qkv, c.w_o, c.w_gu, c.w_down = (lin.packed.data_ptr() for lin in (w.qkv, w.o, w.gate_up, w.down))
            c.fmt_qkv, c.fmt_o, c.fmt_gu, c.fmt_down = (CODES[lin.packing] for lin in (w.qkv, w.o, w.gate_up, w.down))
            c.b_qkv = w.qkv.bias.data_ptr() if w.qkv.bias is not None else None
        self._addrs = [ctypes.addressof(c) for c in self._layers]
        self._step = _Step(
            hidden=shape.hidden,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            inter=shape.inter,
            eps=shape.eps,
            scale=shape.head_dim**-0.5,
        )
        self._step_addr = ctypes.addressof(self._step)
        self._cache_ptr = -1

    def takes(self, x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether `run` takes this step's activations (its rows must also be one token per sequence)."""
        return (
            x.dtype == torch.bfloat16
            and x.dim() == 2
            and 0 < x.shape[0] <= self.max_rows
            and (kv_cache.data_ptr() == self._cache_ptr or self.supports_cache(kv_cache))
        )

    def supports_cache(self, kv_cache: torch.Tensor) -> bool:
        """A bf16 `[layers, 2, blocks, block_size, kv_heads, head_dim]` CPU cache, contiguous."""
        return (
            kv_cache.device.type == "cpu"
            and kv_cache.dtype == torch.bfloat16
            and kv_cache.is_contiguous()
            and kv_cache.dim() == 6
            and kv_cache.shape[0] == len(self._layers)
            and tuple(kv_cache.shape[4:]) == (self.shape.kv_heads, self.shape.head_dim)
        )

    def _bind_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.data_ptr() == self._cache_ptr:
            return
        for i, c in enumerate(self._layers):
            c.k_cache, c.v_cache = kv_cache[i, 0].data_ptr(), kv_cache[i, 1].data_ptr()
        self._step.block_size = kv_cache.shape[3]
        self._cache_ptr = kv_cache.data_ptr()

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: list[int],
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """x `[T, hidden]` bf16, one token per sequence, updated in place and returned; cos/sin `[T, 1, head_dim]`
        bf16 (rows of one table); slots `[T]` int64; tables `[T, blocks]` int64; lens the context lengths, the new
        token included. `layer_hook(i)` runs after layer i has written its K/V."""
        self._bind_cache(kv_cache)
        x = x.contiguous()
        slots = slots.to(torch.int64).contiguous()
        if tables.dtype != torch.int64 or tables.stride(1) != 1:
            tables = tables.to(torch.int64).contiguous()
        lens_t = torch.tensor(lens, dtype=torch.int32)
        s = self._step
        s.T, s.max_len, s.threads = x.shape[0], max(lens), torch.get_num_threads()
        s.cos, s.sin, s.cs_stride = cos.data_ptr(), sin.data_ptr(), cos.stride(0)
        s.slots, s.lens = slots.data_ptr(), lens_t.data_ptr()
        s.tables, s.table_stride = tables.data_ptr(), tables.stride(0)
        xp = x.data_ptr()
        if layer_hook is None:  # the whole stack in one call: one release of the interpreter lock, not one a layer
            rc = self._stack(self._addrs[0], len(self._addrs), self._step_addr, xp, ctypes.byref(self._failed))
            if rc:
                raise RuntimeError(f"cpu decoder layer {self._failed.value} failed (code {rc}) on {x.shape[0]} rows")
            return x
        for i, addr in enumerate(self._addrs):
            rc = self._fn(addr, self._step_addr, xp)
            if rc:
                raise RuntimeError(f"cpu decoder layer {i} failed (code {rc}) on {x.shape[0]} rows")
            layer_hook(i)
        return x


def load(cache_dir: Path) -> ctypes.CDLL | None:
    """The library, built into `cache_dir` on first use (`kernels.c_build`); None where it cannot be built."""
    return c_build.build(SOURCE, cache_dir)
