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
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from decode_service.metrics import DecodeMetrics
from engine.block_allocator import BlockAllocator
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.request_check import check_request
from engine.sampler import SampleOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_loop import StepLoop
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import KVReceiver
from kvtransfer.stats import TransferStats
from kvtransfer.transport import make_transport
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import extract, trace_id
from pdserve.wire import PrefillJob, PrefillResult

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOGGER)


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
    trace_context: otel_context.Context | None = None  # the request's span, for work done on other tasks


class DecodeWorker:
    def __init__(self, cfg: EngineConfig, call_prefill: PrefillCall, transport: str = "ucx",
                 host: str = "127.0.0.1", max_queued: int = 256, transfer_timeout: float = 60.0,
                 tracer: trace.Tracer | None = None, metrics: DecodeMetrics | None = None) -> None:
        self.runner = ModelRunner.from_config(cfg)
        if self.runner.device.type != "cpu":
            raise ValueError("the KV transfer moves host memory: run disaggregated workers with --device cpu")
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
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or DecodeMetrics()
        self.metrics.bind_state(lambda: len(self.scheduler.running), self._num_waiting, self.allocator)
        self.max_queued = max_queued
        self.watermark = max(1, spec.num_blocks // 100)
        self.requests_total = 0
        self.preemptions_total = 0
        self._requests: dict[str, _Request] = {}
        self._loop = StepLoop("decode", self._run_loop)
        self._blocks_freed = asyncio.Condition()
        self._num_blocked = 0

    async def start(self) -> None:
        await self.receiver.start()
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        await self.receiver.close()

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
        t0 = time.perf_counter()
        request_context, tid = otel_context.get_current(), trace_id()
        with self.tracer.start_as_current_span("decode.admit") as span:
            self.check(prompt_ids, params)
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already running")
            self.requests_total += 1
            seq = Sequence(request_id, list(prompt_ids), params)
            req = _Request(seq, prefill_address, trace_context=request_context)
            self._requests[request_id] = req
            try:
                seq.block_ids = await self._reserve(len(prompt_ids))
            except BaseException:
                await self._release(req)
                raise
            span.set_attributes({"pdserve.request_id": request_id, "pdserve.prompt_tokens": len(prompt_ids),
                                 "pdserve.blocks": len(seq.block_ids)})
        self.metrics.queue_time.observe(time.perf_counter() - t0)
        stream = None
        status, ttft, cached = "ok", None, 0
        try:
            with self.tracer.start_as_current_span("decode.first_token",
                                                   attributes={"pdserve.prefill": prefill_address}):
                result = await self._prefill(req)
                event = self._accept_prefill(req, result)
            event.cached_prompt_tokens = cached = result.cached_tokens
            ttft = last = time.perf_counter() - t0
            self.metrics.ttft.observe(ttft)
            stream = self.tracer.start_span("decode.stream", context=req.trace_context)
            yield event
            while not event.finish_reason:
                event = await req.events.get()
                if isinstance(event, BaseException):
                    raise event
                now = time.perf_counter() - t0
                self.metrics.itl.observe(now - last)
                last = now
                yield event
            self.metrics.e2e.observe(time.perf_counter() - t0)
        except BaseException as e:
            status = "cancelled" if isinstance(e, (asyncio.CancelledError, GeneratorExit)) else "error"
            raise
        finally:
            await self._release(req)
            self.metrics.requests.labels(status).inc()
            n_out = seq.num_output_tokens
            if stream is not None:
                stream.set_attributes({"pdserve.completion_tokens": n_out,
                                       "pdserve.finish_reason": seq.finish_reason or status})
                stream.end()
            log_request(request_log, request_id=request_id, trace_id=tid,
                        status=status, finish_reason=seq.finish_reason or "", prompt_tokens=seq.num_prompt_tokens,
                        cached_tokens=cached, completion_tokens=n_out,
                        ttft_s=round(ttft, 4) if ttft is not None else None,
                        e2e_s=round(time.perf_counter() - t0, 4), prefill=prefill_address)

    async def _prefill(self, req: _Request) -> PrefillResult:
        """Have a prefill worker compute every token of req's sequence into its reserved blocks."""
        seq = req.seq
        dst = seq.block_ids[: self.allocator.blocks_needed(len(seq.token_ids))]
        arrived = self.receiver.expect(seq.request_id, dst)
        job = PrefillJob(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params,
                         self.receiver.address, dst, self.layout.fingerprint)
        try:
            result = await self.call_prefill(req.prefill_address, job)
            self._transferred(await asyncio.wait_for(asyncio.shield(arrived), self.receiver.timeout))
            return result
        finally:
            self.receiver.cancel(seq.request_id)

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

    def _accept_prefill(self, req: _Request, result: PrefillResult) -> TokenEvent:
        seq = req.seq
        seq.num_computed_tokens = len(seq.token_ids)
        seq.append(result.sample, self.model_config.eos_token_ids, self.max_model_len)
        self.metrics.generation_tokens.inc()
        if seq.finish_reason is None:
            self.scheduler.add_running(seq)
            self._loop.wake()
        return TokenEvent(result.sample, seq.finish_reason)

    async def _release(self, req: _Request) -> None:
        seq = req.seq
        self._requests.pop(seq.request_id, None)
        if req.recompute is not None and not req.recompute.done():
            req.recompute.cancel()
            await asyncio.gather(req.recompute, return_exceptions=True)
        if seq.request_id in self._loop.in_step:
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
        while not self._loop.closing:
            if not self.scheduler.running:
                await self._loop.sleep()
                continue
            batch = self.scheduler.schedule(admit_waiting=False)
            for seq in batch.preempted:
                self._start_recompute(seq)
            if not batch.seqs:
                continue
            t0 = time.perf_counter()
            try:
                samples = await self._loop.step(self.runner.execute, batch)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the worker
                log.exception("decode step failed")
                for seq in list(batch.seqs):
                    self._deliver(seq, e)
                continue
            self.metrics.step_time.observe(time.perf_counter() - t0)
            self.metrics.batch_size.observe(len(batch.seqs))
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
                self.metrics.generation_tokens.inc()
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
        self.metrics.preemptions.inc()
        req = self._requests.get(seq.request_id)
        if req is None:
            return
        req.recompute = asyncio.create_task(self._recompute(req), name=f"recompute-{seq.request_id}")

    async def _recompute(self, req: _Request) -> None:
        seq = req.seq
        token = otel_context.attach(req.trace_context or otel_context.Context())
        try:
            with self.tracer.start_as_current_span("decode.recompute",
                                                   attributes={"pdserve.tokens": len(seq.token_ids)}):
                seq.block_ids = await self._reserve(len(seq.token_ids), queue=False)
                result = await self._prefill(req)
                event = self._accept_prefill(req, result)
            req.events.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the request's stream
            req.events.put_nowait(e)
        finally:
            otel_context.detach(token)

    # ---- figures -----------------------------------------------------------------------------------------

    def _num_waiting(self) -> int:
        return sum(1 for r in self._requests.values() if r.seq.status is SequenceStatus.WAITING)

    def stats(self) -> dict:
        running = self.scheduler.running
        return {
            "role": "decode", "model": self.model_name,
            "kv_blocks_total": self.allocator.num_blocks, "kv_blocks_used": self.allocator.num_used_blocks,
            "kv_blocks_cached": 0, "block_size": self.allocator.block_size,
            "running": len(running), "waiting": self._num_waiting(),
            "tokens_held": sum(r.seq.num_computed_tokens if r.seq.status is SequenceStatus.RUNNING
                               else len(r.seq.token_ids) for r in self._requests.values() if r.seq.block_ids),
            "requests_total": self.requests_total, "kv_address": self.receiver.address,
            "max_model_len": self.max_model_len, "pending_transfers": self.receiver.num_pending,
            "preemptions_total": self.preemptions_total,
        }
