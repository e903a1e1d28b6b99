"""The gateway's router: DNS discovery follows workers as a deployment scales them up and down."""

from __future__ import annotations

from gateway.router import Router
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


async def test_static_addresses_are_used_as_given():
    p, d = free_port(), free_port()
    router = Router([f"127.0.0.1:{p}"], [f"127.0.0.1:{d}"])
    try:
        await router.poll()
        assert [w.address for w in router.workers] == [f"127.0.0.1:{p}", f"127.0.0.1:{d}"]
    finally:
        await router.close()
