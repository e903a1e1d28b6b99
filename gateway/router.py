"""Which prefill and which decode worker serve the next request.

Static lists of workers (flags, env or a config file) are polled for health and load with `GetStats`. A decode
worker is chosen by free KV blocks and running requests, a prefill worker by queue length; both scores also
count the requests this gateway has just sent there, since polled figures lag. A worker whose call fails with
UNAVAILABLE is treated as down until a poll succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence

import grpc

from pdserve.grpc_server import CHANNEL_OPTIONS
from protos import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class NoWorkerAvailable(RuntimeError):
    pass


@dataclass
class WorkerHandle:
    address: str
    role: str
    channel: grpc.aio.Channel
    stub: object
    healthy: bool = False
    stats: worker_pb2.WorkerStats = field(default_factory=worker_pb2.WorkerStats)
    inflight: int = 0

    @property
    def decode_score(self) -> tuple:
        free = self.stats.kv_blocks_total - self.stats.kv_blocks_used
        return (self.stats.running + self.stats.waiting + self.inflight, -free)

    @property
    def prefill_score(self) -> tuple:
        return (self.stats.waiting + self.stats.running + self.inflight,)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], poll_interval: float = 1.0,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode worker address")
        self.poll_interval = poll_interval
        self.interceptors = list(interceptors)
        self.prefill = [self._handle(a, "prefill") for a in prefill]
        self.decode = [self._handle(a, "decode") for a in decode]
        self._poller: asyncio.Task | None = None

    def _handle(self, address: str, role: str) -> WorkerHandle:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=self.interceptors or None)
        stub = (worker_pb2_grpc.PrefillServiceStub if role == "prefill" else worker_pb2_grpc.DecodeServiceStub)(channel)
        return WorkerHandle(address, role, channel, stub)

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.prefill + self.decode

    async def start(self) -> None:
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever(), name="router-poll")

    async def close(self) -> None:
        if self._poller:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.workers), return_exceptions=True)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            await self.poll()

    async def poll(self) -> None:
        async def one(w: WorkerHandle) -> None:
            try:
                w.stats = await w.stub.GetStats(worker_pb2.StatsRequest(), timeout=max(self.poll_interval, 1.0))
                if not w.healthy:
                    log.info("%s worker %s is up", w.role, w.address)
                w.healthy = True
            except grpc.aio.AioRpcError as e:
                if w.healthy:
                    log.warning("%s worker %s is down: %s", w.role, w.address, e.code().name)
                w.healthy = False

        await asyncio.gather(*(one(w) for w in self.workers))

    async def wait_ready(self, timeout: float) -> None:
        """Until at least one worker of each role answers."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (any(w.healthy for w in self.prefill) and any(w.healthy for w in self.decode)):
            if loop.time() > deadline:
                raise NoWorkerAvailable("no healthy prefill and decode workers within "
                                        f"{timeout:.0f}s: {[w.address for w in self.workers]}")
            await asyncio.sleep(0.2)
            await self.poll()

    def pick(self, exclude: set[str] = frozenset()) -> tuple[WorkerHandle, WorkerHandle]:
        decode = [w for w in self.decode if w.healthy and w.address not in exclude]
        prefill = [w for w in self.prefill if w.healthy and w.address not in exclude]
        if not decode or not prefill:
            raise NoWorkerAvailable("no healthy " + ("decode" if not decode else "prefill") + " worker")
        return min(decode, key=lambda w: w.decode_score), min(prefill, key=lambda w: w.prefill_score)

    def mark_down(self, address: str) -> None:
        for w in self.workers:
            if w.address == address:
                w.healthy = False

    @property
    def max_model_len(self) -> int:
        lens = [w.stats.max_model_len for w in self.decode if w.stats.max_model_len]
        return min(lens) if lens else 0
