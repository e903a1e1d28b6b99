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

from pdserve.discovery import Resolver, resolve_ipv4
from pdserve.grpc_server import open_channel
from pdserve.security import TLSConfig
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
    """Knows every worker and its polled load; picks the least loaded decode and prefill worker per request.

    With `discover`, the given addresses are names: each poll resolves them and adds workers that appeared
    (scaled up) and drops those that left once nothing is in flight on them.
    """

    def __init__(self, prefill: list[str], decode: list[str], poll_interval: float = 1.0,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = (), discover: bool = False,
                 resolve: Resolver = resolve_ipv4, probe_interval: float = 0.5, tls: TLSConfig | None = None) -> None:
        if not decode:
            raise ValueError("need at least one decode worker address (and prefill workers, unless the decode "
                             "workers are colocated)")
        self.poll_interval = poll_interval
        self.probe_interval = min(probe_interval, poll_interval)
        self.interceptors = list(interceptors)
        self.tls = tls
        self.discover = discover
        self._resolve = resolve
        self._names = {"prefill": list(prefill), "decode": list(decode)}
        self.prefill = [] if discover else [self._handle(a, "prefill") for a in prefill]
        self.decode = [] if discover else [self._handle(a, "decode") for a in decode]
        self._leaving: set[str] = set()
        self._poller: asyncio.Task | None = None

    def _handle(self, address: str, role: str) -> WorkerHandle:
        channel = open_channel(address, self.tls, self.interceptors)
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
        """Every worker each `poll_interval`; workers that are down (or not up yet) every `probe_interval`, so
        one that comes (back) up takes traffic within a fraction of a second."""
        loop = asyncio.get_running_loop()
        next_full = loop.time() + self.poll_interval
        while True:
            await asyncio.sleep(min(self.probe_interval, max(0.0, next_full - loop.time())))
            if loop.time() >= next_full:
                next_full = loop.time() + self.poll_interval
                await self.poll()
            else:
                await self.poll(only_down=True)

    def counts(self) -> dict[tuple[str, str], int]:
        """(role, "healthy" | "down") -> how many workers."""
        out = {(role, state): 0 for role in ("prefill", "decode") for state in ("healthy", "down")}
        for w in self.workers:
            out[(w.role, "healthy" if w.healthy else "down")] += 1
        return out

    async def _rediscover(self) -> None:
        for role, names in self._names.items():
            found: set[str] = set()
            for name in names:
                host, port = name.rsplit(":", 1)
                try:
                    found.update(f"{ip}:{port}" for ip in await self._resolve(host, int(port)))
                except OSError as e:
                    log.debug("cannot resolve %s: %s", name, e)
            handles = self.prefill if role == "prefill" else self.decode
            known = {w.address for w in handles}
            for address in sorted(found - known):
                log.info("discovered %s worker %s", role, address)
                handles.append(self._handle(address, role))
            self._leaving -= found
            for w in [w for w in handles if w.address not in found]:
                w.healthy = False
                self._leaving.add(w.address)
                if w.inflight == 0:
                    self._leaving.discard(w.address)
                    log.info("%s worker %s left", role, w.address)
                    handles.remove(w)
                    await w.channel.close()

    async def poll(self, only_down: bool = False) -> None:
        if self.discover and not only_down:
            await self._rediscover()

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

        await asyncio.gather(*(one(w) for w in self.workers
                               if w.address not in self._leaving and not (only_down and w.healthy)))

    async def wait_ready(self, timeout: float, report_every: float = 10.0) -> None:
        """Until at least one worker of each role answers; says which ones it is waiting for now and then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        report = loop.time() + report_every
        while not ((self.colocated or any(w.healthy for w in self.prefill)) and any(w.healthy for w in self.decode)):
            now = loop.time()
            if now > deadline:
                raise NoWorkerAvailable("no healthy prefill and decode workers within "
                                        f"{timeout:.0f}s: {[w.address for w in self.workers]}")
            if now > report:
                log.info("waiting for workers to answer: %s", [w.address for w in self.workers if not w.healthy])
                report = now + report_every
            await asyncio.sleep(0.2)
            await self.poll()

    @property
    def colocated(self) -> bool:
        """No prefill workers configured: the decode workers prefill themselves."""
        return not self._names["prefill"]

    def pick(self, exclude: set[str] = frozenset()) -> tuple[WorkerHandle, WorkerHandle | None]:
        """The least loaded decode worker and prefill worker (None when colocated)."""
        decode = [w for w in self.decode if w.healthy and w.address not in exclude]
        prefill = [w for w in self.prefill if w.healthy and w.address not in exclude]
        if not decode or not (prefill or self.colocated):
            raise NoWorkerAvailable("no healthy " + ("decode" if not decode else "prefill") + " worker")
        return (min(decode, key=lambda w: w.decode_score),
                min(prefill, key=lambda w: w.prefill_score) if prefill else None)

    def mark_down(self, address: str) -> None:
        for w in self.workers:
            if w.address == address:
                w.healthy = False

    @property
    def max_model_len(self) -> int:
        lens = [w.stats.max_model_len for w in self.decode if w.stats.max_model_len]
        return min(lens) if lens else 0
