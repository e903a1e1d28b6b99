"""The prefill worker: batches prompts under a token budget, runs them, and pushes each layer's KV as it is made.

Prompts queue in the engine loop, whose scheduler admits them in arrival order within the token budget (long
prompts are chunked across steps) and serves repeated prefixes from this worker's own prefix cache. The
connection to the decode worker is made when the request arrives, never inside the loop. In the step where a
prompt's last chunk runs, its transfer is begun and every layer's K/V is handed to the kvtransfer sender right
after that layer is computed, so the wire works while the next layer computes. The request is answered with
the first sampled token once the decode worker confirms all layers landed; only then are this worker's blocks
released (to the prefix cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore, StepOutput
from pdserve.engine.engine_loop import EngineLoop, EngineStopped
from pdserve.engine.model_runner import LayerHook
from pdserve.engine.sampler import SampleOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.kernels.kv_layout import LayoutMismatch
from pdserve.kvtransfer.errors import TransferError
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.stats import TransferStats
from pdserve.kvtransfer.transports import make_transport
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import inject, trace_id
from pdserve.wire import PrefillJob, PrefillResult
from pdserve.prefill_service.metrics import PrefillMetrics

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOGGER)


class QueueFull(RuntimeError):
    """Too many prompts already waiting."""


@dataclass
class _Job:
    spec: PrefillJob
    seq: Sequence
    future: asyncio.Future
    trace_context: otel_context.Context | None = None
    arrived_ns: int = 0  # wall clock, for spans recorded after the fact
    first_step_ns: int = 0
    steps: int = 0
    sending: bool = False
    transfer_span: trace.Span | None = None


class PrefillWorker:
    role = "prefill"

    def __init__(self, cfg: EngineConfig, transport: str = "ucx", max_queued: int = 1024,
                 transfer_timeout: float = 60.0, tracer: trace.Tracer | None = None,
                 metrics: PrefillMetrics | None = None) -> None:
        self.loop = EngineLoop(lambda: EngineCore(cfg), self.role, layer_hooks=self._layer_hooks,
                               on_step=self._on_step)
        self.core = self.loop.core
        self.model_name = self.core.model_config.name
        self.layout = self.core.layout
        self.sender = KVSender(self.core.runner.kv_cache, self.layout, make_transport(transport),
                               timeout=transfer_timeout)
        self.max_queued = max_queued
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or PrefillMetrics()
        self.metrics.bind_state(lambda: len(self.core.scheduler.running) + len(self._finishing),
                                lambda: len(self.core.scheduler.waiting), self.core.allocator)
        self.requests_total = 0
        self._jobs: dict[Sequence, _Job] = {}
        self._finishing: set[asyncio.Task] = set()
        self._closing = False
        self._watchers: set[asyncio.Queue] = set()
        self.core.allocator.on_cache_change = self._publish

    async def start(self) -> None:
        self.loop.start()

    async def close(self) -> None:
        """Refuse new prompts (the server is draining); those in flight finish."""
        self._closing = True

    async def stop(self) -> None:
        await self.loop.stop()
        await asyncio.gather(*self._finishing, return_exceptions=True)
        await self.sender.close()

    def check(self, job: PrefillJob) -> None:
        n = len(job.token_ids)
        self.core.check(job.token_ids, job.params, new_tokens=1)
        if not 0 < job.num_prompt_tokens <= n:
            raise ValueError("num_prompt_tokens must be in [1, len(token_ids)]")
        if len(job.block_ids) != self.core.allocator.blocks_needed(n):
            raise ValueError(f"KV target has {len(job.block_ids)} blocks for {n} tokens")
        if not 0 < len(job.transfer_id) <= 128 or not job.transfer_secret:
            raise ValueError("kv_target needs a transfer_id (1..128 characters) and a secret")
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
        if self._closing:
            raise EngineStopped("prefill worker is shutting down")
        self.check(job)
        if len(self.core.scheduler.waiting) >= self.max_queued:
            raise QueueFull(f"{len(self.core.scheduler.waiting)} prompts already waiting")
        arrived_ns = time.time_ns()
        if not self.sender.connected(job.kv_address):
            with self.tracer.start_as_current_span("kv.connect", attributes={"kv.destination": job.kv_address}):
                await self.sender.connect(job.kv_address)
        self.requests_total += 1
        seq = Sequence(job.request_id, list(job.token_ids), job.params, num_prompt_tokens=job.num_prompt_tokens,
                       prefill_only=True)
        entry = _Job(job, seq, asyncio.get_running_loop().create_future(),
                     trace_context=otel_context.get_current(), arrived_ns=arrived_ns)
        self._jobs[seq] = entry
        self.loop.submit(seq, lambda out: self._on_output(entry, out))
        try:
            return await asyncio.shield(entry.future)
        finally:
            if not entry.future.done():  # cancelled (deadline, or the decode worker gave up)
                entry.future.cancel()
                self._end_transfer_span(entry, error="prefill cancelled")
                self._jobs.pop(seq, None)
                self.loop.abort(seq)
                await self.sender.abort(job.transfer_id, "prefill cancelled")

    # ---- inside the loop ---------------------------------------------------------------------------------

    def _layer_hooks(self, batch: ScheduledBatch) -> LayerHook | None:
        """Begin the transfers of the prompts this step completes; their layers are pushed as they are made."""
        sending: list[str] = []
        for i, seq in enumerate(batch.seqs):
            entry = self._jobs.get(seq)
            if entry is None or not batch.samples(i):
                continue
            spec = entry.spec
            entry.transfer_span = span = self.tracer.start_span(
                "kv.transfer", context=entry.trace_context, kind=trace.SpanKind.PRODUCER,
                attributes={"pdserve.request_id": seq.request_id, "kv.destination": spec.kv_address,
                            "kv.transport": self.sender.transport.name, "kv.blocks": len(seq.block_ids)})
            try:
                self.sender.begin(spec.transfer_id, spec.kv_address, seq.block_ids, spec.block_ids,
                                  spec.transfer_secret, trace=inject(span))
            except (TransferError, ValueError) as e:
                log.warning("request %s: cannot send KV to %s: %s", seq.request_id, spec.kv_address, e)
                self._fail(entry, e)
                continue
            entry.sending = True
            sending.append(spec.transfer_id)
        if not sending:
            return None

        def push(layer: int) -> None:
            for transfer_id in sending:
                self.sender.send_layer(transfer_id, layer)

        return push

    def _on_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """Record each request's queue wait at its first step and its forward span at its last."""
        end_ns = time.time_ns()
        start_ns = end_ns - int(seconds * 1e9)
        self.metrics.step_time.observe(seconds)
        self.metrics.batch_tokens.observe(batch.num_tokens)
        for i, seq in enumerate(batch.seqs):
            entry = self._jobs.get(seq)
            if entry is None:
                continue
            if entry.steps == 0:
                entry.first_step_ns = start_ns
                self.metrics.queue_time.observe((start_ns - entry.arrived_ns) / 1e9)
                self.tracer.start_span("prefill.queue", context=entry.trace_context,
                                       start_time=entry.arrived_ns).end(end_time=start_ns)
            entry.steps += 1
            if not batch.samples(i):
                continue
            self.metrics.forward_time.observe((end_ns - entry.first_step_ns) / 1e9)
            self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
            self.metrics.prefix_hit_tokens.inc(seq.num_cached_tokens)
            self.tracer.start_span("prefill.forward", context=entry.trace_context, start_time=entry.first_step_ns,
                                   attributes={"pdserve.prompt_tokens": seq.num_prompt_tokens,
                                               "pdserve.cached_tokens": seq.num_cached_tokens,
                                               "pdserve.computed_tokens": len(seq.token_ids) - seq.num_cached_tokens,
                                               "pdserve.steps": entry.steps,
                                               "pdserve.last_batch_tokens": batch.num_tokens}).end(end_time=end_ns)

    def _on_output(self, entry: _Job, out: StepOutput | BaseException) -> None:
        if isinstance(out, BaseException):
            self._fail(entry, out)
            return
        task = asyncio.create_task(self._complete(entry, out.sample), name=f"prefill-done-{entry.seq.seq_id}")
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    # ---- after the loop ----------------------------------------------------------------------------------

    async def _complete(self, entry: _Job, sample: SampleOutput) -> None:
        """Wait for the decode worker's acknowledgement, answer the request, then free its blocks."""
        seq, spec = entry.seq, entry.spec
        try:
            stats = await self.sender.finish(spec.transfer_id)
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
            self._jobs.pop(seq, None)
            self.loop.abort(seq)

    def _fail(self, entry: _Job, error: BaseException) -> None:
        """End one request with `error`; the others in its batch go on."""
        self._jobs.pop(entry.seq, None)
        self._end_transfer_span(entry, error=str(error))
        self.loop.abort(entry.seq)
        if entry.sending:
            task = asyncio.ensure_future(self.sender.abort(entry.spec.transfer_id, str(error)))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)
        if not entry.future.done():
            entry.future.set_exception(error)

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

    # ---- what the prefix cache holds ---------------------------------------------------------------------

    MAX_WATCH_BACKLOG = 4096

    def _publish(self, stored: list[int], removed: list[int]) -> None:
        for queue in list(self._watchers):
            if queue.qsize() >= self.MAX_WATCH_BACKLOG:  # a watcher that stopped reading: drop it (it resubscribes)
                self._watchers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait((stored, removed))

    async def watch_cache(self) -> AsyncIterator[tuple[bool, list[int], list[int]]]:
        """(snapshot, stored, removed): first every hash the prefix cache holds, then each change, merged while
        the reader lags."""
        queue: asyncio.Queue = asyncio.Queue()
        self._watchers.add(queue)
        try:
            yield True, self.core.allocator.cached_hashes(), []
            while True:
                item = await queue.get()
                if item is None:
                    return
                stored, removed = set(item[0]), set(item[1])
                while not queue.empty():
                    more = queue.get_nowait()
                    if more is None:
                        return
                    stored = (stored - set(more[1])) | set(more[0])
                    removed = (removed - set(more[0])) | set(more[1])
                yield False, list(stored), list(removed)
        finally:
            self._watchers.discard(queue)

    def stats(self) -> dict:
        return {
            **self.core.stats(), "role": self.role, "model": self.model_name,
            "running": len(self.core.scheduler.running) + len(self._finishing),
            "requests_total": self.requests_total, "pending_transfers": len(self._finishing),
            "queued_tokens": sum(len(s.token_ids) - s.num_computed_tokens
                                 for s in (*self.core.scheduler.waiting, *self.core.scheduler.running)),
        }
