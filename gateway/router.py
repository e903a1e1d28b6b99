"""Which prefill and which decode worker serve the next request.

Workers (static lists, or DNS names followed with `discover`) are polled for health and load with `GetStats`.
A decode worker is chosen by running and queued requests, then free KV blocks. A prefill worker is chosen by how
much of the prompt its prefix cache already holds, weighed against the work queued there:

    score = overlap_weight * cached_blocks - queued_tokens / block_size

where `cached_blocks` counts the prompt's leading blocks whose hashes (`kernels.block_hash`, the workers' own)
are in the worker's cache, as its `WatchCache` stream reports it, and `queued_tokens` is this gateway's own
unanswered prompt tokens there (exact) plus what other senders had queued at the last poll. A cached block saves
computing `block_size` tokens, so with overlap_weight 1 a worker wins a prompt when its hits outweigh its extra
queue. Each prompt routed to a worker is added to that worker's index at once (the worker will cache it), so
requests right behind it follow. A worker that goes away takes its index with it; a stale index only costs a miss.

Conditional disaggregation: a decode worker that reports `local_prefill_max_tokens` gets prompts up to that
length with no prefill worker, and prefills them itself, while its own prefill backlog is short.

A worker whose call fails with UNAVAILABLE, or whose poll is refused, is treated as down until a poll succeeds
again; one that only answers its polls late (a busy worker under load) stays routable until it misses
MAX_MISSES in a row, each with a longer deadline than the last. Each time a worker comes (back) up its `epoch`
grows: a request that excluded a worker (it failed or handed the stream back) may use it again once it restarted.
A request that finds no worker waits (`wait_for`) a bounded time, probing the workers that are down at once and
then every WAIT_PROBE_S, so a worker that comes back is admitted by its first good answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.discovery import Resolver, resolve_ipv4
from pdserve.grpc_server import open_channel
from pdserve.kernels.block_hash import prefix_hashes
from pdserve.protos import worker_pb2, worker_pb2_grpc
from pdserve.security import TLSConfig

log = logging.getLogger(__name__)


class NoWorkerAvailable(RuntimeError):
    pass


WorkerKey = tuple[str, int]  # (address, epoch): one run of one worker


class RouteLease:
    """One routed request's claim on its workers, from `Router.pick` until the request ends: it counts as in
    flight at its decode worker, and its uncached prompt tokens as queued where they are prefilled (a prefill
    worker, or the decode worker itself) until `prefilled()` says the first token came. The lease is the only
    thing that changes those counts; leaving it (a context manager) releases whatever it still holds, once."""

    def __init__(self, decode: WorkerHandle, prefill: WorkerHandle | None, queued_tokens: int) -> None:
        self.decode = decode
        self.prefill = prefill  # None: the decode worker prefills the prompt itself
        self.queued_tokens = queued_tokens
        self._prefilling = True
        self._held = True
        decode.inflight += 1
        if prefill is not None:
            prefill.inflight += 1
            prefill.inflight_tokens += queued_tokens
        else:
            decode.inflight_tokens += queued_tokens

    def prefilled(self) -> None:
        """The prompt's first token arrived (or its prefill failed): its tokens no longer queue anywhere."""
        if not self._prefilling:
            return
        self._prefilling = False
        if self.prefill is not None:
            self.prefill.inflight -= 1
            self.prefill.inflight_tokens -= self.queued_tokens
        else:
            self.decode.inflight_tokens -= self.queued_tokens

    def release(self) -> None:
        if not self._held:
            return
        self.prefilled()
        self._held = False
        self.decode.inflight -= 1

    def __enter__(self) -> RouteLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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


class Router:
    """Knows every worker and its polled load; picks the least loaded decode and prefill worker per request.

    With `discover`, the given addresses are names: each poll resolves them and adds workers that appeared
    (scaled up) and drops those that left once nothing is in flight on them.
    """

    MAX_MISSES = 3  # polls in a row a worker may time out on before it is taken for down (refusals count at once)
    WAIT_PROBE_S = 0.1  # between probes of the workers that are down while a request waits for one

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        poll_interval: float = 1.0,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        discover: bool = False,
        resolve: Resolver = resolve_ipv4,
        probe_interval: float = 0.5,
        tls: TLSConfig | None = None,
        overlap_weight: float = 1.0,
        kv_aware: bool = True,
        model: str = "",
    ) -> None:
        """`model`: the model this gateway serves; a worker that reports another is never routed to."""
        if not decode:
            raise ValueError(
                "need at least one decode worker address (and prefill workers, unless the decode workers are colocated)"
            )
        self.model = model
        self.poll_interval = poll_interval
        self.probe_interval = min(probe_interval, poll_interval)
        self.overlap_weight = overlap_weight
        self.kv_aware = kv_aware
        self.local_prefills = 0
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

    def _usable(self, workers: list[WorkerHandle], exclude: Set[str] | Set[WorkerKey]) -> list[WorkerHandle]:
        return [w for w in workers if w.healthy and w.address not in exclude and w.key not in exclude]

    def _candidates(
        self, exclude: Set[str] | Set[WorkerKey], prompt: Sequence[int]
    ) -> tuple[WorkerHandle, list[WorkerHandle]]:
        """The decode worker for the next request, and the prefill workers to choose from (none: the decode
        worker prefills the prompt itself); NoWorkerAvailable when there are none. No lease, no index touched."""
        decode_ok = self._usable(self.decode, exclude)
        if not decode_ok:
            raise NoWorkerAvailable("no healthy decode worker")
        decode = min(decode_ok, key=lambda w: w.decode_score)
        if self.colocated:
            return decode, []
        limit = decode.stats.local_prefill_max_tokens
        prefill_ok = self._usable(self.prefill, exclude)
        if prompt and 0 < len(prompt) <= limit:
            # local while the decode worker's own prefill backlog is short, or shorter than every prefill
            # worker's (a burst of short prompts is shared between the two instead of queueing at one), or when
            # no prefill worker can take it
            remote = min((w.queued_tokens for w in prefill_ok), default=0)
            if not prefill_ok or decode.queued_tokens < max(4 * limit, remote):
                return decode, []
        if not prefill_ok:
            raise NoWorkerAvailable("no healthy prefill worker")
        return decode, prefill_ok

    def pick(self, exclude: Set[str] | Set[WorkerKey] = frozenset(), prompt: Sequence[int] = ()) -> RouteLease:
        """A lease on a decode worker and the prefill worker for `prompt` (None: the decode worker prefills it
        itself, colocated or by conditional disaggregation); hold it for as long as the request runs. `exclude`
        names workers by address (every run) or by `key` (that run only: once it restarts, it is usable)."""
        decode, prefill_ok = self._candidates(exclude, prompt)
        if not prefill_ok:
            if self.colocated:
                return RouteLease(decode, None, 0)
            self.local_prefills += 1
            return RouteLease(decode, None, len(prompt))  # a burst sees its own backlog, not the last poll's
        block_size = max(prefill_ok[0].stats.block_size, 1)
        hashes = prefix_hashes(prompt, block_size) if self.kv_aware and prompt else []
        now = asyncio.get_running_loop().time()

        def score(w: WorkerHandle) -> tuple:
            gain = self.overlap_weight * w.overlap(hashes, now) - w.queued_tokens / block_size
            return (gain, -w.inflight)

        prefill = max(prefill_ok, key=score)
        uncached = max(0, len(prompt) - prefill.overlap(hashes, now) * block_size)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "prompt of %d tokens -> prefill %s (%d uncached); scores %s",
                len(prompt),
                prefill.address,
                uncached,
                {w.address: score(w) for w in prefill_ok},
            )
        prefill.expect(hashes, now)  # it will hold them once it has run the prompt
        return RouteLease(decode, prefill, uncached)

    def has_alternative(self, lease: RouteLease, exclude: Set[WorkerKey], prompt: Sequence[int]) -> bool:
        """Whether the prompt of `lease` could be prefilled elsewhere if its prefill worker refused it: another
        healthy prefill worker, or the decode worker itself (a prompt within its local prefill limit)."""
        if lease.prefill is None:
            return False
        others = [w for w in self._usable(self.prefill, exclude) if w is not lease.prefill]
        return bool(others) or 0 < len(prompt) <= lease.decode.stats.local_prefill_max_tokens

    def routable(self, exclude: Set[WorkerKey], prompt: Sequence[int]) -> bool:
        """Whether `pick(exclude, prompt)` would find workers now."""
        try:
            self._candidates(exclude, prompt)
        except NoWorkerAvailable:
            return False
        return True

    async def wait_for(self, exclude: Set[WorkerKey], prompt: Sequence[int], timeout: float) -> bool:
        """Until `pick(exclude, prompt)` would find workers (True), or `timeout` seconds passed (False): the
        workers that are down are probed now and then every WAIT_PROBE_S, one probe shared by every waiter. With
        every worker up (those it excludes are merely busy or refusing), there is nothing to wait for: False."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not self.routable(exclude, prompt):
            left = end - loop.time()
            if left <= 0 or all(w.healthy or w.address in self._leaving for w in self.workers):
                return False
            if self._probe is None or self._probe.done():
                self._probe = asyncio.ensure_future(self.poll(only_down=True))
            try:
                await asyncio.wait_for(asyncio.shield(self._probe), left)
            except TimeoutError:
                return self.routable(exclude, prompt)
            await asyncio.sleep(min(self.WAIT_PROBE_S, max(0.0, end - loop.time())))
        return True

    def mark_down(self, address: str) -> None:
        for w in self.workers:
            if w.address == address:
                w.healthy = False

    @property
    def max_model_len(self) -> int:
        lens = [w.stats.max_model_len for w in self.decode if w.stats.max_model_len]
        return min(lens) if lens else 0
