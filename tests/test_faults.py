"""Faults under load: workers killed, stopped and restarted while requests stream. Every request ends with a
finish reason or a status that names what failed; none is lost; no worker that survives holds a block."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess

import grpc
import pytest

from pdserve.client import Client
from tests.stack import service_env, start_stack, wait_serving

pytestmark = pytest.mark.slow
REQUEST_BOUND = 180.0  # seconds: a request still running after this counts as lost


async def _load(gateway: str, n: int, concurrency: int, seed: int) -> list:
    """n requests at a concurrency cap; each result is a Completion or the AioRpcError that ended it."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    async with Client(gateway) as client:

        async def one(i: int):
            async with limit:
                words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randrange(5, 60)))
                try:
                    return await asyncio.wait_for(
                        client.complete(prompt=f"{i}: {words}", max_tokens=32, ignore_eos=True, temperature=0.0),
                        REQUEST_BOUND,
                    )
                except grpc.aio.AioRpcError as e:
                    return e
                except TimeoutError:
                    return "lost"

        return await asyncio.gather(*(one(i) for i in range(n)))


def _check(results: list, addresses: list[str]) -> tuple[int, int]:
    """(finished, failed with a clear status); asserts nothing was lost and every failure names a worker."""
    assert "lost" not in results, "a request neither finished nor failed within the bound"
    failed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    finished = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 32 for r in finished)
    for e in failed:
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED), (e.code(), e.details())
        assert any(a in (e.details() or "") for a in addresses) or "no healthy" in (e.details() or ""), e.details()
    return len(finished), len(failed)


async def test_kill_stop_and_restart_under_load():
    stack = start_stack(decode_workers=2, prefill_workers=2)
    try:
        procs = dict(zip([*stack.prefill, *stack.decode, stack.gateway], stack.procs))
        addresses = [*stack.prefill, *stack.decode]
        report = {}

        # 1. a prefill worker is killed mid-load, some of its prompts mid-transfer into reserved decode blocks:
        # each is retried on the other prefill worker (the decode side frees the reservation and reserves anew)
        load = asyncio.ensure_future(_load(stack.gateway, 24, 8, seed=1))
        await asyncio.sleep(3)
        victim = procs[stack.prefill[0]]
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        report["prefill killed"] = _check(await load, addresses)
        assert report["prefill killed"][1] == 0, "prompts of the killed prefill worker should have been retried"

        # 2. it comes back on the same port; the gateway routes to it again
        restarted = subprocess.Popen(victim.args, env=service_env())
        stack.procs.append(restarted)
        wait_serving(stack.prefill[0], restarted)
        report["prefill restarted"] = _check(await _load(stack.gateway, 16, 8, seed=2), addresses)

        # 3. a decode worker is frozen for a while (SIGSTOP) and thawed: its requests are slow, not lost
        frozen = procs[stack.decode[0]]
        load = asyncio.ensure_future(_load(stack.gateway, 16, 8, seed=3))
        await asyncio.sleep(2)
        os.kill(frozen.pid, signal.SIGSTOP)
        await asyncio.sleep(3)
        os.kill(frozen.pid, signal.SIGCONT)
        report["decode stopped and resumed"] = _check(await load, addresses)

        # 4. a decode worker is killed while it streams; its streams move to the other one (migration)
        load = asyncio.ensure_future(_load(stack.gateway, 24, 8, seed=4))
        busy = None
        for _ in range(600):
            busy = next((a for a in stack.decode if stack.stats(a, "decode").running >= 2), None)
            if busy:
                break
            await asyncio.sleep(0.05)
        assert busy, "no decode worker was running sequences"
        procs[busy].send_signal(signal.SIGKILL)
        procs[busy].wait(30)
        report["decode killed"] = _check(await load, addresses)
        assert report["decode killed"][1] == 0, "the killed worker's streams should have moved, not failed"

        survivors = [a for a in [*stack.prefill, *stack.decode] if a != busy]
        for address in survivors:
            role = "prefill" if address in stack.prefill else "decode"
            for _ in range(300):
                stats = stack.stats(address, role)
                if stats.kv_blocks_used == 0 and stats.running == 0 and stats.pending_transfers == 0:
                    break
                await asyncio.sleep(0.1)
            assert stats.kv_blocks_used == 0, (address, stats)
        print("\nfault run (finished, failed with a clear status):", report)
        assert report["prefill restarted"] == (16, 0)
    finally:
        stack.stop()
