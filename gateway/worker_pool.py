"""The workers a gateway knows, and what it knows of each: the registry (static lists, or DNS names followed with
`discover`), health and load from `GetStats` polls, and each prefill worker's prefix cache as its `WatchCache`
stream reports it. The routing policy (`router.py`) reads this; nothing here chooses a worker.

A worker whose call fails with UNAVAILABLE, or whose poll is refused, is treated as down until a poll succeeds
again; one that only answers its polls late (a busy worker under load) stays usable until it misses MAX_MISSES in
a row, each with a longer deadline than the last. Each time a worker comes (back) up its `epoch` grows: a request
that excluded a worker (it failed or handed the stream back) may use it again once it restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.discovery import Resolver
from pdserve.grpc_server import open_channel
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.security import TLSConfig

log = logging.getLogger(__name__)


class NoWorkerAvailable(RuntimeError):
    pass


WorkerKey = tuple[str, int]  # (address, epoch): one run of one worker


@dataclass
class WorkerHandle:
    address: str
    role: str
    channel: grpc.aio.Channel
    stub: Any  # PrefillServiceStub or DecodeServiceStub, by role
    healthy: bool = False
    misses: int = 0  # polls in a row that timed out (a busy worker is slow, not down, until MAX_MISSES)
    stats: worker_pb2.WorkerStats = field(default_factory=worker_pb2.WorkerStats)
    # the two below change only through the RouteLeases of this gateway's requests
    inflight: int = 0  # requests this gateway sent that have not answered yet
    inflight_tokens: int = 0  # their prompt tokens not prefilled yet (prefill workers; decode workers' own prefills)
    inflight_tokens_at_poll: int = 0  # inflight_tokens when `stats` was taken: already inside its queued_tokens
    cached: set[int] = field(default_factory=set)  # prefill workers: block hashes their cache reported
    expected: dict[int, float] = field(default_factory=dict)  # hashes of prompts routed here -> when (not reported yet)
    watcher: asyncio.Task | None = None
    routed: int = 0  # requests routed here (prefill: remote prefills; decode: all)
    epoch: int = 0  # times it came (back) up: a restarted worker is a new one to requests that excluded it

    @property
    def key(self) -> WorkerKey:
        return (self.address, self.epoch)

    @property
    def decode_score(self) -> tuple:
        free = self.stats.kv_blocks_total - self.stats.kv_blocks_used
        return (self.stats.running + self.stats.waiting + self.inflight, -free)

    EXPECT_FOR = 30.0  # seconds a routed prompt counts as cached before the worker reports it

    def overlap(self, hashes: Sequence[int], now: float) -> int:
        """How many of the prompt's leading blocks this worker's prefix cache holds (or soon will)."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                when = self.expected.get(h)
                if when is None or now - when > self.EXPECT_FOR:
                    self.expected.pop(h, None)
                    break
            n += 1
        return n

    def expect(self, hashes: Sequence[int], now: float) -> None:
        """A prompt was routed here: count its blocks as cached until the worker reports them (or not)."""
        for h in hashes:
            if h not in self.cached:
                self.expected[h] = now

    def polled(self, stats: worker_pb2.WorkerStats, inflight_tokens_before: int) -> None:
        """The worker answered a poll sent when `inflight_tokens_before` of ours were in flight there. Its queue
        holds ours as of some moment during the call, start or end: taking the larger errs toward others having
        queued less, never toward a phantom queue that would push prompts off the worker caching them until
        the next poll."""
        self.stats = stats
        self.inflight_tokens_at_poll = max(inflight_tokens_before, self.inflight_tokens)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens waiting at this worker: this gateway's own (exact) plus other senders' (as last polled)."""
        others = max(0, self.stats.queued_tokens - self.inflight_tokens_at_poll)
        return others + self.inflight_tokens


class WorkerPool:
    """Knows every worker and its polled load and health. With `discover`, the given addresses are names: each poll
    resolves them and adds workers that appeared (scaled up) and drops those that left once nothing is in flight
    on them."""

    MAX_MISSES = 3  # polls in a row a worker may time out on before it is taken for down (refusals count at once)
    QUIET_POLLS = 3  # full polls in a row with no request of ours before they slow to `idle_poll_interval`

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        poll_interval: float,
        interceptors: Sequence[grpc.aio.ClientInterceptor],
        discover: bool,
        resolve: Resolver,
        probe_interval: float,
        tls: TLSConfig | None,
        kv_aware: bool,
        model: str,
        idle_poll_interval: float,
    ) -> None:
        """`model`: the model this gateway serves; a worker that reports another is never routed to. `kv_aware`:
        follow the prefill workers' prefix caches. `idle_poll_interval`: between full polls while no request comes
        (at least `poll_interval`)."""
        if not decode:
            raise ValueError(
                "need at least one decode worker address (and prefill workers, unless the decode workers are colocated)"
            )
        self.model = model
        self.poll_interval = poll_interval
        self.idle_poll_interval = max(idle_poll_interval, poll_interval)
        self.probe_interval = min(probe_interval, poll_interval)
        self.kv_aware = kv_aware
        self.interceptors = list(interceptors)
        self.tls = tls
        self.discover = discover
        self._resolve = resolve
        self._names = {"prefill": list(prefill), "decode": list(decode)}
        self.prefill = [] if discover else [self._handle(a, "prefill") for a in prefill]
        self.decode = [] if discover else [self._handle(a, "decode") for a in decode]
        self._leaving: set[str] = set()
        self._poller: asyncio.Task | None = None
        self._probe: asyncio.Future | None = None  # the probe of down workers in flight, shared by every waiter
        self._wake = asyncio.Event()  # a request found a worker down, or came while polls were slow
        self._idle = False  # full polls are `idle_poll_interval` apart
        self._next_full = 0.0  # when the poller polls every worker next (loop time)
        self._routed = 0  # requests routed, ever (the poller tells quiet stretches by it)

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
        for w in self.prefill:
            self._watch(w)

    async def close(self) -> None:
        tasks = [t for t in [self._poller, self._probe, *(w.watcher for w in self.prefill)] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.workers), return_exceptions=True)

    def _watch(self, w: WorkerHandle) -> None:
        if self.kv_aware and w.watcher is None:
            w.watcher = asyncio.create_task(self._follow_cache(w), name=f"cache-{w.address}")

    async def _follow_cache(self, w: WorkerHandle) -> None:
        """Keep `w.cached` in step with the worker's prefix cache. When a stream that was open breaks, the worker
        may have restarted with an empty cache: forget what it held and what was routed to it before."""
        while True:
            opened = False
            try:
                async for event in w.stub.WatchCache(worker_pb2.WatchCacheRequest(), wait_for_ready=True):
                    if event.snapshot:
                        opened = True
                        w.cached = set(event.stored)
                    else:
                        w.cached.difference_update(event.removed)
                        w.cached.update(event.stored)
                    for h in event.stored:
                        w.expected.pop(h, None)
            except grpc.aio.AioRpcError as e:
                log.debug("cache stream of %s ended: %s", w.address, e.code().name)
            if opened:
                w.cached, w.expected = set(), {}
            await asyncio.sleep(self.probe_interval)

    async def _poll_forever(self) -> None:
        """Every worker each `poll_interval`; workers that are down (or not up yet) every `probe_interval`, so
        one that comes (back) up takes traffic within a fraction of a second. With every worker up it sleeps until
        the next full poll or until a request finds one down. After `QUIET_POLLS` full polls with no request of
        this gateway routed or in flight, full polls come each `idle_poll_interval`, until the next request: an idle
        stack hardly wakes (a request routed on a stale poll to a worker that died meanwhile is retried elsewhere)."""
        loop = asyncio.get_running_loop()
        self._next_full = loop.time() + self.poll_interval
        quiet, routed = 0, self._routed
        while True:
            until_full = max(0.0, self._next_full - loop.time())
            if any(not w.healthy for w in self.workers):
                await asyncio.sleep(min(self.probe_interval, until_full))
            else:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), until_full)
            if loop.time() >= self._next_full:
                busy = self._routed != routed or any(w.inflight for w in self.workers)
                quiet, routed = 0 if busy else quiet + 1, self._routed
                self._idle = quiet >= self.QUIET_POLLS
                self._next_full = loop.time() + (self.idle_poll_interval if self._idle else self.poll_interval)
                await self.poll()
            else:
                await self.poll(only_down=True)

    def routing(self) -> None:
        """A request is being routed: counts against a quiet stretch, and ends one (a full poll now)."""
        self._routed += 1
        if self._idle:
            self._idle, self._next_full = False, 0.0
            self._wake.set()

    def indexed(self) -> dict[str, int]:
        """Prefill worker -> how many prefix-cache blocks it is believed to hold (reported and expected)."""
        return {w.address: len(w.cached) + len(w.expected) for w in self.prefill}

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
                if role == "prefill" and self._poller is not None:
                    self._watch(handles[-1])
            self._leaving -= found
            for w in [w for w in handles if w.address not in found]:
                w.healthy = False
                self._leaving.add(w.address)
                if w.inflight == 0:
                    self._leaving.discard(w.address)
                    log.info("%s worker %s left", role, w.address)
                    handles.remove(w)
                    if w.watcher is not None:
                        w.watcher.cancel()
                    await w.channel.close()

    async def poll(self, only_down: bool = False) -> None:
        if self.discover and not only_down:
            await self._rediscover()

        async def one(w: WorkerHandle) -> None:
            # a worker that answered late gets longer to answer the next time
            timeout = max(self.poll_interval, 1.0) * (1 + w.misses)
            try:
                mine = w.inflight_tokens
                stats = await w.stub.GetStats(worker_pb2.StatsRequest(), timeout=timeout)
                if self.model and stats.model and stats.model != self.model:
                    if w.healthy or w.misses < self.MAX_MISSES:
                        log.error(
                            "%s worker %s serves model %r, not this gateway's %r: not routing to it",
                            w.role,
                            w.address,
                            stats.model,
                            self.model,
                        )
                    w.healthy, w.misses = False, self.MAX_MISSES
                    return
                w.polled(stats, mine)
                if not w.healthy:
                    log.info("%s worker %s is up", w.role, w.address)
                    w.epoch += 1
                w.healthy, w.misses = True, 0
            except grpc.aio.AioRpcError as e:
                slow = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                w.misses = w.misses + 1 if slow else self.MAX_MISSES
                if w.healthy and w.misses >= self.MAX_MISSES:
                    log.warning(
                        "%s worker %s is down: %s",
                        w.role,
                        w.address,
                        f"no answer to {w.misses} polls in a row" if slow else e.code().name,
                    )
                    w.healthy = False

        await asyncio.gather(
            *(one(w) for w in self.workers if w.address not in self._leaving and not (only_down and w.healthy))
        )

    async def wait_ready(self, timeout: float, report_every: float = 10.0) -> None:
        """Until at least one worker of each role answers; says which ones it is waiting for now and then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        report = loop.time() + report_every
        while not ((self.colocated or any(w.healthy for w in self.prefill)) and any(w.healthy for w in self.decode)):
            now = loop.time()
            if now > deadline:
                raise NoWorkerAvailable(
                    f"no healthy prefill and decode workers within {timeout:.0f}s: {[w.address for w in self.workers]}"
                )
            if now > report:
                log.info("waiting for workers to answer: %s", [w.address for w in self.workers if not w.healthy])
                report = now + report_every
            await asyncio.sleep(0.2)
            await self.poll()

    @property
    def colocated(self) -> bool:
        """No prefill workers configured: the decode workers prefill themselves."""
        return not self._names["prefill"]

    def key(self, address: str) -> WorkerKey:
        """The current run of the worker at `address` (epoch 0 for one this router does not know)."""
        return next((w.key for w in self.workers if w.address == address), (address, 0))

    def mark_down(self, address: str) -> None:
        for w in self.workers:
            if w.address == address:
                w.healthy = False
                self._wake.set()

    @property
    def max_model_len(self) -> int:
        lens = [w.stats.max_model_len for w in self.decode if w.stats.max_model_len]
        return min(lens) if lens else 0
