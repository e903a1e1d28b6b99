"""The engine owns admission of sequences whose KV comes from elsewhere: reservations, their FIFO and headroom,
landing, and releasing them in every state (what a decode worker does through the facade, without a network)."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, EngineCore, PoolExhausted, SamplingParams, Sequence
from pdserve.engine.sequence import SequenceStatus

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def core(tiny_model_dir) -> EngineCore:
    # 100 blocks of 16 tokens; the watermark of a core that receives KV is one block
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_blocks=100, block_size=16)
    return EngineCore(cfg, receives_kv=True, max_reserving=2)


def seq(n: int, name: str = "r") -> Sequence:
    return Sequence(name, list(range(3, 3 + n)), GREEDY)


def test_reservations_queue_in_arrival_order_and_keep_headroom(core: EngineCore) -> None:
    big = seq(16 * 90)
    assert core.reserve(big) and big.status is SequenceStatus.AWAITING_KV and len(big.block_ids) == 90
    # 10 blocks are free; one is the watermark: a 9-block prompt fits, a 10-block one waits
    waits, fits_later = seq(16 * 10, "waits"), seq(16, "small")
    assert not core.reserve(waits) and waits.status is SequenceStatus.RESERVING
    assert not core.reserve(fits_later)  # FIFO: it would fit, but it is behind `waits`
    with pytest.raises(PoolExhausted, match="already waiting"):
        core.reserve(seq(16, "third"))
    stats = core.stats()
    assert (stats.reserving, stats.awaiting_kv, stats.kv_blocks_used) == (2, 1, 90)
    core.abort(big)  # its blocks come back: both queued reservations are granted, in order
    assert core.grant() == [waits, fits_later]
    assert core.stats().kv_blocks_used == 11 and core.num_awaiting_kv == 2
    core.abort(waits)
    core.abort(fits_later)
    assert core.stats().kv_blocks_used == 0 and core.stats().awaiting_kv == 0
    core.allocator.check_invariants()


def test_a_running_batch_keeps_a_block_of_headroom_per_sequence(core: EngineCore) -> None:
    running = [seq(16, f"run{i}") for i in range(5)]
    for s in running:
        assert core.reserve(s)
        core.land(s, 7)
    assert core.stats().running == 5
    # 95 free, 1 watermark + 5 running sequences of headroom: 89 blocks may be reserved, not 90
    too_big = seq(16 * 90, "too-big")
    assert not core.reserve(too_big)
    core.abort(too_big)
    assert core.reserve(seq(16 * 89, "fits"))


def test_a_landed_sequence_decodes_from_the_token_it_came_with(core: EngineCore, tiny_model_dir) -> None:
    """The KV a prefill worker would write is written here by a colocated run of the same prompt: the landed
    sequence then decodes the same greedy tokens as a sequence that prefilled locally."""
    reference = EngineCore(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_blocks=100, block_size=16))
    prompt = list(range(3, 40))
    (expected,) = reference.generate([prompt], GREEDY)
    remote = Sequence("remote", list(prompt), GREEDY)
    assert core.reserve(remote)
    # "prefill elsewhere": run the prompt in `reference` into the blocks we reserved here, by copying its KV
    donor = Sequence("donor", list(prompt), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    donor.prefill_only = True
    reference.add(donor)
    while reference.has_work:
        reference.step()
    for src, dst in zip(donor.block_ids, remote.block_ids):
        core.kv_cache[:, :, dst] = reference.kv_cache[:, :, src]
    core.land(remote, donor.output_ids[0], cached_tokens=0)
    assert remote.status is SequenceStatus.RUNNING
    while core.has_work:
        core.step()
    assert remote.output_ids == expected
    assert core.stats().kv_blocks_used == 0


def test_a_first_token_that_ends_the_request_frees_its_blocks_at_once(core: EngineCore) -> None:
    one = Sequence("one", list(range(3, 20)), SamplingParams(max_tokens=1, temperature=0.0))
    assert core.reserve(one)
    core.land(one, 5)
    assert one.is_finished and one.finish_reason == "length" and not one.block_ids
    assert core.stats().kv_blocks_used == 0 and not core.has_work


def test_landed_prompt_blocks_are_reserved_again_and_only_the_rest_is_received(
    core: EngineCore, tiny_model_dir
) -> None:
    """Another request for a landed prompt (another choice of it) reserves the landed full blocks from the prefix
    cache, whose KV it uses as is: only its last, partial block is written, and it decodes the same greedy tokens.
    A prompt whose first token ended it leaves its blocks cached too."""
    reference = EngineCore(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_blocks=100, block_size=16))
    prompt = list(range(3, 40))  # 37 tokens: two full blocks and one partial
    (expected,) = reference.generate([prompt], GREEDY)
    donor = Sequence("donor", list(prompt), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    donor.prefill_only = True
    reference.add(donor)
    while reference.has_work:
        reference.step()

    first = Sequence("first", list(prompt), GREEDY)
    assert core.reserve(first) and first.num_computed_tokens == 0
    for src, dst in zip(donor.block_ids, first.block_ids):
        core.kv_cache[:, :, dst] = reference.kv_cache[:, :, src]
    core.land(first, donor.output_ids[0])
    second = Sequence("second", list(prompt), GREEDY)
    assert core.reserve(second)
    assert second.num_computed_tokens == 32 and second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    core.kv_cache[:, :, second.block_ids[2]] = reference.kv_cache[:, :, donor.block_ids[2]]
    core.land(second, donor.output_ids[0])
    while core.has_work:
        core.step()
    assert first.output_ids == expected and second.output_ids == expected
    assert core.stats().prefix_hit_tokens == 32 and core.stats().kv_blocks_used == 0
    core.allocator.check_invariants()

    ended = Sequence("ended", list(range(50, 90)), SamplingParams(max_tokens=1, temperature=0.0))
    assert core.reserve(ended)
    core.land(ended, 5)
    assert ended.is_finished and not ended.block_ids
    again = Sequence("again", list(range(50, 90)), GREEDY)
    assert core.reserve(again) and again.num_computed_tokens == 32
    core.abort(again)
    core.allocator.check_invariants()
