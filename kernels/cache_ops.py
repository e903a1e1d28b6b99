"""Writing into the paged KV cache.

A layer's cache is `[2, num_blocks, block_size, kv_heads, head_dim]`: index 0 holds K, 1 holds V, and token slot
`s` lives at block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v `[T, kv_heads, head_dim]` into the slots named by `slot_mapping` `[T]`."""
    _, _, _, heads, dim = kv_layer.shape
    kv_layer[0].view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(kv_layer.dtype))
    kv_layer[1].view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(kv_layer.dtype))


def pack_blocks(layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`[2, n, block_size, kv_heads, head_dim]`: K and V of the named blocks of one layer, contiguous."""
    return layer.index_select(1, block_ids.long())


def unpack_blocks(buffer: torch.Tensor, layer: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write a packed `[2, n, ...]` buffer into the named blocks of `layer`."""
    layer.index_copy_(1, block_ids.long(), buffer)


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_on(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and _have_triton()


def gather_blocks(layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`pack_blocks`, by the Triton kernel on a GPU (one launch instead of an index_select per layer and kind)."""
    if _triton_on(layer):
        from pdserve.kernels.triton_kv_blocks import pack_blocks as triton_pack

        return triton_pack(layer, block_ids)
    return pack_blocks(layer, block_ids)


def scatter_blocks(buffer: torch.Tensor, layer: torch.Tensor, block_ids: torch.Tensor) -> None:
    """`unpack_blocks`, by the Triton kernel on a GPU."""
    if _triton_on(layer):
        from pdserve.kernels.triton_kv_blocks import unpack_blocks as triton_unpack

        triton_unpack(buffer, layer, block_ids)
    else:
        unpack_blocks(buffer, layer, block_ids)
