"""The KV cache layout and its memory: one tensor for all layers, so transports register a single region.

`cache[layer]` is `[2, num_blocks, block_size, kv_heads, head_dim]` (K then V) — the layout the attention
backends and kvtransfer both read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """All layers, K and V, of one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int,
                  num_blocks: int | None = None) -> "KVCacheSpec":
        """Size the pool from a memory budget unless `num_blocks` is given."""
        spec = cls(cfg.num_layers, 1, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        n = num_blocks if num_blocks is not None else memory_bytes // spec.bytes_per_block
        if n < 1:
            raise ValueError(f"KV cache budget {memory_bytes} B holds no block of {spec.bytes_per_block} B")
        return cls(cfg.num_layers, int(n), block_size, cfg.num_kv_heads, cfg.head_dim, dtype)

    def allocate(self, device: str | torch.device = "cpu") -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=device)
