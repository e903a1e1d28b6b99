"""gRPC front of the prefill worker: `PrefillService.Prefill` (unary) and `GetStats`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.config import PrefillConfig
from pdserve.engine.config import EngineConfig
from pdserve.failures import abort
from pdserve.grpc_server import RunningServer, start_server
from pdserve.prefill_service.observe import PrefillObserver
from pdserve.prefill_service.worker import PrefillWorker
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.security import TLSConfig
from pdserve.tracing import Tracing
from pdserve.wire import job_from_proto, result_to_proto

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    def __init__(self, worker: PrefillWorker, address: str) -> None:
        self.worker = worker
        self.address = address

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        try:
            result = await self.worker.prefill(job_from_proto(request))
        except Exception as e:  # noqa: BLE001 - every failure is reported by its row (pdserve.failures)
            await abort(context, e, "prefill", self.address)
        return result_to_proto(result)

    async def WatchCache(
        self, request: worker_pb2.WatchCacheRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.CacheEvent]:
        block_size = self.worker.layout.block_size
        async for snapshot, stored, removed in self.worker.watch_cache():
            yield worker_pb2.CacheEvent(snapshot=snapshot, stored=stored, removed=removed, block_size=block_size)

    async def GetStats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(**self.worker.stats())


async def serve(
    cfg: PrefillConfig, engine: EngineConfig, tls: TLSConfig | None, tracing: Tracing
) -> tuple[RunningServer, PrefillWorker]:
    host, port = cfg.server.host, cfg.server.port
    worker = PrefillWorker(
        engine,
        transport=cfg.engine.kv_transport,
        observer=PrefillObserver(tracing.tracer),
        kv_plane=cfg.engine.kv_plane,
    )
    try:
        await worker.start()
        running = await start_server(
            host,
            port,
            lambda s: worker_pb2_grpc.add_PrefillServiceServicer_to_server(
                PrefillServicer(worker, f"{host}:{port}"), s
            ),
            [worker_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name],
            interceptors=tracing.server_interceptors(),
            enable_reflection=cfg.worker.reflection,
            tls=tls,
            require_client_cert=True,
        )
    except BaseException:
        await worker.stop()  # its model thread would keep the process alive
        raise
    worker.loop.on_fatal = running.fail
    log.info("prefill worker on %s:%d", host, running.port)
    return running, worker
