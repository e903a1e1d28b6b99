"""No request can hurt another, no worker dies silently, nobody unauthenticated gets in: on real processes."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import grpc
import pytest

from pdserve.client import Client
from pdserve.protos import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.security import TLSConfig
from tests.certs import make_pki
from tests.stack import channel, scrape, service_env, start_stack

PDSERVE = [sys.executable, "-m", "pdserve.cli"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    s = start_stack()
    yield s
    s.stop()


def _prefill_request(kv_address: str, rid: str = "direct") -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=rid,
        token_ids=list(range(300, 340)),
        num_prompt_tokens=40,
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
        kv_target=worker_pb2.KVTarget(address=kv_address, layout_fingerprint="x", transfer_id="t-" + rid, secret="s"),
    )


def _fingerprint(stack) -> str:
    from pdserve.engine.config import ModelConfig, parse_dtype
    from pdserve.engine.kv_cache import plan_kv_cache
    from pdserve.engine.model_store import resolve_model

    path = resolve_model(None)
    layout = plan_kv_cache(ModelConfig.from_dir(path), parse_dtype("float32"), 16, 128 << 20)
    return layout.fingerprint


async def test_a_kv_target_that_is_not_a_receiver_fails_only_its_request(stack):
    """A Prefill naming a KV target that resets the connection (a plain TCP port) or never answers (a black
    hole) fails that request alone: the prefill worker keeps serving, even while the black hole is pending."""
    reset = socket.socket()
    reset.bind(("127.0.0.1", 0))
    reset.listen()
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen()
    fingerprint = _fingerprint(stack)
    try:
        async with grpc.aio.insecure_channel(stack.prefill[0]) as ch:
            stub = worker_pb2_grpc.PrefillServiceStub(ch)
            bad = _prefill_request(f"ucx://127.0.0.1:{reset.getsockname()[1]}", "reset")
            bad.kv_target.layout_fingerprint = fingerprint
            reset.close()  # connections to it are refused outright now
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(bad, timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            stuck = _prefill_request(f"ucx://127.0.0.1:{hole.getsockname()[1]}", "hole")
            stuck.kv_target.layout_fingerprint = fingerprint
            pending = asyncio.ensure_future(stub.Prefill(stuck, timeout=120))
            async with Client(stack.gateway) as client:
                ok = await client.complete(prompt="Hello there", max_tokens=4, temperature=0.0)
            assert ok.finish_reason in ("stop", "length") and ok.token_ids
            assert not pending.done(), "the black-hole request should still be waiting, alone"
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        stats = stack.stats(stack.prefill[0], "prefill")
        assert stats.requests_total >= 1
        with channel(stack.prefill[0]) as ch:
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    finally:
        hole.close()
    stack.wait_idle()


async def test_skip_blocks_must_leave_a_block_to_send(stack):
    """A Prefill that says its caller holds every block of the prompt is refused, naming skip_blocks: the last
    block (the last prompt token's KV) always travels."""
    from pdserve.failures import INVALID_PARAMETER

    request = _prefill_request("ucx://127.0.0.1:1", "skip-all")
    request.kv_target.layout_fingerprint = _fingerprint(stack)
    request.skip_blocks = 3  # 40 tokens: blocks of 16, 16 and 8
    async with grpc.aio.insecure_channel(stack.prefill[0]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await worker_pb2_grpc.PrefillServiceStub(ch).Prefill(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "skip_blocks" in (err.value.details() or "")
    assert dict(err.value.trailing_metadata() or ()).get(INVALID_PARAMETER) == "skip_blocks"


async def test_tiny_temperature_in_a_batch_hurts_nobody(stack):
    async with Client(stack.gateway) as client:
        kinds = [dict(temperature=1e-37), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=3)] * 2
        results = await asyncio.gather(
            *(
                client.complete(prompt=f"Tell me about {i}", max_tokens=12, ignore_eos=True, **kw)
                for i, kw in enumerate(kinds)
            )
        )
    assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in results)
    stack.wait_idle()


async def test_a_big_prompt_is_tokenized_off_the_event_loop(stack):
    """While the gateway tokenizes a large prompt (which is then refused: too many tokens), another request
    keeps streaming: tokens arrive during the tokenization."""
    big = "lorem ipsum dolor sit amet " * 36000  # ~970 kB: under the byte limit, far over the context
    async with Client(stack.gateway) as client:
        arrivals: list[float] = []

        async def stream():
            async for _ in client.stream(
                prompt="Count to a hundred:", max_tokens=150, ignore_eos=True, temperature=0.0
            ):
                arrivals.append(time.monotonic())

        streaming = asyncio.ensure_future(stream())
        while len(arrivals) < 3:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(prompt=big, max_tokens=4)
        end = time.monotonic()
        await streaming
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in err.value.details()
    assert any(start < t < end for t in arrivals), "no token arrived while the big prompt was being tokenized"
    stack.wait_idle()


async def test_deadlines_are_counted_as_deadlines(stack):
    before_gw, before_dec = scrape(stack.metrics["gateway"]), scrape(stack.metrics["decode"])
    async with Client(stack.gateway) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete(prompt="Write a long essay", max_tokens=400, ignore_eos=True, timeout=3.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle()
    key_gw = ("pdserve_gateway_requests_total", frozenset({("status", "DEADLINE_EXCEEDED"), ("finish_reason", "")}))
    key_dec = ("pdserve_decode_requests_total", frozenset({("status", "deadline_exceeded")}))
    for _ in range(50):
        gw, dec = scrape(stack.metrics["gateway"]), scrape(stack.metrics["decode"])
        if gw.get(key_gw, 0) > before_gw.get(key_gw, 0) and dec.get(key_dec, 0) > before_dec.get(key_dec, 0):
            break
        await asyncio.sleep(0.1)
    assert gw.get(key_gw, 0) - before_gw.get(key_gw, 0) == 1
    assert dec.get(key_dec, 0) - before_dec.get(key_dec, 0) == 1


async def test_stop_string_is_a_finish_on_the_decode_worker_too(stack):
    before = scrape(stack.metrics["decode"])
    async with Client(stack.gateway) as client:
        free = await client.complete(prompt="The capital of France is", max_tokens=20, temperature=0.0)
        stop = free.text.strip()[3:6]
        got = await client.complete(prompt="The capital of France is", max_tokens=20, temperature=0.0, stop=[stop])
    assert got.finish_reason == "stop"
    stack.wait_idle()
    after = scrape(stack.metrics["decode"])
    ok, cancelled = (("pdserve_decode_requests_total", frozenset({("status", s)})) for s in ("ok", "cancelled"))
    assert after[ok] - before[ok] == 2
    assert after.get(cancelled, 0) == before.get(cancelled, 0)


async def test_decode_dials_only_prefill_workers_it_was_given():
    """A caller that reaches a decode worker cannot make it dial an address of its choosing."""
    guarded = start_stack(decode_extra=["--prefill", "127.0.0.1:1"])  # the real prefill worker is not on it
    try:
        async with grpc.aio.insecure_channel(guarded.decode[0]) as ch:
            stub = worker_pb2_grpc.DecodeServiceStub(ch)
            call = stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="x",
                    prompt_token_ids=[5, 6, 7],
                    sampling=common_pb2.SamplingParams(max_tokens=2),
                    prefill_address=guarded.prefill[0],
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # through the gateway: the refusal names the prefill worker, which is tried no more (none is left here)
        async with Client(guarded.gateway) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(prompt="Hello there", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--prefill" in err.value.details()
        assert guarded.stats(guarded.decode[0], "decode").kv_blocks_used == 0
    finally:
        guarded.stop()


async def test_tls_everywhere_mutual_between_services_and_an_api_key(tmp_path):
    pki = make_pki(tmp_path, ["gateway", "prefill", "decode", "client"])
    me = TLSConfig(*pki["client"], pki["ca"][0])
    secured = start_stack(
        everyone=["--tls-cert", pki["gateway"][0], "--tls-key", pki["gateway"][1], "--tls-ca", pki["ca"][0]],
        gateway_extra=["--api-key", "sesame"],
        tls=me,
    )
    try:
        async with Client(secured.gateway, api_key="sesame", tls=TLSConfig(ca=pki["ca"][0])) as client:
            ok = await client.complete(prompt="Hello", max_tokens=3, temperature=0.0)
        assert ok.token_ids
        async with Client(secured.gateway, tls=TLSConfig(ca=pki["ca"][0])) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(prompt="Hello", max_tokens=3)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with Client(secured.gateway, api_key="sesame") as client:  # plaintext to a TLS port
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(prompt="Hello", max_tokens=3, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # a worker takes calls only from holders of a certificate the CA signed
        no_cert = TLSConfig(ca=pki["ca"][0])
        with channel(secured.decode[0], no_cert) as ch:
            with pytest.raises(grpc.RpcError):
                worker_pb2_grpc.DecodeServiceStub(ch).GetStats(worker_pb2.StatsRequest(), timeout=10)
        assert secured.stats(secured.decode[0], "decode").requests_total == 1
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with channel(secured.gateway, TLSConfig(ca=pki["ca"][0])) as ch:  # health needs no key
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    finally:
        secured.stop()


async def test_tls_with_one_service_name_for_workers_dialled_by_address(tmp_path):
    """Certificates that name only `pdserve.internal` (as in Kubernetes, where workers are dialled by pod IP):
    with --tls-server-name every hop verifies against that name; without it, 127.0.0.1 is not in them."""
    pki = make_pki(tmp_path, ["service"], dns=["pdserve.internal"])
    tls = ["--tls-cert", pki["service"][0], "--tls-key", pki["service"][1], "--tls-ca", pki["ca"][0]]
    me = TLSConfig(*pki["service"], pki["ca"][0], server_name="pdserve.internal")
    secured = start_stack(everyone=[*tls, "--tls-server-name", "pdserve.internal"], tls=me)
    try:
        async with Client(secured.gateway, tls=TLSConfig(ca=pki["ca"][0], server_name="pdserve.internal")) as c:
            assert (await c.complete(prompt="Hello", max_tokens=3, temperature=0.0)).token_ids
        async with Client(secured.gateway, tls=TLSConfig(ca=pki["ca"][0])) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.complete(prompt="Hello", max_tokens=3, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        env = {
            **service_env(),
            "PDSERVE_TLS_CERT": pki["service"][0],
            "PDSERVE_TLS_KEY": pki["service"][1],
            "PDSERVE_TLS_CA": pki["ca"][0],
            "PDSERVE_TLS_SERVER_NAME": "pdserve.internal",
        }
        probe = subprocess.run(
            [*PDSERVE, "health", "--address", secured.decode[0]], env=env, capture_output=True, text=True, timeout=60
        )
        assert probe.returncode == 0, probe.stderr
    finally:
        secured.stop()
