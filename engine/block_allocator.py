"""The pool of KV-cache blocks: ownership by reference count, and automatic prefix caching.

A full block whose tokens have been computed can be registered under the hash of (parent block's hash, its
tokens), so the hash names the whole prefix up to that block. A later sequence with the same prefix takes the
same physical blocks (ref count + 1) instead of recomputing them. Blocks nobody references go to one of two
queues: plain free blocks, handed out first, and cached blocks, kept for reuse and evicted least recently used
first when the plain ones run out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.kernels.block_hash import hash_block, prefix_hashes

CacheListener = Callable[[list[int], list[int]], None]


class NoFreeBlocks(RuntimeError):
    """Not enough free or evictable blocks for the request; nothing was allocated."""


class BlockOwnershipError(RuntimeError):
    """A block was freed or used while nobody owned it: a bug in the caller, never ignored."""


@dataclass
class PrefixAllocation:
    block_ids: list[int]
    num_cached_tokens: int
    block_hashes: list[int] = field(default_factory=list)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self._listeners: list[CacheListener] = []  # told (stored hashes, removed hashes) as the cache changes

    def subscribe(self, listener: CacheListener) -> Callable[[], None]:
        """Have `listener` told what the prefix cache stores and evicts; returns the call that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _changed(self, stored: list[int], removed: list[int]) -> None:
        for listener in self._listeners:
            listener(stored, removed)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: plain free plus evictable cached."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no sequence holds: free for allocation, kept for prefix hits until then."""
        return len(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref count 1), evicting cached ones when the plain free list runs dry."""
        if n > self.num_free_blocks:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                block, _ = self._free.popitem(last=False)
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner of each block; the last owner's release returns it to a queue.

        Blocks are released tail first so that, among a sequence's cached blocks, the deepest prefix is evicted
        before the shared head.
        """
        ids = list(block_ids)
        for b in ids:
            if self.ref_counts[b] <= 0:
                raise BlockOwnershipError(f"block {b} freed twice (not allocated)")
        for b in reversed(ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free[b] = None

    def allocate_prefix(self, tokens: Sequence[int], num_slots: int) -> PrefixAllocation:
        """Blocks for a sequence of `num_slots` tokens whose first tokens are `tokens`, reusing cached prefix blocks.

        At least one token is always left to compute, so the caller gets logits for the last prompt token.
        Atomic: either every block is taken or `NoFreeBlocks` is raised and nothing changed.
        """
        hits: list[int] = []
        hashes: list[int] = []
        if self.enable_prefix_caching:
            self.prefix_queries += 1
            usable = max(len(tokens) - 1, 0)
            for h in prefix_hashes(tokens[:usable], self.block_size):
                block = self._cached.get(h)
                if block is None:
                    break
                hits.append(block)
                hashes.append(h)
        need = self.blocks_needed(num_slots) - len(hits)
        reusable_idle = sum(1 for b in hits if self.ref_counts[b] == 0)
        if need > self.num_free_blocks - reusable_idle:
            raise NoFreeBlocks(f"need {need} blocks, {self.num_free_blocks - reusable_idle} free")
        for b in hits:
            if self.ref_counts[b] == 0:
                self._evictable.pop(b)
            self.ref_counts[b] += 1
        self.prefix_hit_tokens += len(hits) * self.block_size
        return PrefixAllocation(hits + self.allocate(need), len(hits) * self.block_size, hashes)

    def cache_blocks(
        self, block_ids: Sequence[int], block_hashes: list[int], tokens: Sequence[int], num_computed: int
    ) -> None:
        """Register every full, computed block of a sequence not yet registered; extends `block_hashes` in place."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        stored = []
        for i in range(len(block_hashes), num_computed // bs):
            parent = block_hashes[-1] if block_hashes else None
            h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            block_hashes.append(h)
            block = block_ids[i]
            if self.ref_counts[block] <= 0:
                raise BlockOwnershipError(f"block {block} cached while not allocated")
            if self.block_hash[block] is None and h not in self._cached:
                self.block_hash[block] = h
                self._cached[h] = block
                stored.append(h)
        if stored:
            self._changed(stored, [])

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self._cached[h]
            self.block_hash[block] = None
            self._changed([], [h])

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now."""
        return list(self._cached)

    def check_invariants(self) -> None:
        """Every block is in exactly one place: owned, plain free, or evictable cached."""
        free, evict = set(self._free), set(self._evictable)
        assert not free & evict
        for b in range(self.num_blocks):
            owned = self.ref_counts[b] > 0
            assert self.ref_counts[b] >= 0
            assert owned + (b in free) + (b in evict) == 1, f"block {b}"
            if b in evict:
                assert self.block_hash[b] is not None
        for h, b in self._cached.items():
            assert self.block_hash[b] == h
