"""Writing into the paged KV cache.

A layer's cache is `[2, num_blocks, block_size, kv_heads, head_dim]`: index 0 holds K, 1 holds V, and token slot
`s` lives at block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

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
