"""Weight formats a linear layer can hold on a CPU, their packing for `cpu_linear.c`, and the layer that runs them.

A decode step multiplies a few rows of activations by every weight once, so its time is the time to read the
weights: smaller weights (bf16, int8 or 4-bit blocks, as GGUF files hold them) are a faster step, provided that
turning them back into numbers costs less than the bytes saved. `cpu_linear.c` does that for up to 128 rows (32
on the portable build); longer prompt chunks are compute-bound instead and run torch's fp32 GEMM over the weight
dequantized into a scratch buffer, which costs one pass over the weight per call.

The formats follow ggml's block formats (blocks of 32 along the input dimension, fp16 scales): `q8_0` (int8,
one scale), `q4_0` (4-bit, one scale, offset 8), `q4_1` (4-bit, scale and minimum); `bf16` and `f32` hold the
weight as it is. `Blocks` is a weight in one of them, row by row as a GGUF file stores it; `pack` lays it out for
the kernel and `dequantize` is the reference (and the test oracle).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import c_build, cpu_isa

SOURCE = Path(__file__).with_name("cpu_linear.c")
FORMATS = {"f32": 0, "bf16": 1, "q8_0": 2, "q4_0": 3, "q4_1": 4, "bf16_rows": 5}
PLAIN = ("f32", "bf16", "bf16_rows")  # formats that hold the weight as it is
# the same blocks packed for integer products with activations quantized to int8 (cpu_linear_q8.h)
Q8_ACTIVATIONS = {"q8_0": "q8_0_q8", "q4_0": "q4_0_q8", "q4_1": "q4_1_q8"}
CODES = {**FORMATS, "q8_0_q8": 6, "q4_0_q8": 7, "q4_1_q8": 8}  # what cpu_linear.c calls each packing
ACTIVATIONS = ("q8", "exact")
GROUP, BLOCK = 16, 32
# more rows: the fp32 GEMM over the dequantized weight (AVX2's panel tiles keep up with MKL's fp32 GEMM to 512 rows)
PROMPT_ROWS = {"avx512": 128, "avx2": 512, "portable": 32}
# bf16_rows: more rows than this go to oneDNN's bf16 GEMM. With a bf16 dot product (AMX tiles, or AVX512-BF16's
# vdpbf16ps) the kernel keeps up with oneDNN's to 16-32 rows, and the fused decode layer, which runs only on the
# kernel, gains more than that from 16 to 64 (Zen 4, SmolLM2 decode steps of 16 / 64 rows: 25 / 79 ms fused against
# 35 / 88 ms layer by layer); keyed by whether the CPU has one
BF16_ROWS_DECODE = {False: 8, True: 64}
# integer products (cpu_linear_q8.h): up to this many rows, then the fp32 GEMM over the dequantized weight
Q8_ROWS = 1 << 30
# cpu_linear_avx2.h: from this many rows bf16 and Q8_0 blocks take the block-wise tiles, which sum in another order
TILE8_BLOCK_ROWS = 8
# AMX tiles take bf16 rows against bf16_rows, Q8_0 and 4-bit blocks from this many rows on (AMX_BF16_ROWS, AMX_ROWS)
AMX_ROWS = 4
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Blocks:
    """An [n, k] weight in `fmt`: for quantized formats `q` [n, nb, 32] (int8 for q8_0, 0..15 for q4) and fp16
    scales `d` (and minimums `m` for q4_1) [n, nb]; for f32/bf16 `q` is the [n, k] weight itself."""

    fmt: str
    n: int
    k: int
    q: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes as a GGUF file stores it."""
        if self.fmt in PLAIN:
            return self.q.numel() * self.q.element_size()
        per_block = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[self.fmt]
        return self.n * self.q.shape[1] * per_block


def num_blocks(k: int) -> int:
    return (k + BLOCK - 1) // BLOCK


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """[n, k] fp32 as [n, nb, 32], zero-padded."""
    n, k = w.shape
    nb = num_blocks(k)
    return F.pad(w.float(), (0, nb * BLOCK - k)).view(n, nb, BLOCK)


def quantize(weight: torch.Tensor, fmt: str) -> Blocks:
    """Round-to-nearest quantization of an fp32/bf16 [n, k] weight, as ggml's reference quantizers do."""
    n, k = weight.shape
    if fmt == "f32":
        return Blocks(fmt, n, k, weight.float().contiguous())
    if fmt in ("bf16", "bf16_rows"):
        return Blocks(fmt, n, k, weight.to(torch.bfloat16).contiguous())
    x = _blocked(weight)
    if fmt == "q8_0":
        d = x.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return Blocks(fmt, n, k, q, d.half())
    if fmt == "q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx).squeeze(-1) / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor(x * inv[..., None] + 8.5), 0, 15).to(torch.uint8)
        return Blocks(fmt, n, k, q, d.half())
    if fmt == "q4_1":
        lo, hi = x.amin(-1), x.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor((x - lo[..., None]) * inv[..., None] + 0.5), 0, 15).to(torch.uint8)
        return Blocks(fmt, n, k, q, d.half(), lo.half())
    raise ValueError(f"weight format {fmt!r} is not one of {sorted(FORMATS)}")


def from_gguf(raw: torch.Tensor, fmt: str, n: int, k: int) -> Blocks:
    """A GGUF tensor's bytes (`[n, row bytes]` uint8, or the f32/bf16 values) as Blocks, without converting."""
    if fmt in ("f32", "bf16"):
        return Blocks(fmt, n, k, raw.reshape(n, k).contiguous())
    nb = num_blocks(k)
    per_block = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
    b = raw.reshape(n, nb, per_block)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if fmt == "q8_0":
        return Blocks(fmt, n, k, b[..., 2:].contiguous().view(torch.int8), d)
    start = 4 if fmt == "q4_1" else 2
    qs = b[..., start:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # element j in byte j's low nibble, j + 16 in its high one
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1) if fmt == "q4_1" else None
    return Blocks(fmt, n, k, q.contiguous(), d, m)


def dequantize(b: Blocks) -> torch.Tensor:
    """The fp32 [n, k] weight the blocks stand for."""
    if b.fmt in PLAIN:
        return b.q.float()
    assert b.d is not None
    d = b.d.float()[..., None]
    if b.fmt == "q8_0":
        w = d * b.q.float()
    elif b.fmt == "q4_0":
        w = d * (b.q.float() - 8)
    else:
        assert b.m is not None
        w = d * b.q.float() + b.m.float()[..., None]
    return w.reshape(b.n, -1)[:, : b.k]


def concat(parts: list[Blocks]) -> Blocks:
    """Rows of several weights stacked (fused q/k/v or gate/up): one format, or fp32 where the formats differ."""
    if len({p.fmt for p in parts}) > 1 or len({p.k for p in parts}) > 1:
        return Blocks("f32", sum(p.n for p in parts), parts[0].k, torch.cat([dequantize(p) for p in parts]))
    first = parts[0]

    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat([t for t in ts if t is not None])

    return Blocks(
        first.fmt,
        sum(p.n for p in parts),
        first.k,
        torch.cat([p.q for p in parts]),
        cat([p.d for p in parts]),
        cat([p.m for p in parts]),
    )


def pack(b: Blocks, q4_chunks: bool) -> torch.Tensor:
    """The kernel's layout (see `cpu_linear.c`): uint8, groups of 16 rows, each a run of its blocks; 4-bit quants
    in chunks (`q4_chunks`: what AVX-512 builds read) or bytes (`CpuLinear.q4_chunks` says which)."""
    n, nb = b.n, num_blocks(b.k)
    groups = (n + GROUP - 1) // GROUP
    pad = groups * GROUP - n

    def by_group(t: torch.Tensor) -> torch.Tensor:
        """[n, nb, ...] -> [groups, nb, 16, ...]"""
        t = F.pad(t, (0,) * (2 * (t.dim() - 1)) + (0, pad)) if pad else t
        return t.reshape(groups, GROUP, *t.shape[1:]).transpose(1, 2)

    if b.fmt == "bf16_rows":  # as torch holds it: [n, k] bf16
        return b.q.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)
    if b.fmt in ("f32", "bf16"):
        w = b.q.float() if b.fmt == "f32" else b.q.to(torch.bfloat16)
        w = F.pad(w, (0, nb * BLOCK - b.k)).reshape(n, nb, BLOCK)
        vals = by_group(w).transpose(2, 3).contiguous()  # [groups, nb, 32 (k), 16 (columns)]
        return vals.view(torch.uint8).reshape(-1)
    assert b.d is not None
    q = by_group(b.q).transpose(2, 3)  # [groups, nb, 32 (k), 16 (columns)]
    scales = [by_group(b.d).contiguous().view(torch.uint8)]
    if b.fmt == "q4_1":
        assert b.m is not None
        scales.append(by_group(b.m).contiguous().view(torch.uint8))
    if b.fmt == "q8_0":
        body = q.contiguous().view(torch.uint8)
    elif q4_chunks:  # chunks of 8 k: word [chunk][c][s] holds k = 8 chunk + 2i + s in nibble i
        n4 = q.reshape(groups, nb, 4, 4, 2, GROUP).permute(0, 1, 2, 5, 4, 3)  # [.., chunk, c, s, i]
        body = torch.stack([n4[..., 0] | (n4[..., 1] << 4), n4[..., 2] | (n4[..., 3] << 4)], dim=-1).contiguous()
    else:  # bytes: [p][c] holds k = 2p low, 2p + 1 high
        body = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).contiguous()
    parts = [s.reshape(groups, nb, -1) for s in scales] + [body.reshape(groups, nb, -1)]
    return torch.cat(parts, dim=-1).reshape(-1).contiguous()


def pack_q8(b: Blocks) -> torch.Tensor:
    """The layout of cpu_linear_q8.h for Q8_0 and 4-bit blocks: per (group, block) the scales as `pack` writes
    them, then runs of [16 columns][4 k]: Q8_0's quants + 128, or 4-bit quants with k = 8p + i in run p's low
    nibbles and k = 8p + 4 + i in its high ones."""
    if b.fmt not in Q8_ACTIVATIONS:
        raise ValueError(f"weight format {b.fmt!r} has no integer packing (only {', '.join(Q8_ACTIVATIONS)})")
    assert b.d is not None
    n, nb = b.n, num_blocks(b.k)
    groups = (n + GROUP - 1) // GROUP
    pad = groups * GROUP - n

    def by_group(t: torch.Tensor) -> torch.Tensor:
        """[n, nb, ...] -> [groups, nb, 16, ...]"""
        t = F.pad(t, (0,) * (2 * (t.dim() - 1)) + (0, pad)) if pad else t
        return t.reshape(groups, GROUP, *t.shape[1:]).transpose(1, 2)

    q = by_group(b.q)  # [groups, nb, 16 (columns), 32 (k)]
    if b.fmt == "q8_0":
        codes = (q.to(torch.int16) + 128).to(torch.uint8).reshape(groups, nb, GROUP, 8, 4)
        body = codes.permute(0, 1, 3, 2, 4)  # [groups, nb, run, column, 4]
    else:
        halves = q.reshape(groups, nb, GROUP, 4, 2, 4)  # [.., column, run, low/high, 4]
        body = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 1, 3, 2, 4)
    scales = [by_group(b.d).contiguous().view(torch.uint8)]
    if b.fmt == "q4_1":
        assert b.m is not None
        scales.append(by_group(b.m).contiguous().view(torch.uint8))
    parts = [t.reshape(groups, nb, -1) for t in (*scales, body.contiguous())]
    return torch.cat(parts, dim=-1).reshape(-1).contiguous()


class CpuLinear:
    """The built `cpu_linear.c`: products and dequantization over packed weights."""

    def __init__(self, lib: ctypes.CDLL, level: str) -> None:
        self._linear = lib.linear
        self._linear.argtypes = [_P, _I64, _I, _I64, _I64, _P, _I, _I64, _P, _P, _I64, _I, _I]
        self._linear.restype = _I
        self._dequant = lib.dequantize
        self._dequant.argtypes, self._dequant.restype = [_P, _I, _I64, _I64, _P, _I], _I
        self._quantize_q8 = lib.quantize_q8
        self._quantize_q8.argtypes, self._quantize_q8.restype = [_P, _I64, _I, _I64, _I64, _P, _P, _P, _I], _I
        self._block_dots_q8 = lib.block_dots_q8
        self._block_dots_q8.argtypes, self._block_dots_q8.restype = [_P, _I, _I64, _I64, _P, _I64, _P], _I
        self._scratch = torch.empty(0)
        self.level = level
        self.prompt_rows = PROMPT_ROWS[level]  # where this level's kernel stops beating dequantize + torch's GEMM
        features = lib.features()
        self.bf16_dot = bool(features & 1)  # vdpbf16ps: bf16 rows against Q8_0 / 4-bit blocks, 2x fp32's rate
        self.q4_chunks = bool(features & 2)  # the 4-bit quants' layout this build reads (`pack`)
        self.tiles = bool(features & 4)  # AMX: bf16 rows against blocks and bf16_rows from a few rows on
        self.bf16_rows_decode = BF16_ROWS_DECODE[self.tiles or self.bf16_dot]
        self.isa = f"{level}, AMX tiles" if self.tiles else level  # for the start-up log
        self.q8_rows = Q8_ROWS  # integer products with int8 activations up to this many rows
        self.q8_isa = ("plain C", "AVX2 vpmaddubsw", "AVX512-VNNI vpdpbusd", "AVX512-VNNI vpdpbusd, AMX-INT8 tiles")[
            lib.q8_isa()
        ]

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, fmt: str, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [m, k] fp32 or bf16, rows contiguous -> [m, n] in x's dtype; bias fp32."""
        m, k = x.shape
        out = torch.empty(m, n, dtype=x.dtype)
        bf16 = x.dtype == torch.bfloat16
        rc = self._linear(
            x.data_ptr(),
            x.stride(0),
            bf16,
            m,
            k,
            packed.data_ptr(),
            CODES[fmt],
            n,
            bias.data_ptr() if bias is not None else None,
            out.data_ptr(),
            n,
            bf16,
            torch.get_num_threads(),
        )
        if rc:
            raise RuntimeError(f"cpu linear failed (code {rc}) on x {tuple(x.shape)}, weight {fmt} [{n}, {k}]")
        return out

    def dequantize(self, packed: torch.Tensor, fmt: str, n: int, k: int, into_scratch: bool = False) -> torch.Tensor:
        """The fp32 weight, transposed: [k, n] contiguous (`.t()` is the [n, k] weight); into a buffer that the
        next call reuses when `into_scratch`."""
        if into_scratch:
            if self._scratch.numel() < n * k:
                self._scratch = torch.empty(n * k)
            out = self._scratch[: n * k].view(k, n)
        else:
            out = torch.empty(k, n)
        if self._dequant(packed.data_ptr(), CODES[fmt], n, k, out.data_ptr(), torch.get_num_threads()):
            raise RuntimeError(f"cpu dequantize failed on weight {fmt} [{n}, {k}]")
        return out

    def quantize_q8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of x [m, k] (fp32 or bf16) as the Q8 blocks the integer products read: quants [m, nb * 32] int8,
        scales [m, nb] fp32, sums of quants [m, nb] int32."""
        m, k = x.shape
        nb = num_blocks(k)
        x = x if x.dtype in _KERNEL_DTYPES and x.stride(-1) == 1 else x.float().contiguous()
        xq = torch.empty(m, nb * BLOCK, dtype=torch.int8)
        xd, xs = torch.empty(m, nb), torch.empty(m, nb, dtype=torch.int32)
        rc = self._quantize_q8(
            x.data_ptr(),
            x.stride(0),
            x.dtype == torch.bfloat16,
            m,
            k,
            xq.data_ptr(),
            xd.data_ptr(),
            xs.data_ptr(),
            torch.get_num_threads(),
        )
        if rc:
            raise RuntimeError(f"cpu quantize_q8 failed on x {tuple(x.shape)}")
        return xq, xd, xs

    def block_dots_q8(self, packed: torch.Tensor, fmt: str, n: int, k: int, xq: torch.Tensor) -> torch.Tensor:
        """[m, n, nb] int32: each block's integer sum of quant products, as the products compute it (`fmt` a Q8
        packing, `xq` from `quantize_q8`)."""
        m = xq.shape[0]
        out = torch.empty(m, n, num_blocks(k), dtype=torch.int32)
        if self._block_dots_q8(packed.data_ptr(), CODES[fmt], n, k, xq.data_ptr(), m, out.data_ptr()):
            raise RuntimeError(f"cpu block_dots_q8 failed on weight {fmt} [{n}, {k}]")
        return out


def load(cache_dir: Path) -> CpuLinear | None:
    """The kernels, built into `cache_dir` on first use (`kernels.c_build`); None where they cannot be built."""
    lib = c_build.build(SOURCE, cache_dir)
    return CpuLinear(lib, cpu_isa.level()) if lib is not None else None


class QuantLinear(nn.Module):
    """A linear layer over packed weights: the C kernel for decode shapes, the fp32 GEMM over the dequantized
    weight for prompt shapes. Activations come and go in the model's dtype."""

    packed: torch.Tensor  # a buffer: the weight in the kernel's layout

    def __init__(
        self,
        blocks: Blocks,
        bias: torch.Tensor | None,
        kernels: CpuLinear,
        prompt: nn.Module | None = None,
        activations: str = "exact",
    ) -> None:
        """`prompt`: what rows above `decode_rows` run through instead (bf16_rows: oneDNN's packed GEMM);
        `activations`: "q8" multiplies Q8_0 and 4-bit blocks by activations quantized to int8 (cpu_linear_q8.h),
        "exact" by the activations as they are."""
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations {activations!r} is not one of {', '.join(ACTIVATIONS)}")
        self.prompt = prompt
        self.fmt, self.in_features, self.out_features = blocks.fmt, blocks.k, blocks.n
        q8 = activations == "q8" and blocks.fmt in Q8_ACTIVATIONS
        self.packing = Q8_ACTIVATIONS[blocks.fmt] if q8 else blocks.fmt  # what cpu_linear.c reads
        self.register_buffer("packed", pack_q8(blocks) if q8 else pack(blocks, kernels.q4_chunks), persistent=False)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.kernels = kernels
        self.nbytes = int(self.packed.numel())
        # the rows that run on cpu_linear.c
        self.decode_rows = kernels.bf16_rows_decode if self.fmt == "bf16_rows" else kernels.prompt_rows
        # bf16 rows against Q8_0 or 4-bit blocks with vdpbf16ps beat dequantizing for the fp32 GEMM at any length
        # (Q8_0 at 128 / 512 rows: 2-3x faster)
        self.bf16_rows = 1 << 30 if kernels.bf16_dot and self.fmt in ("q8_0", "q4_0", "q4_1") else self.decode_rows
        if q8:
            self.decode_rows = self.bf16_rows = kernels.q8_rows
        self.invariant_rows = self._invariant_rows()
        self.invariant_spans = self._invariant_spans()

    def _invariant_spans(self) -> tuple[tuple[int, int], ...]:
        """Row counts (first, last) within which each row's output is the same whatever the step's number of rows:
        the first span is (1, invariant_rows), rows as they are alone. On AMX, bf16 rows against bf16_rows take
        the tile unit from AMX_ROWS rows to bf16_rows, where every row's sums run in the tile's one order: a second
        span, so a step of 8 rows may check guesses up to 64 rows and give each row what the 8-row step gives it.
        (Taking the tiles from one row would make it one span, at +24% for a one-row step: Sapphire Rapids, the
        built-in model, 12.3 -> 15.2 ms.)"""
        spans: tuple[tuple[int, int], ...] = ((1, self.invariant_rows),)
        if self.kernels.tiles and self.fmt == "bf16_rows" and self.invariant_rows == AMX_ROWS - 1:
            spans += ((AMX_ROWS, self.bf16_rows),)
        return spans

    def _invariant_rows(self) -> int:
        """Rows up to which each row's output, bf16 activations in, is the one it gets alone (its sums run in one
        order whatever rows share the step; tests/test_quant_linear.py checks it at every ISA level): what a step
        that checks speculative guesses may hold and keep its tokens those of one-row steps. 1 where the kernel
        switches tiles by the row count. The integer products (int8 activations) sum exactly on either unit."""
        kernels = self.kernels
        if self.packing in Q8_ACTIVATIONS.values():  # integer block sums, then one fp32 sum per block and row
            return self.bf16_rows  # (the tile unit's sums are vpdpbusd's: cpu_linear_q8.h)
        if kernels.tiles:
            return AMX_ROWS - 1
        if self.fmt == "bf16_rows":  # tile_rows_dp2 / tile_rows_f32, then oneDNN
            return self.bf16_rows
        if kernels.level == "avx2" and self.fmt in ("bf16", "f32"):  # group8_fmt's tiles, then the block-wise ones
            return min(self.bf16_rows, TILE8_BLOCK_ROWS - 1 if self.fmt == "bf16" else self.bf16_rows)
        return 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        on_kernel = rows <= (self.bf16_rows if x.dtype == torch.bfloat16 else self.decode_rows)
        if not on_kernel and self.prompt is not None:
            return self.prompt(x)
        if not on_kernel and self.fmt == "bf16_rows":
            w = self.packed.view(torch.bfloat16).view(self.out_features, self.in_features).to(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            out = F.linear(flat, w, bias)
        elif not on_kernel and rows > self.kernels.prompt_rows:
            wt = self.kernels.dequantize(self.packed, self.packing, self.out_features, self.in_features, True)
            xf = flat.float()
            out = (torch.addmm(self.bias, xf, wt) if self.bias is not None else torch.mm(xf, wt)).to(x.dtype)
        else:
            if flat.stride(-1) != 1 or x.dtype not in _KERNEL_DTYPES:
                flat = flat.float().contiguous()
            out = self.kernels.linear(flat, self.packed, self.packing, self.out_features, self.bias).to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.packing}"
