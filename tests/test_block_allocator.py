"""The block pool: ownership never lost or doubled, prefix hits land on the same physical blocks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.block_allocator import BlockAllocator, BlockOwnershipError, NoFreeBlocks
from pdserve.kernels.block_hash import prefix_hashes

BS = 4


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc / prefix-share / free / evict against a model of who owns what."""

    def __init__(self) -> None:
        super().__init__()
        self.published: set[int] = set()  # what a listener to the cache's events believes it holds
        self.alloc = BlockAllocator(num_blocks=24, block_size=BS)
        self.alloc.subscribe(self._changed)
        self.owners: list[tuple[list[int], list[int]]] = []  # (block ids, tokens) per live sequence

    def _changed(self, stored: list[int], removed: list[int]) -> None:
        assert not set(stored) & self.published and set(removed) <= self.published
        self.published |= set(stored)
        self.published -= set(removed)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40))
    def allocate_sequence(self, tokens):
        try:
            got = self.alloc.allocate_prefix(tokens, len(tokens))
        except NoFreeBlocks:
            return
        for i, h in enumerate(got.block_hashes):
            assert self.alloc._cached[h] == got.block_ids[i]
        hashes = list(got.block_hashes)
        self.alloc.cache_blocks(got.block_ids, hashes, tokens, len(tokens))
        assert len(hashes) == len(tokens) // BS
        self.owners.append((got.block_ids, tokens))

    @rule(n=st.integers(1, 6))
    def allocate_plain(self, n):
        try:
            self.owners.append((self.alloc.allocate(n), []))
        except NoFreeBlocks:
            assert n > self.alloc.num_free_blocks

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        blocks, _ = self.owners.pop(i % len(self.owners))
        self.alloc.free(blocks)

    @invariant()
    def ownership_matches(self):
        self.alloc.check_invariants()
        expected = [0] * self.alloc.num_blocks
        for blocks, _ in self.owners:
            for b in blocks:
                expected[b] += 1
        assert expected == self.alloc.ref_counts
        assert self.alloc.num_used_blocks == sum(1 for c in expected if c)
        assert self.published == set(self.alloc.cached_hashes())

    def teardown(self):
        for blocks, _ in self.owners:
            self.alloc.free(blocks)
        self.alloc.check_invariants()
        assert self.alloc.num_used_blocks == 0


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_reuses_physical_blocks():
    a = BlockAllocator(16, BS)
    tokens = list(range(10))
    first = a.allocate_prefix(tokens, 10)
    a.cache_blocks(first.block_ids, first.block_hashes, tokens, 10)
    second = a.allocate_prefix(tokens + [99], 11)
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert a.ref_counts[first.block_ids[0]] == 2


def test_cached_blocks_survive_free_until_evicted():
    a = BlockAllocator(4, BS)
    tokens = list(range(9))
    got = a.allocate_prefix(tokens, 9)
    a.cache_blocks(got.block_ids, got.block_hashes, tokens, 9)
    a.free(got.block_ids)
    assert a.num_free_blocks == 4 and a.num_cached_blocks == 2
    again = a.allocate_prefix(tokens, 9)
    assert again.num_cached_tokens == 8 and again.block_ids[:2] == got.block_ids[:2]
    a.free(again.block_ids)
    a.allocate(4)  # takes the plain block first, then evicts the cached ones
    assert a.num_cached_blocks == 0


def test_last_token_is_never_served_from_cache():
    a = BlockAllocator(8, BS)
    tokens = list(range(8))
    got = a.allocate_prefix(tokens, 8)
    a.cache_blocks(got.block_ids, got.block_hashes, tokens, 8)
    assert a.allocate_prefix(tokens, 8).num_cached_tokens == 4


def test_allocation_is_atomic():
    a = BlockAllocator(3, BS)
    with pytest.raises(NoFreeBlocks):
        a.allocate_prefix(list(range(20)), 20)
    assert a.num_free_blocks == 3


def test_double_free_and_use_after_free_are_errors():
    a = BlockAllocator(4, BS)
    blocks = a.allocate(2)
    a.free(blocks)
    with pytest.raises(BlockOwnershipError):
        a.free(blocks)
    with pytest.raises(BlockOwnershipError):
        a.cache_blocks(blocks, [], list(range(8)), 8)


def test_hash_chain_depends_on_whole_prefix():
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1]
    assert prefix_hashes([1, 2, 3], 4) == []
