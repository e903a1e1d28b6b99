"""The decode worker: owns a paged KV cache, has prefill workers fill it, and runs the continuous-batching loop.

A request's life here: reserve blocks for its prompt (waiting in a bounded FIFO while the pool is full), tell
the kvtransfer receiver which blocks to expect, ask a prefill worker to run the prompt and push its KV into
them, stream the first token the prefill worker sampled, then join the running batch of the engine loop.

A prompt may also be prefilled here, in the same loop, mixed with the decode batch (chunked under the token
budget): when the gateway names no prefill worker (it does so for prompts up to the `local_prefill_max_tokens`
this worker reports: conditional disaggregation), and always in colocated mode, where there is no KV receiver at
all. A sequence preempted when blocks run out is recomputed here the same way.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.decode_service.metrics import DecodeMetrics
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.sampler import SampleOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.stats import TransferStats
from pdserve.kvtransfer.transports import make_transport
from pdserve.deadline import deadline_passed
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import extract, trace_id
from pdserve.wire import PrefillJob, PrefillResult

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOGGER)


class PoolExhausted(RuntimeError):
    """No KV blocks now and the admission queue is full."""


class WorkerClosing(RuntimeError):
    """The worker is shutting down and takes no new requests."""


class _FinishedEarly(Exception):
    """Put in a request's event queue by `finish`: the stream ends as finished, with this reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


PrefillCall = Callable[[str, PrefillJob], Awaitable[PrefillResult]]


@dataclass
class TokenEvent:
    sample: SampleOutput
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0


@dataclass
class _Request:
    seq: Sequence
    prefill_address: str  # "" when prefilled here
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    trace_context: otel_context.Context | None = None


class DecodeWorker:
    """`call_prefill` None means colocated: every prompt is prefilled here and no KV receiver runs."""

    def __init__(self, cfg: EngineConfig, call_prefill: PrefillCall | None = None, transport: str = "ucx",
                 kv_host: str = "127.0.0.1", kv_port: int = 0, max_queued: int = 256, transfer_timeout: float = 60.0,
                 local_prefill_max_tokens: int = 0, tracer: trace.Tracer | None = None,
                 metrics: DecodeMetrics | None = None, threads_while_prefilling: int | None = None) -> None:
        self.role = "decode" if call_prefill is not None else "colocated"
        self.threads_while_prefilling = threads_while_prefilling
        self._threads = cfg.num_threads or torch.get_num_threads()
        self.loop = EngineLoop(lambda: EngineCore(cfg), self.role, on_step=self._on_step,
                               on_blocks_freed=self._grant_blocks,
                               step_threads=self._step_threads if threads_while_prefilling else None)
        self.core = self.loop.core
        self.model_config = self.core.model_config
        self.model_name = self.model_config.name
        self.call_prefill = call_prefill
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.receiver = None
        if call_prefill is not None:
            self.receiver = KVReceiver(self.core.runner.kv_cache, self.core.layout, make_transport(transport),
                                       kv_host, kv_port, timeout=transfer_timeout)
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or DecodeMetrics()
        self.metrics.bind_state(lambda: len(self.core.scheduler.running), self._num_waiting, self.core.allocator)
        self.max_queued = max_queued
        self.watermark = max(1, self.core.allocator.num_blocks // 100) if call_prefill is not None else 0
        self.requests_total = 0
        self.local_prefills_total = 0
        self.remote_prefills_total = 0
        self._reservations: deque[tuple[int, asyncio.Future]] = deque()
        self._remote_in_progress = 0
        self._streams: dict[str, _Request] = {}
        self._closing = False

    def _step_threads(self) -> int:
        """Fewer torch threads while a prefill worker computes prompts for this one: on a machine they share,
        two OpenMP teams that each want every core stall each other's steps (decode steps of 4 sequences took
        180-600 ms while a prefill ran, against 15 ms alone)."""
        return self.threads_while_prefilling if self._remote_in_progress else self._threads

    async def start(self) -> None:
        if self.receiver is not None:
            await self.receiver.start()
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self.receiver is not None:
            await self.receiver.close()

    # ---- admission ---------------------------------------------------------------------------------------

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError for requests that can never run here."""
        self.core.check(prompt_ids, params, reserved_blocks=self.watermark)

    def _prefill_here(self, seq: Sequence, prefill_address: str) -> bool:
        """Local when colocated, or when the gateway named no prefill worker (it sends short prompts here when
        this worker reports a `local_prefill_max_tokens` threshold: conditional disaggregation)."""
        return not prefill_address or self.receiver is None

    async def _reserve(self, num_tokens: int) -> list[int]:
        """Blocks for num_tokens, waiting (FIFO, bounded) while the pool is full."""
        allocator = self.core.allocator
        need = allocator.blocks_needed(num_tokens)
        if not self._reservations and self._can_grant(need):
            return allocator.allocate(need)
        if len(self._reservations) >= self.max_queued:
            raise PoolExhausted(f"KV pool full ({allocator.num_free_blocks} blocks free) and "
                                f"{len(self._reservations)} requests already waiting")
        entry = (need, asyncio.get_running_loop().create_future())
        self._reservations.append(entry)
        try:
            return await entry[1]
        except BaseException:
            fut = entry[1]
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                allocator.free(fut.result())  # granted, but the request went away before taking them
                self._grant_blocks()
            raise
        finally:
            if entry in self._reservations:
                self._reservations.remove(entry)

    def _grant_blocks(self) -> None:
        """Blocks came back: hand them to waiting reservations in arrival order."""
        allocator = self.core.allocator
        while self._reservations:
            need, fut = self._reservations[0]
            if fut.done():
                self._reservations.popleft()
                continue
            if not self._can_grant(need):
                return
            self._reservations.popleft()
            fut.set_result(allocator.allocate(need))

    def _can_grant(self, need: int) -> bool:
        """Reserve for a prompt that a prefill worker will fill only while the running batch keeps a block of
        headroom per sequence: blocks held for prompts still queued at prefill must not starve the sequences
        that are generating (they would be preempted and recomputed, over and over)."""
        headroom = self.watermark + len(self.core.scheduler.running)
        return self.core.allocator.num_free_blocks - need >= headroom

    # ---- one request -------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       prefill_address: str = "", stream_id: str = "", deadline: float | None = None
                       ) -> AsyncIterator[list[TokenEvent]]:
        """Stream a request's tokens, in lists of what is ready (more than one when the reader lags). Leaving
        the iterator early (cancel, error) frees everything the request held; `finish(stream_id, reason)` ends
        it early as a normal finish. `deadline` (time.monotonic()) tells a deadline from a cancellation."""
        t0 = time.perf_counter()
        request_context, tid = otel_context.get_current(), trace_id()
        if self._closing:
            raise WorkerClosing(f"{self.role} worker is shutting down")
        self.check(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params)
        local = self._prefill_here(seq, prefill_address)
        req = _Request(seq, "" if local else prefill_address, trace_context=request_context)
        if stream_id:
            self._streams[stream_id] = req
        self.requests_total += 1
        status, ttft = "ok", None
        stream = None
        try:
            with self.tracer.start_as_current_span("decode.admit") as span:
                span.set_attributes({"pdserve.request_id": request_id, "pdserve.prompt_tokens": len(prompt_ids),
                                     "pdserve.prefill": req.prefill_address or "local"})
                if not local:
                    seq.block_ids = await self._reserve(len(prompt_ids))
                    span.set_attribute("pdserve.blocks", len(seq.block_ids))
            self.metrics.queue_time.observe(time.perf_counter() - t0)
            with self.tracer.start_as_current_span("decode.first_token",
                                                   attributes={"pdserve.prefill": req.prefill_address or "local"}):
                if local:
                    self.local_prefills_total += 1
                    self.loop.submit(seq, req.events.put_nowait)
                    first = await self._next(req)
                else:
                    self.remote_prefills_total += 1
                    first = [await self._prefill_remotely(req)]
            first[0].cached_prompt_tokens = seq.num_cached_tokens
            ttft = last = time.perf_counter() - t0
            self.metrics.ttft.observe(ttft)
            stream = self.tracer.start_span("decode.stream", context=req.trace_context)
            events = first
            while True:
                self.metrics.generation_tokens.inc(len(events))
                yield events
                if events[-1].finish_reason:
                    break
                events = await self._next(req)
                now = time.perf_counter() - t0
                self.metrics.itl.observe(now - last)
                for _ in events[1:]:
                    self.metrics.itl.observe(0.0)
                last = now
            self.metrics.e2e.observe(time.perf_counter() - t0)
        except _FinishedEarly:
            self.metrics.e2e.observe(time.perf_counter() - t0)
        except BaseException as e:
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                status = "deadline_exceeded" if deadline_passed(deadline) else "cancelled"
            else:
                status = "error"
            raise
        finally:
            self._streams.pop(stream_id, None)
            self.loop.abort(seq)
            self.metrics.requests.labels(status).inc()
            if stream is not None:
                stream.set_attributes({"pdserve.completion_tokens": seq.num_output_tokens,
                                       "pdserve.finish_reason": seq.finish_reason or status})
                stream.end()
            log_request(request_log, request_id=request_id, trace_id=tid,
                        status=status, finish_reason=seq.finish_reason or "", prompt_tokens=seq.num_prompt_tokens,
                        cached_tokens=seq.num_cached_tokens, completion_tokens=seq.num_output_tokens,
                        ttft_s=round(ttft, 4) if ttft is not None else None,
                        e2e_s=round(time.perf_counter() - t0, 4), prefill=req.prefill_address or "local")

    @staticmethod
    async def _next(req: _Request) -> list[TokenEvent]:
        """The next token, plus any that are already queued behind it."""
        items = [await req.events.get()]
        while not req.events.empty():
            items.append(req.events.get_nowait())
        events = []
        for item in items:
            if isinstance(item, _FinishedEarly):
                if req.seq.finish_reason is None:
                    req.seq.finish_reason = item.reason
                raise item
            if isinstance(item, BaseException):
                raise item
            events.append(TokenEvent(item.sample, item.finish_reason))
        return events

    def finish(self, stream_id: str, reason: str) -> bool:
        """End a stream early as a normal finish with `reason` (the gateway hit a stop string); False if the
        stream is no longer running."""
        req = self._streams.get(stream_id)
        if req is None:
            return False
        req.events.put_nowait(_FinishedEarly(reason))
        return True

    async def close(self) -> None:
        """Refuse new requests (the server is draining); those in flight go on."""
        self._closing = True

    async def _prefill_remotely(self, req: _Request) -> TokenEvent:
        """Have a prefill worker compute every token of req's sequence into its reserved blocks, then run the
        sequence here from its first sampled token."""
        seq = req.seq
        transfer_id, secret = uuid.uuid4().hex, secrets.token_hex(16)
        arrived = self.receiver.expect(transfer_id, seq.block_ids, secret)
        job = PrefillJob(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params,
                         self.receiver.address, list(seq.block_ids), self.core.layout.fingerprint, transfer_id,
                         secret)
        self._remote_in_progress += 1
        try:
            result = await self.call_prefill(req.prefill_address, job)
            self._transferred(await asyncio.wait_for(asyncio.shield(arrived), self.receiver.timeout))
        finally:
            self._remote_in_progress -= 1
            writing = self.receiver.cancel(transfer_id)
            if writing is not None:  # bytes still landing in these blocks: free them only once that ends
                await asyncio.shield(writing)
        seq.num_cached_tokens = result.cached_tokens
        seq.num_computed_tokens = len(seq.token_ids)
        seq.append(result.sample.token_id, self.model_config.eos_token_ids, self.core.max_model_len)
        if seq.finish_reason is None:
            self.loop.submit(seq, req.events.put_nowait, prefilled=True)
        return TokenEvent(result.sample, seq.finish_reason)

    def _transferred(self, stats: TransferStats) -> None:
        """Count a landed transfer and record it as a span under the sender's `kv.transfer` span."""
        self.metrics.transfer_bytes.inc(stats.nbytes)
        self.metrics.transfer_seconds.observe(stats.seconds)
        start = int(stats.started_at * 1e9)
        span = self.tracer.start_span("kv.receive", context=extract(stats.trace), kind=trace.SpanKind.CONSUMER,
                                      start_time=start, attributes={
                                          "pdserve.request_id": stats.request_id, "kv.bytes": stats.nbytes,
                                          "kv.layers": stats.layers, "kv.blocks": stats.blocks,
                                          "kv.gbps": stats.gbps, "kv.transport": stats.transport})
        span.end(end_time=start + int(stats.seconds * 1e9))

    # ---- figures -----------------------------------------------------------------------------------------

    def _on_step(self, batch: ScheduledBatch, seconds: float) -> None:
        self.metrics.step_time.observe(seconds)
        self.metrics.batch_size.observe(len(batch.seqs))
        if batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))

    def _num_waiting(self) -> int:
        return len(self.core.scheduler.waiting) + len(self._reservations) + self._remote_in_progress

    def stats(self) -> dict:
        return {
            **self.core.stats(), "role": self.role, "model": self.model_name, "waiting": self._num_waiting(),
            "requests_total": self.requests_total,
            "kv_address": self.receiver.address if self.receiver is not None else "",
            "pending_transfers": self.receiver.num_pending if self.receiver is not None else 0,
            "local_prefills_total": self.local_prefills_total, "remote_prefills_total": self.remote_prefills_total,
            "queued_tokens": sum(len(s.token_ids) - s.num_computed_tokens for s in self.core.scheduler.waiting),
            "local_prefill_max_tokens": self.local_prefill_max_tokens if self.receiver else 0,
        }
