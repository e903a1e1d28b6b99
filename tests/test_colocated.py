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


async def test_colocated_constraint_over_grpc(stack):
    """The gRPC API's own constraint field, in one process: the answer validates; a regex that does not compile
    is INVALID_ARGUMENT naming `constraint`."""
    import json

    import grpc
    import jsonschema

    from pdserve.protos import common_pb2

    schema = {
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": ["colours"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Name three colours, as JSON."}]
    async with Client(stack.gateway) as client:
        got = await client.complete(
            messages=messages,
            max_tokens=60,
            temperature=0.0,
            constraint=common_pb2.Constraint(json_schema=json.dumps(schema), strict=True),
        )
        jsonschema.validate(json.loads(got.text), schema)
        assert got.finish_reason == "stop"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete(prompt="x", max_tokens=4, constraint=common_pb2.Constraint(regex="a(b"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in (e.value.details() or "")
    trailers = dict(e.value.trailing_metadata() or ())
    assert trailers.get("pdserve-invalid-parameter") == "constraint", trailers
