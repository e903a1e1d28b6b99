"""`pdserve colocated`: prefill and decode in one process behind the same gateway, exact to transformers."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.stack import scrape, start_stack

pytestmark = pytest.mark.slow
EOS = 2


@pytest.fixture(scope="module")
def stack():
    s = start_stack(colocated=True, extra=["--max-num-batched-tokens", "64"])
    yield s
    s.stop()


async def test_colocated_greedy_matches_transformers(stack, hf_model):
    hf = hf_model
    prompts = [list(range(300, 300 + n)) for n in (3, 17, 70, 150)]  # 150 > the 64-token budget: chunked
    async with Client(stack.gateway) as client:
        results = await asyncio.gather(
            *(client.complete(prompt_token_ids=p, max_tokens=12, temperature=0.0) for p in prompts)
        )
    for p, got in zip(prompts, results):
        want = hf_greedy(hf, p, 12)
        want = want[: want.index(EOS) + 1] if EOS in want else want
        assert got.token_ids == want
        assert got.prompt_tokens == len(p)
    stats = stack.stats(stack.decode[0], "decode")
    assert stats.role == "colocated" and stats.requests_total == len(prompts)
    stack.wait_idle()


async def test_colocated_cancel_frees_blocks_and_metrics_count(stack):
    before = scrape(stack.metrics["decode"])
    async with Client(stack.gateway) as client:
        call = client.stream(prompt="Count from one to a thousand:", max_tokens=300, ignore_eos=True)
        seen = 0
        async for resp in call:
            seen += len(resp.token_ids)
            if seen >= 3:
                break
        call.cancel()
        await client.complete(prompt="Hello", max_tokens=4, ignore_eos=True)
    stack.wait_idle()
    after = scrape(stack.metrics["decode"])
    key = ("pdserve_decode_requests_total", frozenset({("status", "ok")}))
    assert after[key] - before.get(key, 0) == 1
    cancelled = ("pdserve_decode_requests_total", frozenset({("status", "cancelled")}))
    for _ in range(50):
        if after.get(cancelled, 0) >= 1:
            break
        await asyncio.sleep(0.1)
        after = scrape(stack.metrics["decode"])
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == 1
