"""The driver every worker's scheduling loop shares: an asyncio task that sleeps until woken, and the one thread
its forwards run on (torch work stays off the event loop, one forward at a time). It owns both and frees both."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

from engine.scheduler import ScheduledBatch

T = TypeVar("T")


class StepLoop:
    def __init__(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self._body = body
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-model")
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.closing = False
        self.in_step: set[str] = set()  # requests in the forward in flight: free their blocks only after it

    def start(self) -> None:
        self._task = asyncio.create_task(self._body(), name=f"{self.name}-loop")

    def wake(self) -> None:
        """Something changed (a request arrived, blocks were freed): let the loop look again."""
        self._wakeup.set()

    async def sleep(self) -> None:
        """Wait for the next `wake`."""
        self._wakeup.clear()
        await self._wakeup.wait()

    async def step(self, fn: Callable[..., T], batch: ScheduledBatch, *args) -> T:
        """Run `fn(batch, *args)` (a forward) on the model thread, with `in_step` naming the batch's requests."""
        self.in_step = {seq.request_id for seq in batch.seqs}
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, batch, *args)
        finally:
            self.in_step = set()

    async def stop(self) -> None:
        self.closing = True
        self._wakeup.set()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
