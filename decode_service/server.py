"""gRPC front of the decode worker: `DecodeService.Decode` streams, `GetStats` reports pool and batch state."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Sequence

import grpc

from decode_service.colocated_worker import ColocatedWorker
from decode_service.worker import DecodeWorker, PoolExhausted, TokenEvent
from engine.config import EngineConfig
from kvtransfer.errors import TransferError
from pdserve.grpc_server import CHANNEL_OPTIONS, start_server
from pdserve.tracing import Tracing
from pdserve.wire import (FINISH_REASONS, PrefillJob, PrefillResult, job_to_proto, logprob_to_proto,
                          result_from_proto, sampling_from_proto)
from protos import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillClients:
    """One channel per prefill worker address; turns a PrefillJob into a Prefill RPC."""

    def __init__(self, timeout: float, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> None:
        self.timeout = timeout
        self.interceptors = list(interceptors)
        self._stubs: dict[str, worker_pb2_grpc.PrefillServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                                interceptors=self.interceptors or None)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.PrefillServiceStub(channel)
        return stub

    async def __call__(self, address: str, job: PrefillJob) -> PrefillResult:
        resp = await self._stub(address).Prefill(job_to_proto(job), timeout=self.timeout)
        return result_from_proto(resp, job.params.logprobs is not None)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)


def _response(event: TokenEvent, with_logprobs: bool) -> worker_pb2.DecodeResponse:
    msg = worker_pb2.DecodeResponse(token_ids=[event.sample.token_id], finish_reason=FINISH_REASONS[event.finish_reason],
                                    cached_prompt_tokens=event.cached_prompt_tokens)
    if with_logprobs:
        msg.logprobs.append(logprob_to_proto(event.sample))
    return msg


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    """Serves a DecodeWorker (which pulls KV from prefill workers) or a ColocatedWorker (which prefills itself)."""

    def __init__(self, worker: DecodeWorker | ColocatedWorker) -> None:
        self.worker = worker
        self.needs_prefill = isinstance(worker, DecodeWorker)

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        params = sampling_from_proto(request.sampling)
        if self.needs_prefill and not request.prefill_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill_address is required")
        try:
            async for event in self.worker.generate(rid, list(request.prompt_token_ids), params,
                                                    request.prefill_address):
                yield _response(event, params.logprobs is not None)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PoolExhausted as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except grpc.aio.AioRpcError as e:
            # the prefill worker's status, passed on (UNAVAILABLE lets the gateway retry elsewhere)
            await context.abort(e.code(), f"prefill worker {request.prefill_address}: {e.details()}")
        except TransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")

    async def GetStats(self, request, context) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(**self.worker.stats())


async def serve(cfg: EngineConfig, host: str, port: int, transport: str, kv_host: str, max_queued: int = 256,
                prefill_timeout: float = 600.0, tracing: Tracing | None = None
                ) -> tuple[grpc.aio.Server, int, DecodeWorker, PrefillClients]:
    tracing = tracing or Tracing("pdserve-decode")
    clients = PrefillClients(prefill_timeout, tracing.client_interceptors())
    worker = DecodeWorker(cfg, clients, transport=transport, host=kv_host, max_queued=max_queued,
                          tracer=tracing.tracer)
    await worker.start()
    server, bound, _ = await start_server(
        host, port, lambda s: worker_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(worker), s),
        [worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name],
        interceptors=tracing.server_interceptors())
    log.info("decode worker on %s:%d, KV receiver at %s", host, bound, worker.receiver.address)
    return server, bound, worker, clients


async def serve_colocated(cfg: EngineConfig, host: str, port: int, max_queued: int = 256,
                          tracing: Tracing | None = None) -> tuple[grpc.aio.Server, int, ColocatedWorker]:
    """A worker that prefills and decodes itself, behind the same DecodeService."""
    tracing = tracing or Tracing("pdserve-colocated")
    worker = ColocatedWorker(cfg, max_queued=max_queued, tracer=tracing.tracer)
    await worker.start()
    server, bound, _ = await start_server(
        host, port, lambda s: worker_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(worker), s),
        [worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name],
        interceptors=tracing.server_interceptors())
    log.info("colocated worker on %s:%d", host, bound)
    return server, bound, worker
