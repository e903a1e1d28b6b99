"""The attention backend interface and the metadata every backend reads.

One forward serves a flattened mixed batch: prompts (or prompt chunks) of different lengths and single decode
tokens side by side, each described by where its queries start, how long its context is, and its block table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.cache_ops import store_kv
from kernels.paged_attention import paged_attention

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    query_start_loc: list[int]  # [B+1] offsets of each sequence's queries in the flat batch
    seq_lens: list[int]  # [B] context length of each sequence, new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] physical block ids, zero-padded


class AttentionBackend(Protocol):
    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store this step's k/v into `kv_layer`, then attend q `[T, H, D]` over each sequence's context."""
        ...


class TorchAttention:
    """The reference backend: plain torch, runs anywhere."""

    name = "torch"

    def __call__(self, q, k, v, kv_layer, meta, scale):
        store_kv(k, v, kv_layer, meta.slot_mapping)
        return paged_attention(q, kv_layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)


def select_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    """Pick the attention backend; 'auto' takes the best one this device supports."""
    if name not in ("auto", "torch"):
        raise ValueError(f"attention backend {name!r} is not available (have: auto, torch)")
    backend = TorchAttention()
    log.info("attention backend: %s", backend.name)
    return backend
