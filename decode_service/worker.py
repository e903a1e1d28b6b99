"""The decode worker: owns a paged KV cache, has prefill workers fill it, and runs the continuous-batching loop.

A request's life here: the engine reserves blocks for its prompt (queueing in arrival order while the pool is
full), the kvtransfer receiver is told which blocks to expect, a prefill worker runs the prompt and pushes its KV
into them, the first token it sampled is streamed, and the sequence lands in the engine's running batch. This
module only translates between the RPC and the engine; what the outside sees of it is `observe.py`'s.

A prompt may also be prefilled here, in the same loop, mixed with the decode batch (chunked under the token
budget): when the gateway names no prefill worker (it does so for prompts up to the `local_prefill_max_tokens`
this worker reports: conditional disaggregation), and always in colocated mode, where there is no KV receiver at
all. A sequence preempted when blocks run out is recomputed here the same way.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import torch

from pdserve.decode_service.metrics import DecodeMetrics
from pdserve.decode_service.observe import DecodeObserver
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore, StepOutput
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.sampling_params import SampleOutput, SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.failures import HandedBack, WorkerClosing
from pdserve.kvtransfer.backends import make_transport
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.registered import open_plane
from pdserve.wire import PrefillJob, PrefillResult, worker_stats

log = logging.getLogger(__name__)


class _FinishedEarly(Exception):
    """Put in a request's event queue by `finish`: the stream ends as finished, with this reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


PrefillCall = Callable[[str, PrefillJob], Awaitable[PrefillResult]]
Event = StepOutput | BaseException


@dataclass
class TokenEvent:
    sample: SampleOutput
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0


@dataclass
class _Request:
    seq: Sequence
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)


START_WITHIN = 0.75  # of the transfer timeout: what a prefill worker is given to start a prompt


class DecodeWorker:
    """`call_prefill` None means colocated: every prompt is prefilled here and no KV receiver runs."""

    def __init__(
        self,
        cfg: EngineConfig,
        call_prefill: PrefillCall | None = None,
        transport: str = "ucx",
        kv_host: str = "127.0.0.1",
        kv_port: int = 0,
        kv_bind: str | None = None,
        max_queued: int = 256,
        transfer_timeout: float = 60.0,
        local_prefill_max_tokens: int = 0,
        observer: DecodeObserver | None = None,
        threads_while_prefilling: int | None = None,
        kv_plane: str = "auto",
    ) -> None:
        self.role = "decode" if call_prefill is not None else "colocated"
        self.threads_while_prefilling = threads_while_prefilling
        self._threads = cfg.num_threads or torch.get_num_threads()
        self.observer = observer or DecodeObserver()
        self.loop = EngineLoop(
            lambda: EngineCore(cfg, receives_kv=call_prefill is not None, max_reserving=max_queued),
            self.role,
            on_step=self.observer.step,
            step_threads=self._step_threads if threads_while_prefilling else None,
        )
        self.core = self.loop.core
        self.model_config = self.core.model_config
        self.model_name = self.model_config.name
        self.call_prefill = call_prefill
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.receiver: KVReceiver | None = None
        if call_prefill is not None:
            self.receiver = KVReceiver(
                self.core.kv_cache,
                self.core.layout,
                make_transport(transport),
                kv_bind or kv_host,
                kv_port,
                timeout=transfer_timeout,
                advertise=kv_host,
                registered=open_plane(self.core.kv_cache, self.core.layout, transport, kv_plane, self.role),
            )
        self.metrics.bind_state(self.core.stats)
        self.requests_total = 0
        self.local_prefills_total = 0
        self.remote_prefills_total = 0
        self._streams: dict[str, _Request] = {}
        self._closing = False

    @property
    def metrics(self) -> DecodeMetrics:
        return self.observer.metrics

    def _step_threads(self) -> int:
        """Fewer torch threads while a prefill worker computes prompts for this one: on a machine they share,
        two OpenMP teams that each want every core stall each other's steps (decode steps of 4 sequences took
        180-600 ms while a prefill ran, against 15 ms alone)."""
        if self.threads_while_prefilling and self.core.num_awaiting_kv:
            return self.threads_while_prefilling
        return self._threads

    async def start(self) -> None:
        if self.receiver is not None:
            await self.receiver.start()
        self.loop.start()

    async def stop(self) -> None:
        await self.loop.stop()
        if self.receiver is not None:
            await self.receiver.close()

    def check(self, token_ids: list[int], params: SamplingParams, num_prompt_tokens: int | None = None) -> None:
        """InvalidParameter for requests that can never run here."""
        self.core.check(token_ids, params, num_prompt_tokens=num_prompt_tokens)

    # ---- one request -------------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prefill_address: str = "",
        stream_id: str = "",
        deadline: float | None = None,
        num_prompt_tokens: int | None = None,
        prefill_may_refuse: bool = False,
    ) -> AsyncIterator[list[TokenEvent]]:
        """Stream a request's tokens, in lists of what is ready (more than one when the reader lags). Without a
        `prefill_address` (or colocated) the prompt is prefilled here. Leaving the iterator early (cancel, error)
        frees everything the request held; `finish(stream_id, reason)` ends it early as a normal finish.
        `deadline` (time.monotonic()) tells a deadline from a cancellation. `num_prompt_tokens` below
        `len(prompt_ids)`: the rest were generated elsewhere (a moved stream) and count as output here.
        `prefill_may_refuse`: the caller could prefill the prompt elsewhere, so a busy prefill worker may refuse it."""
        if self._closing:
            raise WorkerClosing(f"{self.role} worker is shutting down")
        self.check(prompt_ids, params, num_prompt_tokens)
        seq = Sequence(request_id, list(prompt_ids), params, num_prompt_tokens=num_prompt_tokens or -1)
        remote = prefill_address if self.receiver is not None else ""
        watch = self.observer.request(seq, remote)
        req = _Request(seq)
        if stream_id:
            self._streams[stream_id] = req
        self.requests_total += 1
        error: BaseException | None = None
        try:
            with watch.admitting():
                await self.loop.constrain(seq)
                if remote:
                    await self.loop.reserve(seq)
            with watch.first_token():
                if remote:
                    events = [await self._prefill_remotely(req, remote, prefill_may_refuse)]
                else:
                    self.local_prefills_total += 1
                    self.loop.submit(seq, req.events.put_nowait)
                    events = await self._next(req)
            events[0].cached_prompt_tokens = seq.num_cached_tokens
            while True:
                watch.tokens(len(events))
                yield events
                if events[-1].finish_reason:
                    break
                events = await self._next(req)
        except _FinishedEarly:
            pass
        except BaseException as e:
            error = e
            raise
        finally:
            self._streams.pop(stream_id, None)
            self.loop.abort(seq)
            watch.end(error, deadline)

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
            assert item.sample is not None
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

    async def streams_ended(self, timeout: float) -> bool:
        """Whether every stream in flight ended within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._streams and loop.time() < end:
            await asyncio.sleep(min(0.05, max(0.0, end - loop.time())))
        return not self._streams

    def hand_back(self) -> int:
        """End every stream in flight unfinished (HandedBack), for the gateway to move; how many there were."""
        for req in self._streams.values():
            req.events.put_nowait(HandedBack("draining: the stream is handed back to be moved"))
        return len(self._streams)

    async def _prefill_remotely(self, req: _Request, address: str, may_refuse: bool) -> TokenEvent:
        """Have the prefill worker at `address` compute every token of req's sequence into its reserved blocks,
        then run the sequence here from its first sampled token."""
        assert self.receiver is not None and self.call_prefill is not None
        seq = req.seq
        self.remote_prefills_total += 1
        transfer_id, secret = uuid.uuid4().hex, secrets.token_hex(16)
        held = seq.num_computed_tokens // self.core.layout.block_size  # the reservation's prefix-cache hits
        arrived = self.receiver.expect(transfer_id, seq.block_ids[held:], secret)
        job = PrefillJob(
            seq.request_id,
            list(seq.token_ids),
            seq.num_prompt_tokens,
            seq.params,
            self.receiver.address,
            self.core.layout.fingerprint,
            transfer_id,
            secret,
            # with somewhere else to go, the prefill worker refuses what it cannot start before this: a refusal,
            # not an expiry, so the gateway retries elsewhere at once and the prompt is computed only once
            start_within=START_WITHIN * self.receiver.timeout,
            may_refuse=may_refuse,
            skip_blocks=held,
        )
        call = asyncio.ensure_future(self.call_prefill(address, job))
        try:
            # the transfer may expire (no sender began it in time) while the call still waits in a queue there:
            # give up on the call then, which cancels the job on the prefill worker
            await asyncio.wait([call, arrived], return_when=asyncio.FIRST_COMPLETED)
            if not call.done() and arrived.exception() is not None:
                raise arrived.exception()  # type: ignore[misc]
            result = await call
            self.observer.transferred(await asyncio.wait_for(asyncio.shield(arrived), self.receiver.timeout))
        finally:
            if not call.done():  # the transfer expired, or this request was cancelled: so is its prefill
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
            writing = self.receiver.cancel(transfer_id)
            if writing is not None:  # bytes still landing in these blocks: free them only once that ends
                await asyncio.shield(writing)
        self.loop.land(seq, result.sample.token_id, result.cached_tokens, req.events.put_nowait)
        return TokenEvent(result.sample, seq.finish_reason)

    # ---- figures -----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        core = self.core.stats()
        return worker_stats(
            core,
            self.role,
            self.model_name,
            self.requests_total,
            waiting=core.waiting + core.reserving + core.awaiting_kv,  # reserved blocks waiting for their KV too
            kv_address=self.receiver.address if self.receiver is not None else "",
            pending_transfers=self.receiver.num_pending if self.receiver is not None else 0,
            local_prefills_total=self.local_prefills_total,
            remote_prefills_total=self.remote_prefills_total,
            local_prefill_max_tokens=self.local_prefill_max_tokens if self.receiver else 0,
        )
