"""The colocated worker: prefill and decode in one process, no KV transfer.

What vLLM and SGLang do by default: one continuous-batching loop whose every forward mixes prompt chunks of new
requests (under the token budget) with one decode token per running sequence. It serves `DecodeService`, so
the gateway routes to it exactly as to a decode worker (`pdserve up --colocated`); it is here so disaggregation
can be compared against the same engine without it. All scheduler state is touched on the event loop only;
the forward runs on an executor thread, and a request cancelled mid-step is released after that step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from opentelemetry import trace

from decode_service.metrics import DecodeMetrics
from decode_service.worker import PoolExhausted, TokenEvent
from engine.block_allocator import BlockAllocator
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.request_check import check_request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_loop import StepLoop
from pdserve.logs import REQUEST_LOGGER, log_request
from pdserve.tracing import trace_id

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOGGER)


class ColocatedWorker:
    role = "colocated"

    def __init__(self, cfg: EngineConfig, max_queued: int = 256, tracer: trace.Tracer | None = None,
                 metrics: DecodeMetrics | None = None) -> None:
        self.runner = ModelRunner.from_config(cfg)
        self.model_config = self.runner.config
        self.model_name = self.model_config.name
        self.max_model_len = min(cfg.max_model_len or 1 << 62, self.model_config.max_position_embeddings)
        spec = self.runner.spec
        self.allocator = BlockAllocator(spec.num_blocks, spec.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.max_queued = max_queued
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or DecodeMetrics()
        self.metrics.bind_state(lambda: len(self.scheduler.running), lambda: len(self.scheduler.waiting),
                                self.allocator)
        self.requests_total = 0
        self.preemptions_total = 0
        self._queues: dict[str, asyncio.Queue] = {}
        self._seqs: dict[str, Sequence] = {}
        self._loop = StepLoop("colocated", self._run_loop)

    async def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       prefill_address: str = "") -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens; leaving early frees its blocks. `prefill_address` is ignored."""
        check_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len,
                      self.allocator.num_blocks * self.allocator.block_size)
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        if len(self.scheduler.waiting) >= self.max_queued:
            raise PoolExhausted(f"{len(self.scheduler.waiting)} requests already waiting")
        t0, tid = time.perf_counter(), trace_id()
        self.requests_total += 1
        seq = Sequence(request_id, list(prompt_ids), params)
        queue: asyncio.Queue = asyncio.Queue()
        self._seqs[request_id], self._queues[request_id] = seq, queue
        self.scheduler.add(seq)
        self._loop.wake()
        status, ttft, last = "ok", None, 0.0
        stream = self.tracer.start_span("colocated.generate", attributes={"pdserve.request_id": request_id,
                                                                          "pdserve.prompt_tokens": len(prompt_ids)})
        try:
            while True:
                event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                now = time.perf_counter() - t0
                if ttft is None:
                    ttft = now
                    self.metrics.ttft.observe(now)
                    event.cached_prompt_tokens = seq.num_cached_tokens
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                yield event
                if event.finish_reason:
                    self.metrics.e2e.observe(time.perf_counter() - t0)
                    return
        except BaseException as e:
            status = "cancelled" if isinstance(e, (asyncio.CancelledError, GeneratorExit)) else "error"
            raise
        finally:
            self._release(seq)
            self.metrics.requests.labels(status).inc()
            stream.set_attributes({"pdserve.completion_tokens": seq.num_output_tokens,
                                   "pdserve.finish_reason": seq.finish_reason or status})
            stream.end()
            log_request(request_log, request_id=request_id, trace_id=tid, status=status,
                        finish_reason=seq.finish_reason or "", prompt_tokens=seq.num_prompt_tokens,
                        cached_tokens=seq.num_cached_tokens, completion_tokens=seq.num_output_tokens,
                        ttft_s=round(ttft, 4) if ttft is not None else None,
                        e2e_s=round(time.perf_counter() - t0, 4))

    def _release(self, seq: Sequence) -> None:
        self._queues.pop(seq.request_id, None)
        self._seqs.pop(seq.request_id, None)
        if seq.request_id in self._loop.in_step:
            return  # the loop finishes it after the forward in flight
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "abort")
            self._loop.wake()

    async def _run_loop(self) -> None:
        while not self._loop.closing:
            if not self.scheduler.has_work:
                await self._loop.sleep()
                continue
            batch = self.scheduler.schedule()
            self.preemptions_total += len(batch.preempted)
            self.metrics.preemptions.inc(len(batch.preempted))
            if not batch.seqs:
                self._fail_unschedulable()
                await self._loop.sleep()
                continue
            t0 = time.perf_counter()
            try:
                samples = await self._loop.step(self.runner.execute, batch)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the worker
                log.exception("colocated step failed")
                for seq in batch.seqs:
                    self._deliver(seq, e)
                continue
            self.metrics.step_time.observe(time.perf_counter() - t0)
            self.metrics.batch_size.observe(len(batch.seqs))
            self.scheduler.commit(batch)
            for seq, sample in zip(batch.seqs, samples):
                queue = self._queues.get(seq.request_id)
                if queue is None:  # cancelled during the step
                    if seq.status is not SequenceStatus.FINISHED:
                        self.scheduler.finish(seq, "abort")
                    continue
                if sample is None:
                    continue
                seq.append(sample, self.model_config.eos_token_ids, self.max_model_len)
                self.metrics.generation_tokens.inc()
                queue.put_nowait(TokenEvent(sample, seq.finish_reason))
                if seq.finish_reason:
                    self.scheduler.finish(seq, seq.finish_reason)
            await asyncio.sleep(0)  # let RPC handlers run between steps

    def _fail_unschedulable(self) -> None:
        """Nothing runs and nothing can be admitted: the head of the queue does not fit the pool."""
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        self._deliver(seq, PoolExhausted(f"request needs more KV blocks than the pool has free "
                                         f"({self.allocator.num_free_blocks})"))

    def _deliver(self, seq: Sequence, error: BaseException) -> None:
        queue = self._queues.get(seq.request_id)
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "abort")
        if queue is not None:
            queue.put_nowait(error)

    def stats(self) -> dict:
        return {
            "role": self.role, "model": self.model_name,
            "kv_blocks_total": self.allocator.num_blocks, "kv_blocks_used": self.allocator.num_used_blocks,
            "kv_blocks_cached": self.allocator.num_cached_blocks, "block_size": self.allocator.block_size,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "tokens_held": sum(s.num_computed_tokens for s in self.scheduler.running),
            "prefix_hit_tokens": self.allocator.prefix_hit_tokens, "requests_total": self.requests_total,
            "max_model_len": self.max_model_len, "pending_transfers": 0,
            "preemptions_total": self.preemptions_total,
        }
