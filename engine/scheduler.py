"""Continuous batching: which sequences run in the next forward, and how many tokens each contributes.

Every step, running sequences go first (one token each while decoding, the next chunk while a long prompt is
being prefilled), then waiting sequences are admitted in arrival order while the token budget, the sequence
limit and the block pool allow. One rule covers prefill, chunked prefill, decode and recompute after
preemption: a sequence computes the tokens it has not computed yet, and samples when it reaches its last one.
When the pool runs dry, the most recently admitted sequence is preempted: its blocks are freed and it rejoins
the front of the queue to be recomputed later.

A sequence whose KV another process computes (a decode worker's remote prefill) is *reserved* instead: it takes
blocks for its tokens at once, or queues for them in arrival order (RESERVING), then waits for its KV (AWAITING_KV)
and joins the running batch when it has landed. A reservation is granted only while the running batch keeps a
block of headroom per sequence: blocks held for prompts still queued at a prefill worker must not starve the
sequences that are generating (they would be preempted and recomputed, over and over).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_allocator import BlockAllocator, NoFreeBlocks
from pdserve.engine.errors import PoolExhausted
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)  # does sequence i reach its last token (and sample)?
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        """`n` counts the sequence's guesses too (`Sequence.draft`): they follow its last token in the step."""
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.sampling.append(seq.num_computed_tokens + n == len(seq.token_ids) + len(seq.draft))

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last known token this step (and so samples the next one)."""
        return self.sampling[i]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: int = 0,
        max_reserving: int = 256,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark = watermark  # blocks a reservation always leaves free
        self.max_reserving = max_reserving
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserving: deque[Sequence] = deque()
        self.awaiting_kv: dict[Sequence, None] = {}

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose blocks and KV were prepared elsewhere (a decode worker's prefilled request)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- sequences whose KV comes from elsewhere -------------------------------------------------------------

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for every token of `seq`, for another process to fill: True when reserved now (AWAITING_KV),
        False when queued (RESERVING) until `grant` hands them out. PoolExhausted when that queue is full."""
        if not self.reserving and self._can_grant(seq):
            self._take_reservation(seq)
            return True
        if len(self.reserving) >= self.max_reserving:
            raise PoolExhausted(
                f"KV pool full ({self.allocator.num_free_blocks} blocks free) and "
                f"{len(self.reserving)} requests already waiting"
            )
        seq.status = SequenceStatus.RESERVING
        self.reserving.append(seq)
        return False

    def grant(self) -> list[Sequence]:
        """Reserve blocks for queued reservations, in arrival order, while the headroom allows; returns them."""
        granted = []
        while self.reserving and self._can_grant(self.reserving[0]):
            seq = self.reserving.popleft()
            self._take_reservation(seq)
            granted.append(seq)
        return granted

    def land(self, seq: Sequence) -> None:
        """Its KV has landed (every token but the last): the sequence joins the running batch, and its full blocks
        join the prefix cache, so that the next request for the same prompt (another choice of it) is sent only the
        blocks after them."""
        del self.awaiting_kv[seq]
        seq.num_computed_tokens = len(seq.token_ids) - 1
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.allocator.cache_blocks(seq.block_ids, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)

    def _can_grant(self, seq: Sequence) -> bool:
        need = self.allocator.blocks_needed(len(seq.token_ids))
        return self.allocator.num_free_blocks - need >= self.watermark + len(self.running)

    def _take_reservation(self, seq: Sequence) -> None:
        """Blocks for every token of seq, the prompt's leading blocks from the prefix cache where it holds them:
        seq.num_computed_tokens says how many tokens' KV its blocks hold already (the rest is to be sent)."""
        alloc = self.allocator.allocate_prefix(seq.token_ids, len(seq.token_ids))
        seq.block_ids, seq.block_hashes = alloc.block_ids, alloc.block_hashes
        seq.num_computed_tokens = alloc.num_cached_tokens
        seq.status = SequenceStatus.AWAITING_KV
        self.awaiting_kv[seq] = None

    # ---- the step ----------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.draft:
                n += self._fit_draft(seq, n, budget)
            if not self._reserve(seq, seq.num_computed_tokens + n, batch):
                continue  # seq itself was preempted; self.running shrank
            batch.add(seq, n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            try:
                alloc = self.allocator.allocate_prefix(seq.token_ids, len(seq.token_ids))
            except NoFreeBlocks:
                break
            self.waiting.popleft()
            seq.block_ids, seq.block_hashes = alloc.block_ids, alloc.block_hashes
            seq.num_computed_tokens = alloc.num_cached_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = alloc.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            batch.add(seq, n)
            budget -= n
        return batch

    def _fit_draft(self, seq: Sequence, n: int, budget: int) -> int:
        """Trim seq's guesses to what the step's token budget and the free blocks hold (guesses never preempt
        anyone); how many remain. Only a sequence about to sample its next token checks guesses."""
        draft = seq.draft
        if len(seq.token_ids) - seq.num_computed_tokens != 1:
            del draft[:]
            return 0
        slots = (len(seq.block_ids) + self.allocator.num_free_blocks) * self.allocator.block_size
        keep = max(0, min(len(draft), budget - n, slots - seq.num_computed_tokens - n))
        del draft[keep:]
        return keep

    def _reserve(self, seq: Sequence, num_slots: int, batch: ScheduledBatch) -> bool:
        """Grow seq's blocks to hold num_slots tokens, preempting the newest others if needed."""
        need = self.allocator.blocks_needed(num_slots) - len(seq.block_ids)
        while need > self.allocator.num_free_blocks:
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids.extend(self.allocator.allocate(need))
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        del seq.draft[:]
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, free: bool = True) -> None:
        """Retire a sequence (done, or aborted); safe to call in any state. With `free=False` its blocks stay
        allocated for the caller, who hands them back with `release`."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.RESERVING:
            self.reserving.remove(seq)
        elif seq.status is SequenceStatus.AWAITING_KV:
            del self.awaiting_kv[seq]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free:
            self.release(seq)
        seq.finish_reason = seq.finish_reason or reason
        seq.status = SequenceStatus.FINISHED

    def release(self, seq: Sequence) -> None:
        """Hand a sequence's blocks back to the allocator."""
        self.allocator.free(seq.block_ids)
        seq.block_ids, seq.block_hashes = [], []

    def commit(self, batch: ScheduledBatch) -> None:
        """Advance computed counts after the forward and offer newly full blocks to the prefix cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.allocator.cache_blocks(seq.block_ids, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
