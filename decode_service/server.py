"""gRPC front of the decode worker: `DecodeService.Decode` streams, `GetStats` reports pool and batch state."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc

from pdserve.config import DecodeConfig
from pdserve.decode_service.observe import DecodeObserver
from pdserve.decode_service.worker import DecodeWorker, TokenEvent
from pdserve.discovery import resolve_ipv4, routable
from pdserve.engine.config import EngineConfig
from pdserve.failures import PrefillNotAllowed, abort, pass_on
from pdserve.finish_reason import from_proto, to_proto
from pdserve.grpc_server import RunningServer, open_channel, start_server
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.security import TLSConfig
from pdserve.tracing import Tracing
from pdserve.wire import (
    PrefillJob,
    PrefillResult,
    job_to_proto,
    logprob_to_proto,
    result_from_proto,
    sampling_from_proto,
)

log = logging.getLogger(__name__)


MISS_REFRESH_S = 1.0


class PrefillClients:
    """One channel per prefill worker address; turns a PrefillJob into a Prefill RPC. With `allowed`, only
    those prefill workers are ever dialled (names are resolved, so a DNS name covers its replicas)."""

    def __init__(
        self,
        timeout: float,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tls: TLSConfig | None = None,
        allowed: Sequence[str] = (),
        refresh: float = 10.0,
    ) -> None:
        self.timeout = timeout
        self.interceptors = list(interceptors)
        self.tls = tls
        self.allowed = list(allowed)
        self._resolved: set[str] = set()
        self._resolved_at = float("-inf")
        self._refresh = refresh
        self._stubs: dict[str, worker_pb2_grpc.PrefillServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def allows(self, address: str) -> bool:
        if not self.allowed or address in self.allowed:
            return True
        loop = asyncio.get_running_loop()
        age = loop.time() - self._resolved_at
        # a name not found is looked up again at once (at most every second): a prefill pod that just scaled up
        # is allowed as soon as DNS has it, not up to `refresh` seconds later
        if age > self._refresh or (address not in self._resolved and age > MISS_REFRESH_S):
            found: set[str] = set()
            for name in self.allowed:
                host, _, port = name.rpartition(":")
                try:
                    found.update(f"{ip}:{port}" for ip in await resolve_ipv4(host, int(port)))
                except (OSError, ValueError):
                    continue
            self._resolved, self._resolved_at = found, loop.time()
        return address in self._resolved

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self.tls, self.interceptors)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.PrefillServiceStub(channel)
        return stub

    async def __call__(self, address: str, job: PrefillJob) -> PrefillResult:
        resp = await self._stub(address).Prefill(job_to_proto(job), timeout=self.timeout)
        return result_from_proto(resp, job.params.logprobs is not None)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)


def _response(events: list[TokenEvent], with_logprobs: bool) -> worker_pb2.DecodeResponse:
    msg = worker_pb2.DecodeResponse(
        token_ids=[e.sample.token_id for e in events],
        finish_reason=to_proto(events[-1].finish_reason),
        cached_prompt_tokens=events[0].cached_prompt_tokens,
    )
    if with_logprobs:
        msg.logprobs.extend(logprob_to_proto(e.sample) for e in events)
    return msg


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, worker: DecodeWorker, address: str, prefill: PrefillClients | None) -> None:
        self.worker = worker
        self.address = address  # how the gateway names this worker, for the failure metadata
        self.prefill = prefill

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        rid = request.request_id or uuid.uuid4().hex
        params = sampling_from_proto(request.sampling)
        stream_id = secrets.token_hex(12)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        prefill = request.prefill_address
        first = True
        try:
            if prefill and self.prefill is not None and not await self.prefill.allows(prefill):
                raise PrefillNotAllowed(
                    f"does not dial prefill worker {prefill}: not among those it was started with (--prefill)"
                )
            async for events in self.worker.generate(
                rid,
                list(request.prompt_token_ids),
                params,
                prefill,
                stream_id,
                deadline,
                request.num_prompt_tokens or None,
                prefill_may_refuse=request.prefill_may_refuse,
            ):
                msg = _response(events, params.logprobs is not None)
                if first:
                    msg.stream_id, first = stream_id, False
                yield msg
        except grpc.aio.AioRpcError as e:  # the prefill worker's failure, passed on with its row and party
            await pass_on(context, e, prefill)
        except Exception as e:  # noqa: BLE001 - every failure is reported by its row (pdserve.failures)
            await abort(context, e, "decode", self.address, peer=prefill)

    async def Finish(
        self, request: worker_pb2.FinishRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.FinishResponse:
        reason = from_proto(request.reason) or "stop"
        return worker_pb2.FinishResponse(finished=self.worker.finish(request.stream_id, reason))

    async def GetStats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(**self.worker.stats())


PREFILL_TIMEOUT_S = 600.0  # a Prefill call's deadline: a prompt that long is a stuck worker, not a slow one


async def serve(
    cfg: DecodeConfig, engine: EngineConfig, tls: TLSConfig | None, tracing: Tracing, colocated: bool
) -> tuple[RunningServer, DecodeWorker, PrefillClients | None]:
    """A decode worker (or, `colocated`, one that prefills every prompt itself and runs no KV receiver)."""
    host, port = cfg.server.host, cfg.server.port
    clients = (
        None
        if colocated
        else PrefillClients(PREFILL_TIMEOUT_S, tracing.client_interceptors(), tls, cfg.prefill.addresses)
    )
    worker = DecodeWorker(
        engine,
        clients,
        transport=cfg.engine.kv_transport,
        kv_host="" if colocated else routable(cfg.decode.kv_host or host),
        kv_port=cfg.decode.kv_port,
        kv_bind=host,
        max_queued=cfg.queue.max_queued,
        local_prefill_max_tokens=cfg.local_prefill.local_prefill_max_tokens,
        observer=DecodeObserver(tracing.tracer),
        threads_while_prefilling=cfg.decode.threads_while_prefilling,
        kv_plane=cfg.engine.kv_plane,
    )
    try:
        await worker.start()
        running = await start_server(
            host,
            port,
            lambda s: worker_pb2_grpc.add_DecodeServiceServicer_to_server(
                DecodeServicer(worker, f"{host}:{port}", clients), s
            ),
            [worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name],
            interceptors=tracing.server_interceptors(),
            enable_reflection=cfg.worker.reflection,
            tls=tls,
            require_client_cert=True,
        )
    except BaseException:
        await worker.stop()  # its model thread would keep the process alive
        raise
    worker.loop.on_fatal = running.fail
    if worker.receiver is not None:
        log.info("decode worker on %s:%d, KV receiver at %s", host, running.port, worker.receiver.address)
    else:
        log.info("colocated worker on %s:%d", host, running.port)
    return running, worker, clients


HAND_BACK_S = 10.0  # after the grace: what handed-back streams get to end before the server cancels them


async def drain(running: RunningServer, worker: DecodeWorker, grace: float) -> None:
    """On SIGTERM: NOT_SERVING and no new calls at once; the streams in flight get `grace` seconds to finish,
    then the rest are handed back to the gateway, which moves them to other workers. Returns once every call
    has ended."""
    await running.health.enter_graceful_shutdown()
    stopping = asyncio.ensure_future(running.server.stop(grace=grace + HAND_BACK_S))
    if not await worker.streams_ended(grace):
        handed = worker.hand_back()
        log.info("draining: %d streams still running after %.1f s handed back to the gateway", handed, grace)
    await stopping
