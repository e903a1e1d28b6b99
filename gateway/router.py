"""Which prefill and which decode worker serve the next request: the policy over the worker pool's view
(`worker_pool.py`).

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

A request that finds no worker waits (`wait_for`) a bounded time, probing the workers that are down at once and
then every WAIT_PROBE_S, so a worker that comes back is admitted by its first good answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence, Set

import grpc

from pdserve.discovery import Resolver, resolve_ipv4
from pdserve.gateway.worker_pool import NoWorkerAvailable, WorkerHandle, WorkerKey, WorkerPool
from pdserve.kernels.block_hash import prefix_hashes
from pdserve.options import GatewayOptions, RoutingOptions
from pdserve.security import TLSConfig

__all__ = ["NoWorkerAvailable", "RouteLease", "Router", "WorkerHandle", "WorkerKey"]

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5  # between polls of the workers that are down (or not up yet): a restart takes traffic soon


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


class Router(WorkerPool):
    """Picks the least loaded decode worker and the best prefill worker per request, and hands out the lease that
    counts the request against them."""

    WAIT_PROBE_S = 0.1  # between probes of the workers that are down while a request waits for one

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        poll_interval: float = GatewayOptions.poll_interval,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        discover: bool = GatewayOptions.discover,
        resolve: Resolver = resolve_ipv4,
        probe_interval: float = PROBE_INTERVAL_S,
        tls: TLSConfig | None = None,
        overlap_weight: float = RoutingOptions.overlap_weight,
        kv_aware: bool = RoutingOptions.routing == "kv-aware",
        model: str = "",
        idle_poll_interval: float = GatewayOptions.idle_poll_interval,
    ) -> None:
        """The defaults are the flags' (`pdserve.config`); the gateway passes its configuration's values."""
        super().__init__(
            prefill,
            decode,
            poll_interval,
            interceptors,
            discover,
            resolve,
            probe_interval,
            tls,
            kv_aware,
            model,
            idle_poll_interval,
        )
        self.overlap_weight = overlap_weight
        self.local_prefills = 0

    def _usable(self, workers: list[WorkerHandle], exclude: Set[str] | Set[WorkerKey]) -> list[WorkerHandle]:
        return [w for w in workers if w.healthy and w.address not in exclude and w.key not in exclude]

    def _candidates(
        self, exclude: Set[str] | Set[WorkerKey], prompt: Sequence[int], prefer_decode: str = ""
    ) -> tuple[WorkerHandle, list[WorkerHandle]]:
        """The decode worker for the next request (`prefer_decode` while it is usable), and the prefill workers to
        choose from (none: the decode worker prefills the prompt itself); NoWorkerAvailable when there are none. No
        lease, no index touched."""
        decode_ok = self._usable(self.decode, exclude)
        if not decode_ok:
            raise NoWorkerAvailable("no healthy decode worker")
        preferred = next((w for w in decode_ok if prefer_decode and w.address == prefer_decode), None)
        decode = preferred or min(decode_ok, key=lambda w: w.decode_score)
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

    def pick(
        self, exclude: Set[str] | Set[WorkerKey] = frozenset(), prompt: Sequence[int] = (), prefer_decode: str = ""
    ) -> RouteLease:
        """A lease on a decode worker and the prefill worker for `prompt` (None: the decode worker prefills it
        itself, colocated or by conditional disaggregation); hold it for as long as the request runs. `exclude`
        names workers by address (every run) or by `key` (that run only: once it restarts, it is usable).
        `prefer_decode`: the decode worker at that address, while it is healthy and not excluded (`DecodeAffinity`)."""
        self.routing()
        decode, prefill_ok = self._candidates(exclude, prompt, prefer_decode)
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
