"""The gateway's router: DNS discovery follows workers as a deployment scales them up and down."""

from __future__ import annotations

import pytest

from gateway.router import NoWorkerAvailable, Router
from protos import worker_pb2
from tests.stack import free_port


class Names:
    """A resolver whose answers the test changes, as DNS does when compose scales a service."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str]] = {}

    async def __call__(self, host: str, port: int) -> list[str]:
        if host not in self.answers:
            raise OSError(f"unknown host {host}")
        return self.answers[host]


async def test_discovery_adds_and_drops_workers():
    names = Names()
    p, d = free_port(), free_port()  # nothing listens: workers are known but unhealthy
    router = Router([f"prefill:{p}"], [f"decode:{d}"], poll_interval=0.05, discover=True, resolve=names)
    try:
        await router.poll()
        assert router.prefill == [] and router.decode == []  # names not resolvable yet

        names.answers = {"prefill": ["127.0.0.1"], "decode": ["127.0.0.1"]}
        await router.poll()
        assert [w.address for w in router.prefill] == [f"127.0.0.1:{p}"]
        assert [w.address for w in router.decode] == [f"127.0.0.1:{d}"]
        assert not router.decode[0].healthy

        busy = router.decode[0]
        busy.inflight = 1
        names.answers["decode"] = []  # scaled to zero while a request is in flight
        await router.poll()
        assert router.decode == [busy] and not busy.healthy  # kept until its request ends, never picked
        busy.inflight = 0
        await router.poll()
        assert router.decode == []
        assert [w.address for w in router.prefill] == [f"127.0.0.1:{p}"]
    finally:
        await router.close()


async def test_pick_takes_the_least_loaded_healthy_workers():
    """Decode by (queued + running + in flight here, then most free blocks); prefill by queue; exclusions and
    unhealthy workers are never picked."""
    prefill = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    decode = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    router = Router(prefill, decode)
    try:
        for w in router.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(kv_blocks_total=100)
        d0, d1, d2 = router.decode
        p0, p1 = router.prefill
        d0.stats.running, d0.stats.kv_blocks_used = 2, 10
        d1.stats.running, d1.stats.kv_blocks_used = 1, 50
        d2.stats.running, d2.stats.kv_blocks_used = 1, 20
        p0.stats.waiting = 3
        assert router.pick() == (d2, p1)  # fewest sequences, then most free blocks; shortest prefill queue
        d2.inflight = 1  # a request this gateway just sent there counts before the next poll shows it
        assert router.pick() == (d1, p1)
        assert router.pick(exclude={d1.address, p1.address}) == (d0, p0)  # ties on load: more free blocks
        d1.healthy = d2.healthy = False
        assert router.pick() == (d0, p1)
        router.mark_down(p1.address)
        assert router.pick() == (d0, p0)
        d0.healthy = False
        with pytest.raises(NoWorkerAvailable, match="decode"):
            router.pick()
    finally:
        await router.close()


async def test_colocated_router_needs_no_prefill_worker():
    router = Router([], [f"127.0.0.1:{free_port()}"])
    try:
        router.decode[0].healthy = True
        assert router.colocated and router.pick() == (router.decode[0], None)
    finally:
        await router.close()
