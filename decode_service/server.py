"""gRPC front of the decode worker: `DecodeService.Decode` streams, `GetStats` reports pool and batch state."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Sequence

import grpc

from decode_service.worker import DecodeWorker, PoolExhausted, TokenEvent
from engine.config import EngineConfig
from kvtransfer.errors import TransferError
from pdserve.grpc_server import CHANNEL_OPTIONS, RunningServer, start_server
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


def _response(events: list[TokenEvent], with_logprobs: bool) -> worker_pb2.DecodeResponse:
    msg = worker_pb2.DecodeResponse(token_ids=[e.sample.token_id for e in events],
                                    finish_reason=FINISH_REASONS[events[-1].finish_reason],
                                    cached_prompt_tokens=events[0].cached_prompt_tokens)
    if with_logprobs:
        msg.logprobs.extend(logprob_to_proto(e.sample) for e in events)
    return msg


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        params = sampling_from_proto(request.sampling)
        try:
            async for events in self.worker.generate(rid, list(request.prompt_token_ids), params,
                                                     request.prefill_address):
                yield _response(events, params.logprobs is not None)
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
                prefill_timeout: float = 600.0, tracing: Tracing | None = None, colocated: bool = False,
                local_prefill_max_tokens: int = 0, reflection: bool = False
                ) -> tuple[RunningServer, DecodeWorker, PrefillClients | None]:
    """A decode worker (or, `colocated`, one that prefills every prompt itself and runs no KV receiver)."""
    tracing = tracing or Tracing("pdserve-colocated" if colocated else "pdserve-decode")
    clients = None if colocated else PrefillClients(prefill_timeout, tracing.client_interceptors())
    worker = DecodeWorker(cfg, clients, transport=transport, kv_host=kv_host, max_queued=max_queued,
                          local_prefill_max_tokens=local_prefill_max_tokens, tracer=tracing.tracer)
    await worker.start()
    running = await start_server(
        host, port, lambda s: worker_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(worker), s),
        [worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name],
        interceptors=tracing.server_interceptors(), enable_reflection=reflection)
    worker.loop.on_fatal = running.fail
    if worker.receiver is not None:
        log.info("decode worker on %s:%d, KV receiver at %s", host, running.port, worker.receiver.address)
    else:
        log.info("colocated worker on %s:%d", host, running.port)
    return running, worker, clients
