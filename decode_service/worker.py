"""The decode worker: owns a paged KV cache, has prefill workers fill it, and runs the continuous-batching loop.

A request's life here: reserve blocks for its prompt (waiting in a bounded queue when the pool is full), tell
the kvtransfer receiver which blocks to expect, ask a prefill worker to run the prompt and push its KV into
them, stream the first token the prefill worker sampled, then join the running batch. Each step of the loop
decodes one token for every running sequence in a single forward (off the event loop), streams the tokens and
retires finished sequences. When the pool runs dry the newest sequence is preempted and recomputed through a
prefill worker. All scheduler state is touched only on the event loop; blocks of a sequence that is part of
the forward in flight are freed only after that step.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from engine.block_allocator import BlockAllocator
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.request_check import check_request
from engine.sampler import SampleOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import KVReceiver
from kvtransfer.transport import make_transport
from pdserve.wire import PrefillJob, PrefillResult

log = logging.getLogger(__name__)


class PoolExhausted(RuntimeError):
    """No KV blocks now and the admission queue is full."""


PrefillCall = Callable[[str, PrefillJob], Awaitable[PrefillResult]]


@dataclass
class TokenEvent:
    sample: SampleOutput
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0


@dataclass
class _Request:
    seq: Sequence
    prefill_address: str
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    abort: bool = False
    recompute: asyncio.Task | None = None


class DecodeWorker:
    def __init__(self, cfg: EngineConfig, call_prefill: PrefillCall, transport: str = "ucx",
                 host: str = "127.0.0.1", max_queued: int = 256, transfer_timeout: float = 60.0) -> None:
        self.runner = ModelRunner.from_config(cfg)
        self.model_config = self.runner.config
        self.model_name = self.model_config.name
        self.max_model_len = min(cfg.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        spec = self.runner.spec
        self.allocator = BlockAllocator(spec.num_blocks, spec.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.layout = KVLayout.of(self.runner.kv_cache, self.model_name)
        self.receiver = KVReceiver(self.runner.kv_cache, self.layout, make_transport(transport), host,
                                   timeout=transfer_timeout)
        self.call_prefill = call_prefill
        self.max_queued = max_queued
        self.watermark = max(1, spec.num_blocks // 100)
        self.requests_total = 0
        self.preemptions_total = 0
        self._requests: dict[str, _Request] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="decode-model")
        self._wakeup = asyncio.Event()
        self._blocks_freed = asyncio.Condition()
        self._num_blocked = 0
        self._in_step: set[str] = set()
        self._loop_task: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> None:
        await self.receiver.start()
        self._loop_task = asyncio.create_task(self._run_loop(), name="decode-loop")

    async def stop(self) -> None:
        self._closing = True
        self._wakeup.set()
        if self._loop_task:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self.receiver.close()
        self._executor.shutdown(wait=True)

    # ---- admission ---------------------------------------------------------------------------------------

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError for requests that can never run here."""
        check_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len,
                      (self.allocator.num_blocks - self.watermark) * self.allocator.block_size)

    async def _reserve(self, num_tokens: int, queue: bool = True) -> list[int]:
        """Blocks for num_tokens, waiting (FIFO, bounded) while the pool is full."""
        need = self.allocator.blocks_needed(num_tokens)
        if self._num_blocked == 0 and self.allocator.num_free_blocks - need >= self.watermark:
            return self.allocator.allocate(need)
        if queue and self._num_blocked >= self.max_queued:
            raise PoolExhausted(f"KV pool full ({self.allocator.num_free_blocks} blocks free) and "
                                f"{self._num_blocked} requests already waiting")
        self._num_blocked += 1
        try:
            async with self._blocks_freed:
                await self._blocks_freed.wait_for(lambda: self.allocator.num_free_blocks - need >= self.watermark)
                return self.allocator.allocate(need)
        finally:
            self._num_blocked -= 1

    async def _notify_freed(self) -> None:
        async with self._blocks_freed:
            self._blocks_freed.notify_all()

    # ---- one request -------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       prefill_address: str) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. Leaving the iterator early (cancel, error) frees everything it held."""
        self.check(prompt_ids, params)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.requests_total += 1
        seq = Sequence(request_id, list(prompt_ids), params)
        req = _Request(seq, prefill_address)
        self._requests[request_id] = req
        try:
            seq.block_ids = await self._reserve(len(prompt_ids))
            result = await self._prefill(req)
            event = self._accept_prefill(req, result)
            event.cached_prompt_tokens = result.cached_tokens
            yield event
            if event.finish_reason:
                return
            while True:
                event = await req.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish_reason:
                    return
        finally:
            await self._release(req)

    async def _prefill(self, req: _Request) -> PrefillResult:
        """Have a prefill worker compute every token of req's sequence into its reserved blocks."""
        seq = req.seq
        dst = seq.block_ids[: self.allocator.blocks_needed(len(seq.token_ids))]
        arrived = self.receiver.expect(seq.request_id, dst)
        job = PrefillJob(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params,
                         self.receiver.address, dst, self.layout.fingerprint)
        try:
            result = await self.call_prefill(req.prefill_address, job)
            await asyncio.wait_for(asyncio.shield(arrived), self.receiver.timeout)
            return result
        finally:
            self.receiver.cancel(seq.request_id)

    def _accept_prefill(self, req: _Request, result: PrefillResult) -> TokenEvent:
        seq = req.seq
        seq.num_computed_tokens = len(seq.token_ids)
        seq.append(result.sample, self.model_config.eos_token_ids, self.max_model_len)
        if seq.finish_reason is None:
            self.scheduler.add_running(seq)
            self._wakeup.set()
        return TokenEvent(result.sample, seq.finish_reason)

    async def _release(self, req: _Request) -> None:
        seq = req.seq
        self._requests.pop(seq.request_id, None)
        if req.recompute is not None and not req.recompute.done():
            req.recompute.cancel()
            await asyncio.gather(req.recompute, return_exceptions=True)
        if seq.request_id in self._in_step:
            req.abort = True  # the loop frees it once the forward in flight is done
            return
        self._retire(seq, "abort")
        await self._notify_freed()

    def _retire(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.FINISHED:
            if seq.block_ids:
                self.allocator.free(seq.block_ids)
                seq.block_ids = []
            return
        if seq in self.scheduler.running or seq in self.scheduler.waiting:
            self.scheduler.finish(seq, reason)
        else:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
            seq.status = SequenceStatus.FINISHED

    # ---- the continuous-batching loop ---------------------------------------------------------------------

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            if not self.scheduler.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self.scheduler.schedule(admit_waiting=False)
            for seq in batch.preempted:
                self._start_recompute(seq)
            if not batch.seqs:
                continue
            self._in_step = {s.request_id for s in batch.seqs}
            try:
                samples = await loop.run_in_executor(self._executor, self.runner.execute, batch)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the worker
                log.exception("decode step failed")
                self._in_step = set()
                for seq in list(batch.seqs):
                    self._deliver(seq, e)
                continue
            self._in_step = set()
            self.scheduler.commit(batch)
            freed = False
            for seq, sample in zip(batch.seqs, samples):
                req = self._requests.get(seq.request_id)
                if req is None or req.abort:
                    self._retire(seq, "abort")
                    freed = True
                    continue
                if sample is None:
                    continue
                seq.append(sample, self.model_config.eos_token_ids, self.max_model_len)
                req.events.put_nowait(TokenEvent(sample, seq.finish_reason))
                if seq.finish_reason:
                    self.scheduler.finish(seq, seq.finish_reason)
                    freed = True
            if freed:
                await self._notify_freed()
            await asyncio.sleep(0)  # let RPC handlers and the KV receiver run between steps

    def _deliver(self, seq: Sequence, error: BaseException) -> None:
        req = self._requests.get(seq.request_id)
        self._retire(seq, "abort")
        if req is not None:
            req.events.put_nowait(error)

    def _start_recompute(self, seq: Sequence) -> None:
        """A preempted sequence gets fresh blocks and its KV recomputed through a prefill worker."""
        self.scheduler.waiting.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.preemptions_total += 1
        req = self._requests.get(seq.request_id)
        if req is None:
            return
        req.recompute = asyncio.create_task(self._recompute(req), name=f"recompute-{seq.request_id}")

    async def _recompute(self, req: _Request) -> None:
        seq = req.seq
        try:
            seq.block_ids = await self._reserve(len(seq.token_ids), queue=False)
            result = await self._prefill(req)
            event = self._accept_prefill(req, result)
            req.events.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the request's stream
            req.events.put_nowait(e)

    # ---- figures -----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        running = self.scheduler.running
        return {
            "role": "decode", "model": self.model_name,
            "kv_blocks_total": self.allocator.num_blocks, "kv_blocks_used": self.allocator.num_used_blocks,
            "kv_blocks_cached": 0, "block_size": self.allocator.block_size,
            "running": len(running),
            "waiting": sum(1 for r in self._requests.values() if r.seq.status is SequenceStatus.WAITING),
            "tokens_held": sum(r.seq.num_computed_tokens if r.seq.status is SequenceStatus.RUNNING
                               else len(r.seq.token_ids) for r in self._requests.values() if r.seq.block_ids),
            "requests_total": self.requests_total, "kv_address": self.receiver.address,
            "max_model_len": self.max_model_len, "pending_transfers": self.receiver.num_pending,
            "preemptions_total": self.preemptions_total,
        }
