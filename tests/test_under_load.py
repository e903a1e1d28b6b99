"""What holds on a quiet machine holds on a busy one: the stack with CPU hogs spinning on the same cores.

A burst to one prefill and one decode worker completes (a busy prefill worker queues what it cannot send
elsewhere); a decode worker killed (-9) or restarted (SIGTERM, then started again, one after the other) loses no
stream and changes no token; and a worker with nothing to do takes (almost) no CPU. `make test-busy` runs the other
stack tests (pipeline, migration, faults, hardening) with hogs too.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from pdserve.client import Client
from pdserve.gateway.worker_pool import WorkerPool
from pdserve.options import GatewayOptions
from tests.hogs import cpu_hogs, cpu_seconds
from tests.stack import Stack, free_port, scrape, service_env, start_stack, wait_serving
from tests.test_migration import _busiest, _exact, _idle, _migrations, _proc, _reference, _restart, _Streams

pytestmark = pytest.mark.slow
IDLE_S = 10.0
IDLE_CORES = 0.02  # what an idle service may use of one core
BURST = 16
BOUND_S = 300.0  # a request still running after this under the hogs counts as failed


def _idle_share(pids: dict[str, int], seconds: float = IDLE_S) -> dict[str, float]:
    """The share of one core each process used over `seconds` of doing nothing."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: (cpu_seconds(pid) - before[name]) / seconds for name, pid in pids.items()}


def test_idle_workers_without_peers_use_almost_no_cpu():
    """The issue's case: `pdserve decode` (KV receiver listening, NIXL plane registered) and `pdserve prefill`,
    no gateway, no peer, no request."""
    exe = [sys.executable, "-m", "pdserve.cli"]
    d_port, p_port = free_port(), free_port()
    common = ["--host", "127.0.0.1", "--dtype", "float32", "--threads", "1", "--kv-cache-memory", "64M"]
    procs = {
        "decode": subprocess.Popen(
            [*exe, "decode", "--port", str(d_port), "--kv-host", "127.0.0.1", "--metrics-port", "-1", *common],
            env=service_env(),
        ),
        "prefill": subprocess.Popen(
            [*exe, "prefill", "--port", str(p_port), "--metrics-port", "-1", *common], env=service_env()
        ),
    }
    try:
        wait_serving(f"127.0.0.1:{d_port}", procs["decode"])
        wait_serving(f"127.0.0.1:{p_port}", procs["prefill"])
        time.sleep(2.0)  # start-up's last work (compiling, warming) is done
        share = _idle_share({role: p.pid for role, p in procs.items()})
        print(f"\nidle, no peers: {', '.join(f'{r} {s:.4f} core' for r, s in share.items())}")
        assert all(s < IDLE_CORES for s in share.values()), share
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture(scope="module")
def pair():
    """One prefill and one decode worker (every prompt prefilled remotely) and a gateway that waits long enough
    for a decode worker restarting on a busy machine."""
    stack = start_stack(gateway_extra=["--worker-wait", str(BOUND_S)])
    try:
        yield stack
    finally:
        stack.stop()


def test_an_idle_stack_uses_almost_no_cpu(pair: Stack):
    """Workers connected to each other and polled by the gateway, with nothing to do."""
    asyncio.run(_warm(pair))
    # the warm-up's own tail (its transfer's wire-up, the first step's compilation) is over, and the gateway's
    # polls have slowed to their idle pace
    time.sleep(2.0 + WorkerPool.QUIET_POLLS * GatewayOptions.poll_interval)
    pids = {name: p.pid for name, p in zip(("prefill", "decode", "gateway"), pair.procs)}
    share = _idle_share(pids)
    print(f"\nidle stack: {', '.join(f'{r} {s:.4f} core' for r, s in share.items())}")
    assert all(s < IDLE_CORES for s in share.values()), share


async def _warm(stack: Stack) -> None:
    async with Client(stack.gateway) as client:
        await client.complete(prompt="Hi", max_tokens=1, timeout=BOUND_S)  # a 1-token step, as in the issue


async def test_a_burst_to_one_prefill_worker_completes_while_hogs_share_the_cores(pair: Stack):
    """16 short prompts at once after a 1-token warm-up, two hogs on both cores: every one completes. The
    prefill worker has no other worker to send them to, so it queues them whatever its backlog looks like."""
    await _warm(pair)
    before = pair.stats(pair.decode[0], "decode").remote_prefills_total
    prompts = [f"Question {i}: name a city on a river, and say which river it is." for i in range(BURST)]
    with cpu_hogs(2):
        async with Client(pair.gateway) as client:
            results = await asyncio.gather(
                *(client.complete(prompt=p, max_tokens=12, timeout=BOUND_S) for p in prompts), return_exceptions=True
            )
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed
    assert all(r.finish_reason in ("length", "stop") and r.completion_tokens >= 1 for r in results)
    assert pair.stats(pair.decode[0], "decode").remote_prefills_total - before == BURST
    refused = sum(
        v for (name, labels), v in scrape(pair.metrics["gateway"]).items() if name == "pdserve_gateway_retries_total"
    )
    assert refused == 0


async def test_a_request_that_arrives_while_the_only_decode_worker_restarts_waits_for_it(pair: Stack):
    """No decode worker is up when the request comes: it waits (--worker-wait) instead of failing, and is served
    by the worker once it is back, whether or not the gateway's own poll has seen it yet."""
    address = pair.decode[0]
    proc = _proc(pair, address)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
    async with Client(pair.gateway) as client:
        call = asyncio.ensure_future(client.complete(prompt="The sea is", max_tokens=4, timeout=BOUND_S))
        await asyncio.sleep(1.0)
        assert not call.done()  # waiting, not failed
        await asyncio.to_thread(_restart, pair, address)
        result = await call
    assert result.completion_tokens == 4


@pytest.fixture(scope="module")
def two_decode(pair):
    """Two decode workers and one prefill worker; no drain grace, so SIGTERM hands every stream back. Started
    after `pair` has stopped (module fixtures end in reverse order only at the end, so it is stopped here)."""
    pair.stop()
    stack = start_stack(decode_workers=2, prefill_workers=1, decode_extra=["--drain-grace", "0"])
    try:
        yield stack
    finally:
        stack.stop()


async def test_killing_the_busier_decode_worker_under_load_loses_no_stream(two_decode: Stack):
    stack = two_decode
    reference = await _reference(stack.gateway, False)
    before = _migrations(stack)
    with cpu_hogs(1):
        streams = _Streams(stack.gateway, False)
        await streams.started()
        victim = _busiest(stack)
        _proc(stack, victim).send_signal(signal.SIGKILL)
        _exact(await streams.results(), reference)
    assert _migrations(stack) - before >= 1
    await _idle(stack, next(a for a in stack.decode if a != victim))
    _restart(stack, victim)


async def test_a_rolling_restart_under_load_fails_nothing(two_decode: Stack):
    """SIGTERM one decode worker, start it again, then the other, with a hog running: the second worker's streams
    go to the first as soon as it is back, even if the gateway had not yet seen it come back."""
    stack = two_decode
    reference = await _reference(stack.gateway, False)
    before = _migrations(stack, "drain")
    with cpu_hogs(1):
        for address in stack.decode:
            streams = _Streams(stack.gateway, False)
            await streams.started()
            proc = _proc(stack, address)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0
            _exact(await streams.results(), reference)
            _restart(stack, address)
    assert _migrations(stack, "drain") - before >= 2
    for address in stack.decode:
        await _idle(stack, address)
