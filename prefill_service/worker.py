"""The prefill worker: batches prompts under a token budget, runs them, and pushes each layer's KV as it is made.

Prompts queue in the engine scheduler, which admits them in arrival order within the token budget (long prompts
are chunked across steps) and serves repeated prefixes from this worker's own prefix cache. In the step where a
prompt's last chunk runs, its transfer is begun before the forward and every layer's K/V is handed to the
kvtransfer sender right after that layer is computed, so the wire works while the next layer computes. The
request is answered with the first sampled token once the decode worker confirms all layers landed; only then
are this worker's blocks released (to the prefix cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from engine.block_allocator import BlockAllocator
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.request_check import check_request
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_loop import StepLoop
from kvtransfer.errors import TransferError
from kvtransfer.layout import KVLayout, LayoutMismatch
from kvtransfer.sender import KVSender
from kvtransfer.stats import TransferStats
from kvtransfer.transport import make_transport
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import inject, trace_id
from pdserve.wire import PrefillJob, PrefillResult
from prefill_service.metrics import PrefillMetrics

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOGGER)


class QueueFull(RuntimeError):
    """Too many prompts already waiting."""


@dataclass
class _Job:
    spec: PrefillJob
    seq: Sequence
    future: asyncio.Future
    cancelled: bool = False
    trace_context: otel_context.Context | None = None
    arrived_ns: int = 0  # wall clock, for spans recorded after the fact
    first_step_ns: int = 0
    steps: int = 0
    transfer_span: trace.Span | None = None


class PrefillWorker:
    def __init__(self, cfg: EngineConfig, transport: str = "ucx", max_queued: int = 1024,
                 transfer_timeout: float = 60.0, tracer: trace.Tracer | None = None,
                 metrics: PrefillMetrics | None = None) -> None:
        self.runner = ModelRunner.from_config(cfg)
        if self.runner.device.type != "cpu":
            raise ValueError("the KV transfer moves host memory: run disaggregated workers with --device cpu")
        self.model_config = self.runner.config
        self.model_name = self.model_config.name
        self.max_model_len = min(cfg.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        spec = self.runner.spec
        self.allocator = BlockAllocator(spec.num_blocks, spec.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.layout = KVLayout.of(self.runner.kv_cache, self.model_name)
        self.sender = KVSender(self.runner.kv_cache, self.layout, make_transport(transport), timeout=transfer_timeout)
        self.max_queued = max_queued
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or PrefillMetrics()
        self.metrics.bind_state(lambda: len(self.scheduler.running) + len(self._finishing),
                                lambda: len(self.scheduler.waiting), self.allocator)
        self.requests_total = 0
        self.prefill_tokens_total = 0
        self._jobs: dict[str, _Job] = {}
        self._loop = StepLoop("prefill", self._run_loop)
        self._finishing: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        await asyncio.gather(*self._finishing, return_exceptions=True)
        await self.sender.close()

    def check(self, job: PrefillJob) -> None:
        n = len(job.token_ids)
        check_request(job.token_ids, job.params, self.model_config.vocab_size, self.max_model_len,
                      self.allocator.num_blocks * self.allocator.block_size)
        if not 0 < job.num_prompt_tokens <= n:
            raise ValueError("num_prompt_tokens must be in [1, len(token_ids)]")
        if len(job.block_ids) != self.allocator.blocks_needed(n):
            raise ValueError(f"KV target has {len(job.block_ids)} blocks for {n} tokens")
        if job.layout_fingerprint != self.layout.fingerprint:
            raise LayoutMismatch(f"KV layout fingerprint {job.layout_fingerprint!r} does not match this worker's "
                             f"{self.layout.fingerprint!r} ({self.layout.compatibility_fields()})")

    async def prefill(self, job: PrefillJob) -> PrefillResult:
        """Queue, run and transfer one prompt; returns its first token. Cancelling it frees its blocks."""
        t0, status, result = time.perf_counter(), "ok", None
        try:
            result = await self._prefill(job)
            return result
        except BaseException as e:
            status = "cancelled" if isinstance(e, asyncio.CancelledError) else type(e).__name__
            raise
        finally:
            self.metrics.requests.labels(status).inc()
            fields = {"prompt_tokens": job.num_prompt_tokens, "tokens": len(job.token_ids)}
            if result is not None:
                fields.update(cached_tokens=result.cached_tokens, kv_bytes=result.transfer.get("bytes", 0),
                              kv_gbps=round(result.transfer.get("gbps", 0.0), 3))
            log_request(request_log, request_id=job.request_id, trace_id=trace_id(), status=status,
                        seconds=round(time.perf_counter() - t0, 4), decode_kv=job.kv_address, **fields)

    async def _prefill(self, job: PrefillJob) -> PrefillResult:
        self.check(job)
        if job.request_id in self._jobs:
            raise ValueError(f"request id {job.request_id!r} is already being prefilled")
        if len(self.scheduler.waiting) >= self.max_queued:
            raise QueueFull(f"{len(self.scheduler.waiting)} prompts already waiting")
        self.requests_total += 1
        seq = Sequence(job.request_id, list(job.token_ids), job.params, num_prompt_tokens=job.num_prompt_tokens)
        entry = _Job(job, seq, asyncio.get_running_loop().create_future(),
                     trace_context=otel_context.get_current(), arrived_ns=time.time_ns())
        self._jobs[job.request_id] = entry
        self.scheduler.add(seq)
        self._loop.wake()
        try:
            return await asyncio.shield(entry.future)
        finally:
            if not entry.future.done():
                entry.cancelled = True
                await self._abort(entry)

    async def _abort(self, entry: _Job) -> None:
        rid = entry.seq.request_id
        self._end_transfer_span(entry, error="prefill cancelled")
        await self.sender.abort(rid, "prefill cancelled")
        if rid in self._loop.in_step:
            return  # the loop releases it after the forward in flight
        self._jobs.pop(rid, None)
        if entry.seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(entry.seq, "abort")
            self._loop.wake()

    async def _run_loop(self) -> None:
        while not self._loop.closing:
            if not self.scheduler.has_work:
                await self._loop.sleep()
                continue
            batch = self.scheduler.schedule()
            if not batch.seqs:  # the pool is held by transfers in flight: wait until one frees its blocks
                await self._loop.sleep()
                continue
            finishing = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
            sending = await self._begin_transfers(finishing)

            def push(layer: int) -> None:
                for rid in sending:
                    self.sender.send_layer(rid, layer)

            step_start = time.time_ns()
            try:
                samples = await self._loop.step(self.runner.execute, batch, push)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the worker
                log.exception("prefill step failed")
                for seq in batch.seqs:
                    await self._fail(seq, e)
                continue
            step_end = time.time_ns()
            self.metrics.step_time.observe((step_end - step_start) / 1e9)
            self.metrics.batch_tokens.observe(batch.num_tokens)
            self.scheduler.commit(batch)
            self.prefill_tokens_total += batch.num_tokens
            for seq, sample in zip(batch.seqs, samples):
                entry = self._jobs.get(seq.request_id)
                if entry is None or entry.cancelled:
                    self._jobs.pop(seq.request_id, None)
                    self.scheduler.finish(seq, "abort")
                    continue
                self._stepped(entry, step_start, step_end, batch.num_tokens, last=sample is not None)
                if sample is None:
                    continue
                self.scheduler.detach(seq)
                task = asyncio.create_task(self._complete(entry, sample, seq.request_id in sending))
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)

    def _stepped(self, entry: _Job, start_ns: int, end_ns: int, batch_tokens: int, last: bool) -> None:
        """Record a request's queue wait at its first step and its forward span at its last."""
        if entry.steps == 0:
            entry.first_step_ns = start_ns
            self.metrics.queue_time.observe((start_ns - entry.arrived_ns) / 1e9)
            self.tracer.start_span("prefill.queue", context=entry.trace_context,
                                   start_time=entry.arrived_ns).end(end_time=start_ns)
        entry.steps += 1
        if not last:
            return
        seq = entry.seq
        self.metrics.forward_time.observe((end_ns - entry.first_step_ns) / 1e9)
        self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        self.metrics.prefix_hit_tokens.inc(seq.num_cached_tokens)
        self.tracer.start_span("prefill.forward", context=entry.trace_context, start_time=entry.first_step_ns,
                               attributes={"pdserve.prompt_tokens": seq.num_prompt_tokens,
                                           "pdserve.cached_tokens": seq.num_cached_tokens,
                                           "pdserve.computed_tokens": len(seq.token_ids) - seq.num_cached_tokens,
                                           "pdserve.steps": entry.steps,
                                           "pdserve.last_batch_tokens": batch_tokens}).end(end_time=end_ns)

    async def _begin_transfers(self, seqs: list[Sequence]) -> set[str]:
        started: set[str] = set()
        for seq in seqs:
            entry = self._jobs[seq.request_id]
            entry.transfer_span = span = self.tracer.start_span(
                "kv.transfer", context=entry.trace_context, kind=trace.SpanKind.PRODUCER,
                attributes={"pdserve.request_id": seq.request_id, "kv.destination": entry.spec.kv_address,
                            "kv.transport": self.sender.transport.name, "kv.blocks": len(seq.block_ids)})
            try:
                await self.sender.begin(seq.request_id, entry.spec.kv_address, seq.block_ids, entry.spec.block_ids,
                                        trace=inject(span))
                started.add(seq.request_id)
            except (TransferError, OSError, ValueError) as e:
                log.warning("request %s: cannot reach KV target %s: %s", seq.request_id, entry.spec.kv_address, e)
                self._end_transfer_span(entry, error=str(e))
                if not entry.future.done():
                    entry.future.set_exception(e)
        return started

    def _end_transfer_span(self, entry: _Job, stats: TransferStats | None = None, error: str | None = None) -> None:
        span, entry.transfer_span = entry.transfer_span, None
        if span is None:
            return
        if stats is not None:
            span.set_attributes({"kv.bytes": stats.nbytes, "kv.layers": stats.layers, "kv.blocks": stats.blocks,
                                 "kv.seconds": stats.seconds, "kv.gbps": stats.gbps})
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end()

    async def _complete(self, entry: _Job, sample, sent: bool) -> None:
        seq = entry.seq
        try:
            if not sent:
                return
            stats = await self.sender.finish(seq.request_id)
            self.metrics.transfer_bytes.inc(stats.nbytes)
            self.metrics.transfer_seconds.observe(stats.seconds)
            self._end_transfer_span(entry, stats)
            if not entry.future.done():
                entry.future.set_result(PrefillResult(sample, seq.num_cached_tokens,
                                                      len(seq.token_ids) - seq.num_cached_tokens, stats.as_dict()))
        except Exception as e:  # noqa: BLE001 - handed to the waiting RPC
            self._end_transfer_span(entry, error=str(e))
            if not entry.future.done():
                entry.future.set_exception(e)
        finally:
            self._end_transfer_span(entry, error="not sent")
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
            self._jobs.pop(seq.request_id, None)
            self._loop.wake()

    async def _fail(self, seq: Sequence, error: Exception) -> None:
        entry = self._jobs.pop(seq.request_id, None)
        if entry is not None:
            self._end_transfer_span(entry, error=str(error))
        await self.sender.abort(seq.request_id, str(error))
        self.scheduler.finish(seq, "abort")
        if entry is not None and not entry.future.done():
            entry.future.set_exception(error)

    def stats(self) -> dict:
        return {
            "role": "prefill", "model": self.model_name,
            "kv_blocks_total": self.allocator.num_blocks, "kv_blocks_used": self.allocator.num_used_blocks,
            "kv_blocks_cached": self.allocator.num_cached_blocks, "block_size": self.allocator.block_size,
            "running": len(self.scheduler.running) + len(self._finishing), "waiting": len(self.scheduler.waiting),
            "tokens_held": 0, "prefix_hit_tokens": self.allocator.prefix_hit_tokens,
            "requests_total": self.requests_total, "max_model_len": self.max_model_len,
            "pending_transfers": len(self._finishing),
        }
