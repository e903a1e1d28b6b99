"""The whole pipeline — gateway -> decode -> prefill over gRPC, KV over UCX — as real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pdserve.client import Client
from tests.conftest import EOS, hf_greedy, until_eos
from tests.stack import scrape, start_stack

pytestmark = pytest.mark.slow

WORDS = "the quick brown fox jumps over a lazy dog while seven curious owls watch from an old oak tree".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5, 12, 40, 90, 150]))) for _ in range(n)]


@pytest.fixture(scope="module")
def stack():
    """The decode worker speculates (up to 4 guesses a step, by prompt lookup, and by a draft model, the GGUF's own
    4-bit blocks, where lookup finds nothing): every answer below must still be transformers' greedy text, token for
    token."""
    s = start_stack(decode_extra=["--speculative-tokens", "4", "--speculative-draft", "gguf"])
    yield s
    s.stop()


async def test_concurrent_greedy_requests_match_transformers(stack, hf_model, tokenizer):
    n_tokens = 24
    texts = _texts(16, seed=3)
    requests = [
        ({"messages": [{"role": "user", "content": t}]} if i % 2 else {"prompt": t}) for i, t in enumerate(texts)
    ]
    async with Client(stack.gateway) as client:
        results = await asyncio.gather(*(client.complete(**r, max_tokens=n_tokens, temperature=0.0) for r in requests))
    for r, got in zip(requests, results):
        prompt_ids = tokenizer.apply_chat_template(r["messages"]) if "messages" in r else tokenizer.encode(r["prompt"])
        want = until_eos(hf_greedy(hf_model, prompt_ids, n_tokens))
        assert got.token_ids == want
        assert got.text == tokenizer.decode(want)
        assert got.prompt_tokens == len(prompt_ids) and got.completion_tokens == len(want)
        assert got.finish_reason == ("stop" if want[-1] == EOS else "length")
    stack.wait_idle()


COPY = (
    "Copy this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears, plums, "
    "cherries, apples, pears, plums, cherries."
)


async def test_the_decode_worker_speculates_on_repeated_text(stack, hf_model, tokenizer):
    """A prompt the answer copies from: guesses are kept, the tokens stay transformers' greedy ones, and a request
    that turns speculation off (speculative_tokens 0) is served beside it with its own tokens. Guesses get checked
    however dear a busy machine makes the step cost look: the engine checks one after 16 steps that trimmed them all,
    and this answer has dozens of steps with guesses."""
    messages = [{"role": "user", "content": COPY}]
    want = until_eos(hf_greedy(hf_model, tokenizer.apply_chat_template(messages), 64))
    page = scrape(stack.metrics["decode"])
    before = page.get(("pdserve_decode_speculative_accepted_tokens_total", frozenset()), 0.0)
    async with Client(stack.gateway) as client:
        on, off = await asyncio.gather(
            client.complete(messages=messages, max_tokens=64, temperature=0.0),
            client.complete(messages=messages, max_tokens=64, temperature=0.0, speculative_tokens=0),
        )
    assert on.token_ids == want and off.token_ids == want
    page = scrape(stack.metrics["decode"])
    assert page[("pdserve_decode_speculative_accepted_tokens_total", frozenset())] - before > 0
    assert page[("pdserve_decode_speculative_acceptance_ratio_count", frozenset())] >= 1
    stack.wait_idle()


async def test_the_decode_worker_drafts_where_there_is_nothing_to_look_up(stack, hf_model, tokenizer):
    """Free text: the answer is transformers' greedy one, and the draft model's guesses are mostly kept. The counters
    are the worker's since it started: how many guesses a step checks follows measured step costs, but a fresh
    worker's first steps, with nothing measured, check every guess."""
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    want = until_eos(hf_greedy(hf_model, tokenizer.apply_chat_template(messages), 48))
    async with Client(stack.gateway) as client:
        got = await client.complete(messages=messages, max_tokens=48, temperature=0.0)
    assert got.token_ids == want
    page = scrape(stack.metrics["decode"])
    proposed, accepted = (
        page[(f"pdserve_decode_speculative_draft_{n}_tokens_total", frozenset())] for n in ("proposed", "accepted")
    )
    assert accepted > proposed / 2 > 0
    stack.wait_idle()


async def test_seeded_sampling_repeats(stack):
    async with Client(stack.gateway) as client:
        kw = dict(prompt="Tell me a story about a dragon", max_tokens=16, temperature=1.0, top_p=0.95)
        a = await client.complete(**kw, seed=7)
        b = await client.complete(**kw, seed=7)
        c = await client.complete(**kw, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


async def test_prefix_cache_serves_repeated_prompt(stack):
    prompt = " ".join(WORDS * 4)
    async with Client(stack.gateway) as client:
        first = await client.complete(prompt=prompt, max_tokens=4, temperature=0.0)
        second = await client.complete(prompt=prompt, max_tokens=4, temperature=0.0)
    assert first.token_ids == second.token_ids
    assert second.cached_prompt_tokens >= 16 * ((first.prompt_tokens - 1) // 16)


def _engine_work(stack) -> tuple[float, float]:
    """Sequence-steps the decode worker has run and prompt tokens the prefill worker has computed, so far."""
    decode, prefill = scrape(stack.metrics["decode"]), scrape(stack.metrics["prefill"])
    return (
        decode[("pdserve_decode_batch_size_sum", frozenset())],
        prefill[("pdserve_prefill_batch_tokens_sum", frozenset())],
    )


async def test_cancel_mid_stream_frees_every_block_and_stops_generating(stack):
    stack.wait_idle()
    steps_before, _ = _engine_work(stack)
    async with Client(stack.gateway) as client:
        call = client.stream(prompt="Count from one to a thousand:", max_tokens=400, temperature=0.0, ignore_eos=True)
        seen = 0
        async for resp in call:
            seen += len(resp.token_ids)
            if seen >= 3:
                break
        call.cancel()
        assert seen >= 3
    stack.wait_idle()
    steps, _ = _engine_work(stack)
    assert steps - steps_before < 200, "the decode worker went on generating for a cancelled request"


async def test_deadline_stops_work(stack):
    stack.wait_idle()
    steps_before, _ = _engine_work(stack)
    async with Client(stack.gateway) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(
                prompt="Write a long essay", max_tokens=500, ignore_eos=True, temperature=0.0, timeout=1.5
            )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle()
    steps, _ = _engine_work(stack)
    assert steps - steps_before < 500, "the decode worker went on generating past the deadline"


async def test_deadline_abandons_a_long_prefill_between_chunks(stack):
    """A 2500-token prompt is computed in chunks of at most 2048 tokens; a deadline that fires during the first
    chunk (seconds of work on one CPU thread) ends the request, and the chunk after it is never computed."""
    stack.wait_idle()
    _, tokens_before = _engine_work(stack)
    prompt = list(range(1000, 3500))
    async with Client(stack.gateway) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(prompt_token_ids=prompt, max_tokens=4, temperature=0.0, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle()
    _, tokens = _engine_work(stack)
    assert tokens - tokens_before < len(prompt), "the prefill worker computed the whole abandoned prompt"


async def test_burst_of_50_requests_returns_pool_to_idle(stack):
    async with Client(stack.gateway) as client:
        results = await asyncio.gather(
            *(client.complete(prompt=t, max_tokens=8, temperature=0.0) for t in _texts(50, seed=11))
        )
    assert all(r.finish_reason in ("stop", "length") for r in results)
    idle = stack.wait_idle()
    assert idle.kv_blocks_used == 0


async def test_stop_string_is_never_streamed(stack, tokenizer):
    async with Client(stack.gateway) as client:
        free = await client.complete(prompt="The capital of France is", max_tokens=20, temperature=0.0)
        stop = free.text.strip()[3:6]
        assert stop
        got = await client.complete(prompt="The capital of France is", max_tokens=20, temperature=0.0, stop=[stop])
    assert got.finish_reason == "stop"
    assert got.text == free.text[: free.text.index(stop)]
    stack.wait_idle()


@pytest.mark.parametrize(
    "kwargs,code,needle",
    [
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (dict(prompt="hello " * 9000), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        (dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(prompt="hi", top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "does not exist"),
        (dict(messages=[]), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (dict(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
        (dict(prompt="hi", temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(prompt="hi", max_tokens=10**9), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt="hi", request_id="r" * 600), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (dict(prompt="x" * (5 << 20)), grpc.StatusCode.INVALID_ARGUMENT, "bytes"),
    ],
)
async def test_bad_input_gets_its_status_and_service_keeps_serving(stack, kwargs, code, needle):
    async with Client(stack.gateway) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(**kwargs)
        assert err.value.code() == code
        assert needle in err.value.details()
        ok = await client.complete(prompt="Hello", max_tokens=2, temperature=0.0)
        assert len(ok.token_ids) >= 1
    stack.wait_idle()


async def test_small_pool_preempts_recomputes_and_refuses_overflow():
    """A decode pool of 11 blocks and no admission queue: what fits runs (growing sequences are preempted and
    recomputed through the prefill worker) and gives the solo-run tokens; what does not fit is RESOURCE_EXHAUSTED."""
    small = start_stack(extra=["--kv-cache-memory", "8M"], decode_extra=["--max-queued", "0"])
    try:
        prompt = " ".join(WORDS * 2)
        kw = dict(prompt=prompt, max_tokens=60, ignore_eos=True, temperature=0.0)
        async with Client(small.gateway) as client:
            solo = await client.complete(**kw)
            results = await asyncio.gather(*(client.complete(**kw) for _ in range(8)), return_exceptions=True)
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert served and all(r.token_ids == solo.token_ids for r in served)
        assert len(refused) + len(served) == 8
        assert small.stats(small.decode[0], "decode").preemptions_total > 0
        small.wait_idle(timeout=60)
    finally:
        small.stop()


async def test_no_worker_is_unavailable(model_dir):
    import subprocess
    import sys

    from tests.stack import free_port, service_env, wait_serving

    port = free_port()
    dead = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "gateway",
            "--port",
            str(port),
            "--prefill",
            dead,
            "--decode",
            dead,
            "--ready-timeout",
            "0.5",
        ],
        env=service_env(),
    )
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        async with Client(f"127.0.0.1:{port}") as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(prompt="hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(30)


def _list_services(address: str, service: str) -> set[str]:
    """Ask the reflection service `service` (v1 or v1alpha: the same messages) which services a server has."""
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        resp = next(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        return {s.name for s in resp.list_services_response.service}


def test_health_everywhere_and_reflection_only_on_the_public_gateway(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address in (stack.gateway, *stack.prefill, *stack.decode):
        with grpc.insecure_channel(address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    for version in ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"):
        assert {"pdserve.v1.Generation", "grpc.health.v1.Health", version} <= _list_services(stack.gateway, version)
        for worker in (*stack.prefill, *stack.decode):  # internal services: reflection is off unless asked for
            with pytest.raises(grpc.RpcError) as err:
                _list_services(worker, version)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_tokenize_and_list_models(stack, tokenizer):
    async with Client(stack.gateway) as client:
        assert await client.tokenize(prompt="Hello world") == tokenizer.encode("Hello world")
        models = await client.list_models()
    assert models[0].id == "SmolLM2-135M-Instruct" and models[0].max_model_len == 8192


async def test_gateway_retries_on_another_decode_worker_when_one_dies():
    """Two decode workers; one is killed after the gateway last polled it (it polls only at start here), so the
    router still believes in it: requests sent there fail UNAVAILABLE and are retried on the other one."""
    import signal

    two = start_stack(decode_workers=2, gateway_extra=["--poll-interval", "3600"])
    try:
        healthy = ("pdserve_gateway_workers", frozenset({("role", "decode"), ("state", "healthy")}))
        deadline = time.monotonic() + 60
        while scrape(two.metrics["gateway"])[healthy] < 2:  # the router has seen both decode workers up
            assert time.monotonic() < deadline, "the gateway never saw both decode workers healthy"
            await asyncio.sleep(0.1)
        dead = two.procs[1]  # prefill, decode 0, decode 1, gateway
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        before = scrape(two.metrics["gateway"]).get(("pdserve_gateway_retries_total", frozenset()), 0)
        async with Client(two.gateway) as client:
            results = await asyncio.gather(
                *(client.complete(prompt=f"Say {i}", max_tokens=4, temperature=0.0) for i in range(6))
            )
        assert all(r.finish_reason in ("stop", "length") and r.token_ids for r in results)
        after = scrape(two.metrics["gateway"])[("pdserve_gateway_retries_total", frozenset())]
        assert after - before >= 1
        assert two.stats(two.decode[1], "decode").requests_total == 6
    finally:
        two.stop()
