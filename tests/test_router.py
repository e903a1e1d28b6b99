"""The gateway's router: DNS discovery follows workers as a deployment scales them up and down."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.gateway.router import NoWorkerAvailable, RouteLease, Router, WorkerHandle
from pdserve.protos import worker_pb2, worker_pb2_grpc
from tests.stack import free_port


def routed(lease: RouteLease) -> tuple[WorkerHandle, WorkerHandle | None]:
    return lease.decode, lease.prefill


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
        p0.stats.queued_tokens = 300
        # fewest sequences, then most free blocks; shortest prefill queue. The lease held stays counted there
        # before the next poll shows the request
        assert routed(router.pick()) == (d2, p1)
        assert routed(router.pick()) == (d1, p1)
        assert routed(router.pick(exclude={d1.address, p1.address})) == (d0, p0)  # ties on load: more free blocks
        d1.healthy = d2.healthy = False
        assert routed(router.pick()) == (d0, p1)
        router.mark_down(p1.address)
        assert routed(router.pick()) == (d0, p0)
        d0.healthy = False
        with pytest.raises(NoWorkerAvailable, match="decode"):
            router.pick()
    finally:
        await router.close()


async def test_choices_of_one_prompt_meet_on_the_decode_worker_of_the_first():
    """A preferred decode worker (the one the first choice of a prompt went to, which holds its KV) is taken over
    less loaded ones, while it is healthy and not excluded; otherwise the usual choice."""
    router = Router([f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}" for _ in range(2)])
    try:
        for w in router.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(kv_blocks_total=100)
        busy, idle = router.decode
        busy.stats.running = 5
        assert router.pick().decode is idle
        assert router.pick(prefer_decode=busy.address).decode is busy
        assert router.pick(exclude={busy.address}, prefer_decode=busy.address).decode is idle
        busy.healthy = False
        assert router.pick(prefer_decode=busy.address).decode is idle
    finally:
        await router.close()


async def test_colocated_router_needs_no_prefill_worker():
    router = Router([], [f"127.0.0.1:{free_port()}"])
    try:
        router.decode[0].healthy = True
        assert router.colocated and routed(router.pick()) == (router.decode[0], None)
    finally:
        await router.close()


async def test_prefill_choice_weighs_cached_prefix_against_queued_work():
    from pdserve.kernels.block_hash import prefix_hashes

    router = Router([f"127.0.0.1:{free_port()}" for _ in range(2)], [f"127.0.0.1:{free_port()}"])
    try:
        for w in router.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16)
        (d,), (p0, p1) = router.decode, router.prefill
        prompt = list(range(1000, 1200))  # 12 full blocks
        p0.cached = set(prefix_hashes(prompt[:160], 16))  # its first 10 blocks
        assert routed(router.pick(prompt=prompt)) == (d, p0)
        now = asyncio.get_running_loop().time()
        assert p0.overlap(prefix_hashes(prompt, 16), now) == 12  # routed there: it now counts on the whole prompt
        p0.stats.queued_tokens = 16 * 12 + 1  # more queued work than the hits save
        assert routed(router.pick(prompt=prompt)) == (d, p1)
        assert set(prefix_hashes(prompt, 16)) <= set(p1.expected)  # routed there: it will cache the prompt
        assert p1.overlap(prefix_hashes(prompt, 16), now + p1.EXPECT_FOR + 1) == 0  # unless it never reports them
        other = list(range(5000, 5100))
        p1.stats.queued_tokens = 10_000
        assert routed(router.pick(prompt=other)) == (d, p0)  # no overlap anywhere: the shorter queue
    finally:
        await router.close()


async def test_short_prompts_stay_on_the_decode_worker_while_it_keeps_up():
    router = Router([f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"])
    try:
        for w in router.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16)
        (d,), (p,) = router.decode, router.prefill
        assert routed(router.pick(prompt=list(range(40)))) == (d, p)  # the decode worker reports no threshold
        d.stats.local_prefill_max_tokens = 64
        assert routed(router.pick(prompt=list(range(40)))) == (d, None)
        assert routed(router.pick(prompt=list(range(65)))) == (d, p)
        d.stats.queued_tokens = 4 * 64  # its own prefill backlog is long: send even short prompts away
        assert routed(router.pick(prompt=list(range(40)))) == (d, p)
    finally:
        await router.close()


async def test_a_burst_of_short_prompts_sees_its_own_backlog_on_the_decode_worker():
    """Between two polls, short prompts stay local only until those already sent there fill the backlog
    allowance; once their first tokens come back, local prefill opens again."""
    router = Router([f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"])
    try:
        for w in router.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16, local_prefill_max_tokens=64)
        (d,), (p,) = router.decode, router.prefill
        routes = [router.pick(prompt=list(range(i, i + 64))) for i in range(6)]
        assert [r.prefill for r in routes] == [None] * 4 + [p, p]  # 4 x 64 tokens = the allowance
        assert d.queued_tokens == 256 and p.queued_tokens == 128
        routes += [router.pick(prompt=list(range(100 * i, 100 * i + 64))) for i in range(1, 7)]
        # past the allowance, local only while the decode worker has less queued than p: they alternate
        assert [r.prefill for r in routes[6:]] == [p, p, p, None, p, None]
        assert (d.queued_tokens, p.queued_tokens) == (384, 384)
        for r in routes:
            r.release()
        assert d.queued_tokens == 0 and p.queued_tokens == 0
        assert router.pick(prompt=list(range(64))).prefill is None
    finally:
        await router.close()


async def test_a_prompt_routed_during_a_poll_leaves_no_phantom_queue():
    """A poll's answer counts a prompt this gateway sent while the poll was in flight: the prompt is counted
    once, and once it is answered the worker's queue is empty again, not held at its size until the next poll
    (which would steer prompts away from the worker caching their prefix)."""
    router = Router([f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"])
    try:
        for w in router.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16)
        (p,) = router.prefill
        before = p.inflight_tokens  # the poll is sent
        route = router.pick(prompt=list(range(408)))  # a prompt is routed while it is in flight
        p.polled(worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16, queued_tokens=408), before)
        assert p.queued_tokens == 408
        route.prefilled()
        assert p.queued_tokens == 0
    finally:
        await router.close()


class _SlowStub:
    """GetStats answers as scripted: a code raises that status, None answers."""

    def __init__(self, script: list[grpc.StatusCode | None]) -> None:
        self.script = script
        self.timeouts: list[float] = []

    async def GetStats(self, request, timeout: float):
        self.timeouts.append(timeout)
        code = self.script.pop(0)
        if code is None:
            return worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16)
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")


async def test_a_slow_worker_stays_routable_until_it_misses_polls_in_a_row():
    """A busy worker that answers its polls late is not taken for down after one slow poll (it was, mid-answer,
    under load); it gets a longer deadline each time, and only MAX_MISSES in a row mark it down. A refusal
    (UNAVAILABLE) marks it down at once."""
    router = Router([], [f"127.0.0.1:{free_port()}"], poll_interval=1.0)
    try:
        (d,) = router.decode
        D = grpc.StatusCode.DEADLINE_EXCEEDED
        d.stub = stub = _SlowStub([None, D, D, None, D, D, D, None, grpc.StatusCode.UNAVAILABLE])
        await router.poll()
        assert d.healthy
        await router.poll()
        await router.poll()
        assert d.healthy and d.misses == 2 and stub.timeouts == [1.0, 1.0, 2.0]
        await router.poll()
        assert d.healthy and d.misses == 0
        for _ in range(3):
            await router.poll()
        assert not d.healthy and d.misses == 3
        await router.poll()
        assert d.healthy and d.misses == 0
        await router.poll()
        assert not d.healthy
    finally:
        await router.close()


class _ModelStub:
    def __init__(self, model: str) -> None:
        self.model = model

    async def GetStats(self, request, timeout: float):
        return worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16, model=self.model)


async def test_a_worker_serving_another_model_is_never_routed_to():
    """A worker whose stats name another model than the gateway's stays out of the pool (a stack pointed at two
    models by mistake must not answer with the wrong one); it joins once it serves the right one."""
    router = Router([], [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], model="SmolLM2", poll_interval=1.0)
    try:
        right, wrong = router.decode
        right.stub, wrong.stub = _ModelStub("SmolLM2"), _ModelStub("Llama-3-8B")
        await router.poll()
        assert right.healthy and not wrong.healthy
        for _ in range(5):
            with router.pick() as lease:
                assert routed(lease)[0] is right
        wrong.stub = _ModelStub("SmolLM2")
        await router.poll()
        assert wrong.healthy
    finally:
        await router.close()


async def test_a_decode_worker_allows_a_new_prefill_pod_as_soon_as_dns_has_it(monkeypatch):
    """The --prefill allowlist is looked up again on a miss (at most every MISS_REFRESH_S), not only every
    `refresh` seconds: a prefill pod that just scaled up is dialled on its first request."""
    from pdserve.decode_service import server

    answers = [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"]]
    looked_up = []

    async def resolve(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return answers[min(len(looked_up) - 1, 1)]

    monkeypatch.setattr(server, "resolve_ipv4", resolve)
    monkeypatch.setattr(server, "MISS_REFRESH_S", 0.0)
    clients = server.PrefillClients(timeout=5, allowed=["pdserve-prefill:50061"], refresh=3600)
    assert await clients.allows("10.0.0.1:50061")
    assert await clients.allows("10.0.0.2:50061")  # a miss: looked up again at once, and found
    assert not await clients.allows("10.0.0.3:50061")
    assert await clients.allows("10.0.0.1:50061") and len(looked_up) == 3  # hits need no lookup
    await clients.close()


class _Stats(worker_pb2_grpc.DecodeServiceServicer):
    """A decode worker as far as the router's polls see it: it answers GetStats."""

    async def GetStats(self, request, context):
        return worker_pb2.WorkerStats(role="decode", kv_blocks_total=100)


async def _answering(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(_Stats(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def test_a_restarted_worker_is_usable_again_by_a_request_that_excluded_it():
    """A request excludes the run of a worker that failed it (address, epoch); the same address coming back up
    after being down is a new run, which the request may use."""
    port = free_port()
    router = Router([], [f"127.0.0.1:{port}"])
    server = await _answering(port)
    try:
        await router.poll()
        (d,) = router.decode
        assert d.healthy and d.epoch == 1
        tried = {router.key(d.address)}
        with pytest.raises(NoWorkerAvailable):
            router.pick(tried)
        await router.poll()  # still the same run
        with pytest.raises(NoWorkerAvailable):
            router.pick(tried)
        await server.stop(None)
        await router.poll()
        assert not d.healthy
        server = await _answering(port)
        for _ in range(100):  # the channel reconnects after its backoff (at most 1 s)
            await router.poll(only_down=True)
            if d.healthy:
                break
            await asyncio.sleep(0.1)
        assert d.healthy and d.epoch == 2 and router.pick(tried).decode is d
        assert router.key("127.0.0.1:1") == ("127.0.0.1:1", 0)
    finally:
        await server.stop(None)
        await router.close()


async def test_a_request_waits_for_a_worker_that_comes_up_and_not_for_one_that_is_only_excluded():
    port = free_port()
    router = Router([], [f"127.0.0.1:{port}"], poll_interval=60.0)  # no regular poll would see it in time
    server = None
    try:
        await router.poll()
        waiting = asyncio.ensure_future(router.wait_for(set(), [], 60.0))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        server = await _answering(port)
        assert await asyncio.wait_for(waiting, 30.0)  # admitted by its first good answer to the waiter's probe
        assert router.pick().decode.address == f"127.0.0.1:{port}"
        # every worker is up, and this request excludes them all: nothing to wait for
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert not await router.wait_for({router.decode[0].key}, [], 60.0)
        assert loop.time() - start < 30.0
        await server.stop(None)
        server = None
        await router.poll()
        assert not await router.wait_for(set(), [], 0.3)  # bounded: nobody comes
    finally:
        if server is not None:
            await server.stop(None)
        await router.close()


async def test_a_prompt_has_an_alternative_only_where_another_worker_could_prefill_it():
    prefill = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    router = Router(prefill, [f"127.0.0.1:{free_port()}"])
    try:
        for w in router.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16)
        d = router.decode[0]
        lease = router.pick(prompt=list(range(300)))
        p = lease.prefill
        assert p is not None and router.has_alternative(lease, set(), list(range(300)))
        other = next(w for w in router.prefill if w is not p)
        assert not router.has_alternative(lease, {other.key}, list(range(300)))  # the other one failed it already
        other.healthy = False
        assert not router.has_alternative(lease, set(), list(range(300)))
        d.stats.local_prefill_max_tokens = 512  # the decode worker can prefill it itself
        assert router.has_alternative(lease, set(), list(range(300)))
        lease.release()
        # no prefill worker left for a prompt the decode worker may prefill: it does, whatever its queue
        d.inflight_tokens = 10_000
        assert router.pick({p.key}, list(range(300))).prefill is None
    finally:
        await router.close()


class _CountingStub:
    """GetStats always answers; counts the polls."""

    def __init__(self) -> None:
        self.polls = 0

    async def GetStats(self, request, timeout: float):
        self.polls += 1
        return worker_pb2.WorkerStats(kv_blocks_total=100, block_size=16)


async def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_polls_slow_down_while_no_request_comes_and_the_next_request_brings_them_back():
    """After QUIET_POLLS polls with nothing routed, the next full poll is `idle_poll_interval` away (an idle
    stack hardly wakes); a request polls every worker at once and brings back `poll_interval` while it runs."""
    router = Router([], [f"127.0.0.1:{free_port()}"], poll_interval=0.05, idle_poll_interval=3600.0)
    (d,) = router.decode
    d.stub = stub = _CountingStub()
    try:
        await router.start()
        await _until(lambda: router._idle, "the polls never slowed down")
        await asyncio.sleep(0.05)  # the full poll that follows the switch has run
        assert stub.polls >= 1 + router.QUIET_POLLS
        settled = stub.polls
        await asyncio.sleep(0.5)
        assert stub.polls == settled  # ten regular intervals, no poll

        with router.pick():
            await _until(lambda: stub.polls > settled, "a request did not bring a poll")
            assert not router._idle
            await _until(lambda: stub.polls >= settled + 2 * router.QUIET_POLLS, "polls did not resume their pace")
            assert not router._idle  # a request in flight keeps them at `poll_interval`
        await _until(lambda: router._idle, "the polls did not slow down again")
    finally:
        await router.close()
