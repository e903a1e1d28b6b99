"""KV-aware routing and conditional disaggregation on real processes."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess

import pytest

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.stack import scrape, service_env, start_stack, wait_serving

pytestmark = pytest.mark.slow
BLOCK = 16


def _prefixes(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(400)] for _ in range(3)]


async def _round(client: Client, prefixes: list[list[int]], rng: random.Random) -> list:
    """Each prefix once, with its own short tail, all at once, in random order."""
    order = list(range(len(prefixes)))
    rng.shuffle(order)
    prompts = [prefixes[i] + [rng.randrange(1000, 40000) for _ in range(8)] for i in order]
    return await asyncio.gather(*(client.complete(prompt_token_ids=p, max_tokens=2, temperature=0.0) for p in prompts))


async def test_prefixes_follow_the_worker_that_caches_them():
    """Three prefill workers, three 400-token prefixes sent together for several rounds: after each prefix's
    first round its reusable blocks are hits, and the load stays spread over all three workers. A restarted
    worker comes back with an empty cache, and the index drops what it used to hold."""
    stack = start_stack(prefill_workers=3)  # 182 blocks each: room for all three prefixes, so no eviction
    try:
        rng = random.Random(1)
        prefixes = _prefixes(2)
        async with Client(stack.gateway) as client:
            rounds = [await _round(client, prefixes, rng) for _ in range(5)]
        reusable = (400 // BLOCK) * BLOCK
        hits = sum(r.cached_prompt_tokens for rnd in rounds[1:] for r in rnd)
        possible = reusable * 3 * (len(rounds) - 1)
        assert hits >= 0.9 * possible, f"{hits} of {possible} reusable prefix tokens hit"
        served = [stack.stats(a, "prefill").requests_total for a in stack.prefill]
        assert all(n >= 0.2 * sum(served) for n in served), served

        # a worker restarts with an empty cache: the gateway's index of it empties too, and fills again
        restart = stack.prefill[0]
        index = ("pdserve_gateway_prefix_index_blocks", frozenset({("worker", restart)}))
        assert scrape(stack.metrics["gateway"])[index] >= 400 // BLOCK
        proc = stack.procs[0]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        for _ in range(300):
            if scrape(stack.metrics["gateway"]).get(index, 0) == 0:
                break
            await asyncio.sleep(0.05)
        assert scrape(stack.metrics["gateway"]).get(index, 0) == 0, "the index still holds a dead worker's blocks"
        again = subprocess.Popen(proc.args, env=service_env())
        stack.procs.append(again)
        wait_serving(restart, again)
        # settles again: a round where every prefix hits (the first rounds after the restart may miss)
        async with Client(stack.gateway) as client:
            more = [await _round(client, prefixes, rng)]
            while sum(r.cached_prompt_tokens for r in more[-1]) < reusable * 3 and len(more) < 8:
                more.append(await _round(client, prefixes, rng))
        assert all(r.finish_reason for rnd in more for r in rnd)
        assert sum(r.cached_prompt_tokens for r in more[-1]) == reusable * 3, [
            [r.cached_prompt_tokens for r in rnd] for rnd in more
        ]
        stack.wait_idle()
    finally:
        stack.stop()


@pytest.mark.parametrize("routing,local_max", [("load", 0), ("kv-aware", 0), ("kv-aware", 64)])
async def test_every_routing_mode_is_token_exact(hf_model, routing, local_max):
    """Load-only, KV-aware, and KV-aware with short prompts prefilled on the decode worker: the same tokens as
    transformers. With the threshold, short prompts never reach a prefill worker and long ones always do."""
    stack = start_stack(
        gateway_extra=["--routing", routing], decode_extra=["--local-prefill-max-tokens", str(local_max)]
    )
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (12, 40, 63, 65, 120, 300)]
        before = scrape(stack.metrics["gateway"])
        async with Client(stack.gateway) as client:
            results = await asyncio.gather(
                *(client.complete(prompt_token_ids=p, max_tokens=10, temperature=0.0, ignore_eos=True) for p in prompts)
            )
        for p, got in zip(prompts, results):
            assert got.token_ids == hf_greedy(hf_model, p, 10)
        after = scrape(stack.metrics["gateway"])
        local = ("pdserve_gateway_prefill_routes_total", frozenset({("mode", "local")}))
        remote = ("pdserve_gateway_prefill_routes_total", frozenset({("mode", "remote")}))
        short = sum(len(p) <= local_max for p in prompts)
        assert after[local] - before[local] == short
        assert after[remote] - before[remote] == len(prompts) - short
        assert stack.stats(stack.prefill[0], "prefill").requests_total == len(prompts) - short
        decode = stack.stats(stack.decode[0], "decode")
        assert (decode.local_prefills_total, decode.remote_prefills_total) == (short, len(prompts) - short)
        stack.wait_idle()
    finally:
        stack.stop()
