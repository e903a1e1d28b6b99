"""KV block pack/unpack in Triton: what the KV transfer does on GPU.

`pack_blocks` gathers one layer's scattered blocks (K and V) into a contiguous send buffer; `unpack_blocks`
scatters a received buffer into the destination blocks. Each program copies one chunk of one block of K or V.
Reference: `kernels.cache_ops.pack_blocks` / `unpack_blocks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(
    src,
    dst,
    block_ids,
    block_elems,
    src_kv_stride,
    src_block_stride,
    dst_kv_stride,
    dst_block_stride,
    SCATTER: tl.constexpr,
    CHUNK: tl.constexpr,
):
    kv = tl.program_id(0)
    i = tl.program_id(1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    block = tl.load(block_ids + i).to(tl.int64)
    if SCATTER:  # buffer row i -> cache block `block`
        values = tl.load(src + kv * src_kv_stride + i * src_block_stride + offs, mask=mask)
        tl.store(dst + kv * dst_kv_stride + block * dst_block_stride + offs, values, mask=mask)
    else:  # cache block `block` -> buffer row i
        values = tl.load(src + kv * src_kv_stride + block * src_block_stride + offs, mask=mask)
        tl.store(dst + kv * dst_kv_stride + i * dst_block_stride + offs, values, mask=mask)


def _check(layer: torch.Tensor, block_ids: torch.Tensor) -> int:
    if layer.dim() != 5 or layer.shape[0] != 2 or not layer[0, 0].is_contiguous():
        raise ValueError("a layer's cache is [2, num_blocks, block_size, kv_heads, head_dim] with contiguous blocks")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("block ids must be an integer tensor")
    return layer[0, 0].numel()


def pack_blocks(layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`[2, n, block_size, kv_heads, head_dim]`: K and V of the named blocks, contiguous, in the given order."""
    elems = _check(layer, block_ids)
    n = block_ids.numel()
    if out is None:
        out = torch.empty((2, n, *layer.shape[2:]), dtype=layer.dtype, device=layer.device)
    if n:
        _copy_blocks_kernel[(2, n, triton.cdiv(elems, CHUNK))](
            layer,
            out,
            block_ids,
            elems,
            layer.stride(0),
            layer.stride(1),
            out.stride(0),
            out.stride(1),
            SCATTER=False,
            CHUNK=CHUNK,
        )
    return out


def unpack_blocks(buffer: torch.Tensor, layer: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write `buffer` `[2, n, ...]` into the named blocks of `layer`."""
    elems = _check(layer, block_ids)
    n = block_ids.numel()
    if buffer.shape != (2, n, *layer.shape[2:]) or not buffer[0, 0].is_contiguous():
        raise ValueError(f"buffer {tuple(buffer.shape)} does not hold {n} blocks of {tuple(layer.shape[2:])}")
    if n:
        _copy_blocks_kernel[(2, n, triton.cdiv(elems, CHUNK))](
            buffer,
            layer,
            block_ids,
            elems,
            buffer.stride(0),
            buffer.stride(1),
            layer.stride(0),
            layer.stride(1),
            SCATTER=True,
            CHUNK=CHUNK,
        )
