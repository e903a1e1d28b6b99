"""Serving an engine core from asyncio: the one continuous-batching loop every worker role runs.

The loop task schedules and accounts on the event loop and runs each forward on one model thread, so torch
never blocks the event loop and scheduler state has a single owner. The engine core is also built on that
thread: torch's OpenMP and oneDNN state belongs to the thread that first used it, and forwards run from another
thread measured 1.7x slower per decode step (bf16, 2 cores). Each sequence handed in comes with a sink,
a callback that receives its new tokens (or the error that ended it). A step that raises fails only the
sequences it held; a loop that dies for any other reason fails every sequence, records why, and calls
`on_fatal`, so the process can stop serving instead of answering health checks while doing nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.engine.engine_core import EngineCore, StepOutput
from pdserve.engine.errors import EngineStopped
from pdserve.engine.model_runner import LayerHook, Samples
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence

log = logging.getLogger(__name__)

Sink = Callable[[StepOutput | BaseException], None]


LayerHooks = Callable[[ScheduledBatch], LayerHook | None]
StepObserver = Callable[[ScheduledBatch, float], None]
StepThreads = Callable[[], int | None]


class EngineLoop:
    """`build_core` runs on the model thread (it loads the weights and allocates the KV cache)."""

    def __init__(
        self,
        build_core: Callable[[], EngineCore],
        name: str,
        layer_hooks: LayerHooks | None = None,
        on_step: StepObserver | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        step_threads: StepThreads | None = None,
    ) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-model")
        try:
            self.core = self._executor.submit(build_core).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self.name = name
        self.layer_hooks = layer_hooks
        self.on_step = on_step
        self.on_fatal = on_fatal
        self.step_threads = step_threads  # torch threads for the next forward (None: leave as they are)
        self.error: BaseException | None = None  # why the loop died, if it did
        self._sinks: dict[Sequence, Sink] = {}
        self._reservations: dict[Sequence, asyncio.Future] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False

    # ---- life cycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.name}-loop")

    async def stop(self) -> None:
        self._closing = True
        self._wakeup.set()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_reservations(EngineStopped(f"{self.name} worker stopped"))
        self._executor.shutdown(wait=True)

    def _fail_reservations(self, error: EngineStopped) -> None:
        """Nobody waits for blocks forever: reservations still queued when the loop ends fail with `error`."""
        for granted in self._reservations.values():
            if not granted.done():
                granted.set_exception(error)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- requests ------------------------------------------------------------------------------------------

    def submit(self, seq: Sequence, sink: Sink) -> None:
        """Run `seq`; `sink` gets each of its new tokens, the last one with `finished` set, or the exception that
        ended it."""
        self._check_alive()
        self._sinks[seq] = sink
        self.core.add(seq)
        self._wakeup.set()

    async def constrain(self, seq: Sequence) -> None:
        """Compile `seq`'s constraint (if it has one) on a worker thread, neither the event loop nor the model
        thread, so a new schema stalls no batch; InvalidParameter if it does not compile. `submit` and
        `reserve` would otherwise compile it inline."""
        if seq.params.constraint is not None and seq.grammar is None:
            await asyncio.to_thread(self.core.constrain, seq)

    async def reserve(self, seq: Sequence) -> None:
        """Hold blocks for `seq`'s KV, which another process computes, waiting in arrival order while the pool is
        full (PoolExhausted when too many wait already). However it ends, `abort` releases what it holds."""
        self._check_alive()
        if self.core.reserve(seq):
            return
        granted = self._reservations[seq] = asyncio.get_running_loop().create_future()
        try:
            await granted
        finally:
            self._reservations.pop(seq, None)

    def land(self, seq: Sequence, token_id: int, cached_tokens: int, sink: Sink) -> None:
        """`seq`'s KV has landed and `token_id` was sampled where it was computed: run it from there (unless that
        token ended it); `sink` as for `submit`."""
        self._check_alive()
        self.core.land(seq, token_id, cached_tokens)
        if not seq.is_finished:
            self._sinks[seq] = sink
            self._wakeup.set()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineStopped(f"{self.name} engine loop is not running: {self.error!r}")

    def abort(self, seq: Sequence) -> None:
        """Stop `seq` now (or after the forward in flight) and free its blocks; its sink hears nothing more.
        Also hands back the blocks a finished `prefill_only` sequence kept."""
        self._sinks.pop(seq, None)
        if seq.is_finished and not seq.block_ids:
            return
        self.core.abort(seq)
        self.blocks_freed()

    def blocks_freed(self) -> None:
        """Blocks went back to the pool: the scheduler may look again, and queued reservations may get theirs."""
        self._wakeup.set()
        for seq in self.core.grant():
            granted = self._reservations.get(seq)
            if granted is not None and not granted.done():
                granted.set_result(None)

    @property
    def num_sequences(self) -> int:
        return len(self._sinks)

    # ---- the loop ------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._serve()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.error = e
            log.critical("%s engine loop died: %r", self.name, e, exc_info=True)
            sinks, self._sinks = self._sinks, {}
            for sink in sinks.values():
                sink(EngineStopped(f"{self.name} worker failed: {e!r}"))
            self._fail_reservations(EngineStopped(f"{self.name} worker failed: {e!r}"))
            if self.on_fatal is not None:
                self.on_fatal(e)

    async def _serve(self) -> None:
        """Schedule, run the forward on the model thread, account; then start the next forward before handing
        this step's tokens to their sinks, so streaming them out overlaps the next step's compute."""
        core = self.core
        step = self._launch(core.schedule())
        while not self._closing:
            if step is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                step = self._launch(core.schedule())
                continue
            batch, start, future = step
            try:
                samples = await future
            except Exception as e:
                log.exception("%s step failed; failing its %d requests", self.name, len(batch.seqs))
                for seq in core.fail(batch):
                    self._deliver(seq, e)
                self.blocks_freed()
                step = self._launch(core.schedule())
                continue
            free_before = core.allocator.num_free_blocks
            outputs = core.update(batch, samples)
            if self.on_step is not None:
                self.on_step(batch, time.perf_counter() - start)
            step = self._launch(core.schedule())
            for out in outputs:
                sink = self._sinks.pop(out.seq, None) if out.finished else self._sinks.get(out.seq)
                if sink is not None:
                    sink(out.error if out.error is not None else out)
            if core.allocator.num_free_blocks > free_before:
                self.blocks_freed()
            await asyncio.sleep(0)  # let RPC handlers and transfers run between steps
            if step is None and core.has_work:  # sinks and handlers may have freed blocks or added requests
                step = self._launch(core.schedule())

    def _launch(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, float, asyncio.Future] | None:
        """Start `batch`'s forward and sampling on the model thread; None for an empty batch."""
        if not batch.seqs:
            return None
        hook = self.layer_hooks(batch) if self.layer_hooks is not None else None
        threads = self.step_threads() if self.step_threads is not None else None
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._execute, batch, hook, threads)
        return batch, time.perf_counter(), future

    def _execute(self, batch: ScheduledBatch, hook: LayerHook | None, threads: int | None) -> list[Samples]:
        """On the model thread: the forward and sampling, with `threads` torch threads if given."""
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return self.core.execute(batch, hook)

    def _deliver(self, seq: Sequence, error: BaseException) -> None:
        sink = self._sinks.pop(seq, None)
        if sink is not None:
            sink(error)
