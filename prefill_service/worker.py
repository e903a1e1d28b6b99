"""The prefill worker: batches prompts under a token budget, runs them, and pushes each layer's KV as it is made.

Prompts queue in the engine loop, whose scheduler admits them in arrival order within the token budget (long
prompts are chunked across steps) and serves repeated prefixes from this worker's own prefix cache. The
connection to the decode worker is made when the request arrives, never inside the loop. In the step where a
prompt's last chunk runs, its transfer is begun and every layer's K/V is handed to the kvtransfer sender right
after that layer is computed, so the wire works while the next layer computes. The request is answered with
the first sampled token once the decode worker confirms all layers landed; only then are this worker's blocks
released (to the prefix cache). What the outside sees of it is `observe.py`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore, StepOutput
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.errors import InvalidParameter
from pdserve.engine.model_runner import LayerHook
from pdserve.engine.sampling_params import SampleOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.failures import QueueFull, WorkerClosing
from pdserve.kernels.kv_layout import LayoutMismatch
from pdserve.kvtransfer.backends import make_transport
from pdserve.kvtransfer.errors import TransferError
from pdserve.kvtransfer.registered import open_plane
from pdserve.kvtransfer.sender import KVSender
from pdserve.prefill_service.metrics import PrefillMetrics
from pdserve.prefill_service.observe import JobWatch, PrefillObserver
from pdserve.prefill_service.prefill_time import PrefillTime
from pdserve.wire import PrefillJob, PrefillResult, worker_stats

log = logging.getLogger(__name__)

CacheEvent = tuple[list[int], list[int]]  # (stored, removed) block hashes


@dataclass
class _Job:
    spec: PrefillJob
    seq: Sequence
    future: asyncio.Future[PrefillResult]
    watch: JobWatch
    sending: bool = False


class PrefillWorker:
    role = "prefill"

    def __init__(
        self,
        cfg: EngineConfig,
        transport: str = "ucx",
        max_queued: int = 1024,
        transfer_timeout: float = 60.0,
        observer: PrefillObserver | None = None,
        kv_plane: str = "auto",
    ) -> None:
        self.observer = observer or PrefillObserver()
        cfg = replace(cfg, speculative_draft="none")  # a prefill worker samples one token: it never speculates
        self.loop = EngineLoop(lambda: EngineCore(cfg), self.role, layer_hooks=self._layer_hooks, on_step=self._on_step)
        self.core = self.loop.core
        self.model_name = self.core.model_config.name
        self.layout = self.core.layout
        registered = open_plane(self.core.kv_cache, self.layout, transport, kv_plane, self.role)
        self.sender = KVSender(
            self.core.kv_cache, self.layout, make_transport(transport), timeout=transfer_timeout, registered=registered
        )
        self.max_queued = max_queued
        self.metrics.bind_state(lambda: self.core.stats().running + len(self._finishing), self.core.stats)
        self.requests_total = 0
        self._jobs: dict[Sequence, _Job] = {}
        self._finishing: set[asyncio.Future] = set()
        self._closing = False
        self.prefill_time = PrefillTime(2.0 * self.core.model_config.linear_params, cfg.max_num_batched_tokens)
        self._watchers: set[asyncio.Queue[CacheEvent | None]] = set()
        self._unsubscribe = self.core.subscribe_cache(self._publish)

    @property
    def metrics(self) -> PrefillMetrics:
        return self.observer.metrics

    async def start(self) -> None:
        self.loop.start()

    async def close(self) -> None:
        """Refuse new prompts (the server is draining); those in flight finish. Cache watchers' streams end now,
        so the server's drain does not wait on (and then cancel) streams that never end by themselves."""
        self._closing = True
        for queue in list(self._watchers):
            queue.put_nowait(None)

    async def stop(self) -> None:
        await self.loop.stop()
        await asyncio.gather(*self._finishing, return_exceptions=True)
        await self.sender.close()
        self._unsubscribe()

    def check(self, job: PrefillJob) -> None:
        self.core.check(job.token_ids, job.params, new_tokens=1, num_prompt_tokens=job.num_prompt_tokens)
        if not 0 < len(job.transfer_id) <= 128 or not job.transfer_secret:
            raise InvalidParameter("kv_target", "kv_target needs a transfer_id (1..128 characters) and a secret")
        if job.skip_blocks * self.layout.block_size >= len(job.token_ids):
            raise InvalidParameter(
                "skip_blocks",
                f"skip_blocks {job.skip_blocks} leaves no block to send for {len(job.token_ids)} tokens "
                f"(blocks of {self.layout.block_size})",
            )
        if job.layout_fingerprint != self.layout.fingerprint:
            raise LayoutMismatch(
                f"KV layout fingerprint {job.layout_fingerprint!r} does not match this worker's "
                f"{self.layout.fingerprint!r} ({self.layout.compatibility_fields()})"
            )

    async def prefill(self, job: PrefillJob) -> PrefillResult:
        """Queue, run and transfer one prompt; returns its first token. Cancelling it frees its blocks."""
        watch = self.observer.job(job)
        result: PrefillResult | None = None
        error: BaseException | None = None
        try:
            result = await self._prefill(job, watch)
            return result
        except BaseException as e:
            error = e
            raise
        finally:
            watch.end(result, error)

    async def _prefill(self, job: PrefillJob, watch: JobWatch) -> PrefillResult:
        if self._closing:
            raise WorkerClosing("prefill worker is shutting down")
        self.check(job)
        stats = self.core.stats()
        if stats.waiting >= self.max_queued:
            raise QueueFull(f"{stats.waiting} prompts already waiting")
        if job.may_refuse and job.start_within > 0:
            # a refusal is a routing hint: only when the caller has somewhere else to send the prompt
            pending = self.core.pending_chunks()
            wait = self.prefill_time.backlog_seconds(pending)
            if wait > job.start_within:
                raise QueueFull(
                    f"a backlog of {sum(n for n, _ in pending)} tokens (~{wait:.0f}s at this worker's measured "
                    f"step cost) would start this prompt after its KV transfer expires ({job.start_within:.0f}s)"
                )
        if not self.sender.connected(job.kv_address):
            with self.observer.connecting(job.kv_address):
                await self.sender.connect(job.kv_address)
        self.requests_total += 1
        seq = Sequence(
            job.request_id, list(job.token_ids), job.params, num_prompt_tokens=job.num_prompt_tokens, prefill_only=True
        )
        await self.loop.constrain(seq)
        entry = _Job(job, seq, asyncio.get_running_loop().create_future(), watch)
        self._jobs[seq] = entry
        self.loop.submit(seq, lambda out: self._on_output(entry, out))
        expiry = None
        if job.start_within > 0:
            expiry = asyncio.get_running_loop().call_later(job.start_within, self._expire, entry)
        try:
            return await asyncio.shield(entry.future)
        finally:
            if expiry is not None:
                expiry.cancel()
            if not entry.future.done():  # cancelled (deadline, or the decode worker gave up)
                entry.future.cancel()
                watch.sent(error="prefill cancelled")
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
            trace = entry.watch.sending(seq, self.sender.transport.name)
            try:
                blocks = seq.block_ids[spec.skip_blocks :]  # the caller holds the KV of those before
                self.sender.begin(spec.transfer_id, spec.kv_address, blocks, spec.transfer_secret, trace)
            except TransferError as e:
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
        self.observer.step(batch, seconds, self._watch_of)
        chunks = [(n, seq.num_computed_tokens - n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        self.prefill_time.observe(chunks, seconds)

    def _expire(self, entry: _Job) -> None:
        """A prompt still queued when its decode worker is about to expire the transfer is dropped, not computed."""
        if entry.seq.status is SequenceStatus.WAITING and self._jobs.get(entry.seq) is entry:
            self._fail(entry, QueueFull(f"not started within {entry.spec.start_within:.0f}s (the KV transfer expires)"))

    def _watch_of(self, seq: Sequence) -> JobWatch | None:
        entry = self._jobs.get(seq)
        return entry.watch if entry is not None else None

    def _on_output(self, entry: _Job, out: StepOutput | BaseException) -> None:
        if isinstance(out, BaseException):
            self._fail(entry, out)
            return
        assert out.sample is not None
        self._spawn(self._complete(entry, out.sample))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    # ---- after the loop ----------------------------------------------------------------------------------

    async def _complete(self, entry: _Job, sample: SampleOutput) -> None:
        """Wait for the decode worker's acknowledgement, answer the request, then free its blocks."""
        seq, spec = entry.seq, entry.spec
        try:
            stats = await self.sender.finish(spec.transfer_id)
            entry.watch.sent(stats)
            if not entry.future.done():
                entry.future.set_result(
                    PrefillResult(
                        sample, seq.num_cached_tokens, len(seq.token_ids) - seq.num_cached_tokens, stats.as_dict()
                    )
                )
        except Exception as e:  # noqa: BLE001 - handed to the waiting RPC
            entry.watch.sent(error=str(e))
            if not entry.future.done():
                entry.future.set_exception(e)
        finally:
            self._jobs.pop(seq, None)
            self.loop.abort(seq)

    def _fail(self, entry: _Job, error: BaseException) -> None:
        """End one request with `error`; the others in its batch go on."""
        self._jobs.pop(entry.seq, None)
        entry.watch.sent(error=str(error))
        self.loop.abort(entry.seq)
        if entry.sending:
            self._spawn(self.sender.abort(entry.spec.transfer_id, str(error)))
        if not entry.future.done():
            entry.future.set_exception(error)

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
        queue: asyncio.Queue[CacheEvent | None] = asyncio.Queue()
        if self._closing:
            queue.put_nowait(None)
        else:
            self._watchers.add(queue)
        try:
            yield True, self.core.cached_hashes(), []
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
        core = self.core.stats()
        return worker_stats(
            core,
            self.role,
            self.model_name,
            self.requests_total,
            running=core.running + len(self._finishing),  # prompts whose KV is still on its way count as running
            queued_tokens=core.queued_tokens + core.prefilling_tokens,
            pending_transfers=len(self._finishing),
        )
