"""The serving loop around the engine core: a failed forward fails its requests only; a dead loop says so."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import EngineStopped
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _loop(tiny_model_dir, **hooks) -> EngineLoop:
    return EngineLoop(
        lambda: EngineCore(EngineConfig(model=str(tiny_model_dir), num_blocks=64, block_size=4)), "test", **hooks
    )


async def _collect(queue: asyncio.Queue) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(queue.get(), 30)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


async def test_a_forward_that_raises_fails_its_batch_and_the_loop_goes_on(tiny_model_dir):
    loop = _loop(tiny_model_dir)
    real_execute = loop.core.execute
    calls = {"n": 0}

    def flaky(batch, hook=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_execute(batch, hook)

    loop.core.execute = flaky
    loop.start()
    try:
        first: asyncio.Queue = asyncio.Queue()
        loop.submit(Sequence("a", [5, 6, 7, 8], PARAMS), first.put_nowait)
        items = await _collect(first)
        assert isinstance(items[-1], RuntimeError) and "boom" in str(items[-1])
        second: asyncio.Queue = asyncio.Queue()
        loop.submit(Sequence("b", [5, 6, 7, 8], PARAMS), second.put_nowait)
        items = await _collect(second)
        assert len(items) == 8 and items[-1].finish_reason == "length"
        assert loop.core.allocator.num_used_blocks == 0 and loop.alive
    finally:
        await loop.stop()


async def test_a_dead_loop_fails_everyone_and_reports_itself(tiny_model_dir):
    fatal: list[BaseException] = []
    loop = _loop(tiny_model_dir, on_fatal=fatal.append)

    def broken():
        raise KeyError("scheduler state corrupted")

    loop.start()
    try:
        queue: asyncio.Queue = asyncio.Queue()
        loop.core.schedule = broken
        loop.submit(Sequence("a", [5, 6, 7], PARAMS), queue.put_nowait)
        items = await _collect(queue)
        assert isinstance(items[-1], EngineStopped)
        assert isinstance(fatal[0], KeyError) and not loop.alive
        with pytest.raises(EngineStopped):
            loop.submit(Sequence("b", [5, 6, 7], PARAMS), queue.put_nowait)
    finally:
        await loop.stop()


async def test_abort_during_a_step_frees_blocks_after_it(tiny_model_dir):
    loop = _loop(tiny_model_dir)
    loop.start()
    try:
        queue: asyncio.Queue = asyncio.Queue()
        seq = Sequence("a", list(range(5, 60)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        loop.submit(seq, queue.put_nowait)
        await asyncio.wait_for(queue.get(), 30)
        loop.abort(seq)
        for _ in range(100):
            if loop.core.allocator.num_used_blocks == 0 and not loop.core.in_step:
                break
            await asyncio.sleep(0.01)
        assert loop.core.allocator.num_used_blocks == 0 and not loop.core.has_work
    finally:
        await loop.stop()


async def test_each_forward_runs_with_the_threads_step_threads_names(tiny_model_dir):
    """`step_threads` is asked before every forward and the forward runs with that many torch threads (what a
    decode worker lowers while a prefill worker on the same cores computes for it)."""
    import torch

    wanted = iter([1, 2, 1, 2, 1, 2, 1, 2, 1, 2])
    asked: list[int] = []
    seen: list[int] = []

    def step_threads() -> int:
        asked.append(next(wanted, 1))
        return asked[-1]

    loop = _loop(
        tiny_model_dir,
        step_threads=step_threads,
        layer_hooks=lambda batch: lambda layer: seen.append(torch.get_num_threads()) if layer == 0 else None,
    )
    loop.start()
    try:
        queue: asyncio.Queue = asyncio.Queue()
        loop.submit(Sequence("a", [5, 6, 7, 8], PARAMS), queue.put_nowait)
        items = await _collect(queue)
        assert len(items) == 8 and len(asked) == len(seen) == 8
        assert seen == asked
    finally:
        await loop.stop()
