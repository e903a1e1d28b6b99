"""The whole pipeline — gateway -> decode -> prefill over gRPC, KV over UCX — as real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.stack import start_stack

pytestmark = pytest.mark.slow

EOS = 2
WORDS = "the quick brown fox jumps over a lazy dog while seven curious owls watch from an old oak tree".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5, 12, 40, 90, 150]))) for _ in range(n)]


@pytest.fixture(scope="module")
def stack():
    s = start_stack()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from gateway.tokenizer import Tokenizer

    return Tokenizer(model_dir)


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


async def test_concurrent_greedy_requests_match_transformers(stack, hf_model, tokenizer):
    n_tokens = 24
    texts = _texts(16, seed=3)
    requests = [({"messages": [{"role": "user", "content": t}]} if i % 2 else {"prompt": t}) for i, t in enumerate(texts)]
    async with Client(stack.gateway) as client:
        results = await asyncio.gather(*(client.complete(**r, max_tokens=n_tokens, temperature=0.0)
                                         for r in requests))
    for r, got in zip(requests, results):
        prompt_ids = (tokenizer.apply_chat_template(r["messages"]) if "messages" in r else tokenizer.encode(r["prompt"]))
        want = _until_eos(hf_greedy(hf_model, prompt_ids, n_tokens))
        assert got.token_ids == want
        assert got.text == tokenizer.decode(want)
        assert got.prompt_tokens == len(prompt_ids) and got.completion_tokens == len(want)
        assert got.finish_reason == ("stop" if want[-1] == EOS else "length")
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


async def test_cancel_mid_stream_frees_every_block(stack):
    async with Client(stack.gateway) as client:
        call = client.stream(prompt="Count from one to a thousand:", max_tokens=400, temperature=0.0,
                             ignore_eos=True)
        seen = 0
        async for resp in call:
            seen += len(resp.token_ids)
            if seen >= 3:
                break
        call.cancel()
        assert seen >= 3
        mid = stack.stats(stack.decode[0], "decode")
        assert mid.requests_total >= 1
    stack.wait_idle()


async def test_deadline_stops_work(stack):
    async with Client(stack.gateway) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(prompt="Write a long essay", max_tokens=500, ignore_eos=True, temperature=0.0,
                                  timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle()


async def test_burst_of_50_requests_returns_pool_to_idle(stack):
    async with Client(stack.gateway) as client:
        results = await asyncio.gather(*(client.complete(prompt=t, max_tokens=8, temperature=0.0)
                                         for t in _texts(50, seed=11)))
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


@pytest.mark.parametrize("kwargs,code,needle", [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (dict(prompt="hello " * 9000), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    (dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", top_p=2.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(prompt="hi", model="gpt-9"), grpc.StatusCode.INVALID_ARGUMENT, "unknown model"),
    (dict(messages=[]), grpc.StatusCode.INVALID_ARGUMENT, "no messages"),
    (dict(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
])
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
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "gateway", "--port", str(port), "--prefill", dead,
                             "--decode", dead, "--ready-timeout", "0.5"], env=service_env())
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        async with Client(f"127.0.0.1:{port}") as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(prompt="hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(30)


def test_health_and_reflection_on_every_service(stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for address, service in [(stack.gateway, "pdserve.v1.Generation"), (stack.prefill[0], "pdserve.v1.PrefillService"),
                             (stack.decode[0], "pdserve.v1.DecodeService")]:
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in resp.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


async def test_tokenize_and_list_models(stack, tokenizer):
    async with Client(stack.gateway) as client:
        assert await client.tokenize(prompt="Hello world") == tokenizer.encode("Hello world")
        models = await client.list_models()
    assert models[0].id == "SmolLM2-135M-Instruct" and models[0].max_model_len == 8192
