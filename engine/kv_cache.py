"""Sizing a worker's paged KV cache: how many blocks its memory budget buys (the layout is `kernels.kv_layout`)."""

from __future__ import annotations

import torch

from pdserve.engine.config import ModelConfig
from pdserve.kernels.kv_layout import KVLayout


def plan_kv_cache(
    cfg: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    memory_bytes: int,
    num_blocks: int | None = None,
    device: str = "cpu",
    weights: str = "none",
) -> KVLayout:
    """The cache layout for this model, with as many blocks as `memory_bytes` holds unless `num_blocks` is given."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    layout = KVLayout(
        cfg.name,
        str(dtype).removeprefix("torch."),
        cfg.num_layers,
        block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        0,
        device,
        weights,
    )
    n = num_blocks if num_blocks is not None else memory_bytes // layout.block_nbytes
    if n < 1:
        raise ValueError(
            f"kv_cache_memory {memory_bytes} B holds no KV block ({layout.block_nbytes} B each, {block_size} tokens)"
        )
    return layout.with_blocks(int(n))
