"""The paged KV cache's memory layout: the one definition the engine, the kernels and kvtransfer all read.

The cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (so a transport
registers a single region); `cache[layer]` is `[2, num_blocks, ...]`, K then V, the layout every attention
backend reads. Two sizes have names of their own:

- a **page** is one block's K (or V) in one layer: `page_nbytes` bytes, the unit a KV transfer moves;
- a **block** is one block across every layer, K and V: `block_nbytes` bytes, the unit the memory budget buys.

Two caches are compatible when everything but the number of blocks matches: then block i of one can be copied
byte for byte into block j of the other. The fingerprint names exactly those fields.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class LayoutMismatch(ValueError):
    """Two caches differ in a way that would turn copied bytes into garbage."""


@dataclass(frozen=True)
class KVLayout:
    model: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int = 0  # this side's pool size; not part of the fingerprint
    device: str = "cpu"  # memory kind ("cpu" or "cuda"): part of the fingerprint, transports move it differently
    weights: str = "none"  # the weights' format (--quantization): another one computes other KV values

    @classmethod
    def of(cls, cache: torch.Tensor, model: str) -> KVLayout:
        layers, two, blocks, block_size, heads, dim = cache.shape
        if two != 2 or not cache.is_contiguous():
            raise ValueError("KV cache must be a contiguous [layers, 2, blocks, block_size, heads, dim] tensor")
        return cls(
            model, str(cache.dtype).removeprefix("torch."), layers, block_size, heads, dim, blocks, cache.device.type
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at import: the failure table (and so the gateway) names LayoutMismatch

        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def page_nbytes(self) -> int:
        """Bytes of one block's K (or V) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across every layer, K and V."""
        return self.num_layers * 2 * self.page_nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache."""
        return self.num_blocks * self.block_nbytes

    def page_offset(self, layer: int, kv: int, block: int) -> int:
        """Where one page starts, in bytes from the start of the cache (kv: 0 for K, 1 for V)."""
        return ((layer * 2 + kv) * self.num_blocks + block) * self.page_nbytes

    def with_blocks(self, num_blocks: int) -> KVLayout:
        return replace(self, num_blocks=num_blocks)

    def allocate(self, device: str | torch.device | None = None) -> torch.Tensor:
        import torch

        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device or self.device)

    def compatibility_fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "num_blocks"}

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.compatibility_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatch naming every field that differs."""
        mine, theirs = self.compatibility_fields(), other.compatibility_fields()
        diff = [f"{k}: {mine[k]!r} here vs {theirs[k]!r} there" for k in mine if mine[k] != theirs[k]]
        if diff:
            raise LayoutMismatch("KV layout mismatch (" + "; ".join(diff) + ")")


def contiguous_run(ids: list[int]) -> tuple[int, int] | None:
    """(start, end) if ids are start, start+1, ..., end-1: blocks that one slice of the cache holds."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return ids[0], ids[-1] + 1
    return None


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) pieces for copying block src[i] to dst[i]: each piece is one contiguous run on
    both sides, so a layer's K (or V) moves in as few operations as the two block lists allow."""
    if len(src) != len(dst):
        raise ValueError("source and destination need as many blocks")
    runs: list[tuple[int, int, int]] = []
    for i, (s, d) in enumerate(zip(src, dst)):
        if i and s == src[i - 1] + 1 and d == dst[i - 1] + 1:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((s, d, 1))
    return runs
