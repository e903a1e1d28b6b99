"""Nothing a stranger sends can hurt a worker: junk and floods on the KV port, oversized and malformed bodies,
slow clients, a stopped or restarted worker. On real processes; every check ends by serving a real request."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.client import Client
from pdserve.protos import generation_pb2
from tests.hogs import cpu_seconds
from tests.stack import channel, scrape, start_stack

pytestmark = pytest.mark.slow
KEY = "sesame"
HEADER_TIMEOUT = 2
MAX_HTTP = 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    s = start_stack(
        env={"UCX_NET_DEVICES": None},  # the workers restrict UCX to their --host themselves
        prefill_workers=2,
        decode_extra=["--kv-data-ports", "43100-43199"],
        gateway_extra=[
            "--api-key-file",
            str(key_file),
            "--http-max-connections",
            str(MAX_HTTP),
            "--http-header-timeout",
            str(HEADER_TIMEOUT),
        ],
    )
    yield s
    s.stop()


def _generate(stack, prompt: str = "The capital of France is", max_tokens: int = 8) -> tuple[int, float]:
    """Tokens of one greedy request through the gateway, and how long it took."""

    async def run() -> tuple[int, float]:
        start = time.monotonic()
        async with Client(stack.gateway, api_key=KEY) as client:
            out = await client.complete(prompt, max_tokens=max_tokens, temperature=0.0, timeout=120)
        return out.completion_tokens, time.monotonic() - start

    return asyncio.run(run())


def _pid(stack, role: str) -> int:
    return stack.procs[{"prefill": 0, "decode": len(stack.prefill), "gateway": -1}[role]].pid


def _sockets(pid: int) -> dict[str, tuple[str, int, str]]:
    """inode -> (local address, local port, TCP state) for every TCP socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = {}
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[9] in inodes:
            host, port = cols[1].split(":")
            address = socket.inet_ntoa(bytes.fromhex(host)[::-1])
            out[cols[9]] = (address, int(port, 16), {"0A": "LISTEN", "08": "CLOSE_WAIT"}.get(cols[3], cols[3]))
    return out


def _kv_port(stack) -> int:
    return int(stack.stats(stack.decode[0], "decode").kv_address.rsplit(":", 1)[1])


def test_the_kv_receiver_listens_only_where_it_was_told(stack):
    """--host 127.0.0.1: the KV port and UCX's data-path listeners bind 127.0.0.1, the latter in --kv-data-ports."""
    kv = _kv_port(stack)
    listening = [(a, p) for a, p, state in _sockets(_pid(stack, "decode")).values() if state == "LISTEN"]
    assert (("127.0.0.1", kv)) in listening
    assert all(a == "127.0.0.1" for a, _ in listening), listening
    data = [p for a, p in listening if 43100 <= p <= 43199]
    assert data, f"no UCX data-path listener in --kv-data-ports: {listening}"


def test_junk_and_a_flood_on_the_kv_port_leave_nothing_behind(stack):
    """Random bytes and more connections than the cap: every socket is closed and reaped, no thread spins, and
    the next request's KV still lands."""
    pid, kv = _pid(stack, "decode"), _kv_port(stack)
    fds_before = len(os.listdir(f"/proc/{pid}/fd"))
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", kv)) as s:
            try:
                s.sendall(os.urandom(65536))
            except OSError:
                pass  # closed on us mid-send: what junk deserves
    flood = []
    for _ in range(300):
        try:
            flood.append(socket.create_connection(("127.0.0.1", kv), timeout=5))
        except OSError:
            break
    time.sleep(1)
    for s in flood:
        s.close()
    deadline = time.monotonic() + 30
    while True:
        left = [v for v in _sockets(pid).values() if v[1] == kv and v[2] != "LISTEN"]
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        if not left and fds <= fds_before + 4:
            break
        assert time.monotonic() < deadline, f"still open on the KV port: {left}; fds {fds_before} -> {fds}"
        time.sleep(0.5)
    cpu = cpu_seconds(pid)
    time.sleep(3)
    assert cpu_seconds(pid) - cpu < 1.5, "the idle decode worker burns CPU after junk on its KV port"
    text, _ = _generate(stack)
    assert text


def _http(stack, path: str, body: bytes | None, headers: dict | None = None, timeout: float = 60):
    req = urllib.request.Request(stack.http + path, data=body, method="POST" if body is not None else "GET")
    req.add_header("Authorization", f"Bearer {KEY}")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _completion(**fields) -> bytes:
    return json.dumps({"prompt": "Hello", "max_tokens": 2, **fields}).encode()


def _refusal_of_declared(stack, path: str, length: int) -> int:
    """The status a request head declaring a `length`-byte body gets before any of the body is sent (what a
    client sending `Expect: 100-continue` sees)."""
    port = int(stack.http.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )
        return int(s.recv(4096).split(b" ", 2)[1])


def _refusal_of_streamed(stack, size: int) -> int:
    """The status of a chunked body that grows past the limit without declaring its length."""
    port = int(stack.http.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"x" * (64 << 10)
        sent = 0
        while sent <= size:
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        return int(s.recv(4096).split(b" ", 2)[1])


def test_oversized_bodies_are_refused_before_they_are_read(stack):
    """413 for a body over --http-max-body (declared, or streamed past it), 400 for too many messages; a stream
    running beside them is untouched."""

    async def beside() -> int:
        async with Client(stack.gateway, api_key=KEY) as client:
            out = await client.complete("Once upon a time", max_tokens=24, temperature=0.0, timeout=120)
            return out.completion_tokens

    async def run() -> tuple[int, list]:
        loop = asyncio.get_running_loop()
        stream = asyncio.ensure_future(beside())
        many = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 5000, "max_tokens": 1}).encode()
        results = [
            await loop.run_in_executor(None, _refusal_of_declared, stack, "/v1/completions", 200 << 20),
            await loop.run_in_executor(None, _refusal_of_declared, stack, "/v1/chat/completions", 34 << 20),
            await loop.run_in_executor(None, _refusal_of_streamed, stack, 4 << 20),
            await loop.run_in_executor(None, _http, stack, "/v1/chat/completions", many),
        ]
        return await stream, results

    tokens, (declared, chat, streamed, (status, answer)) = asyncio.run(run())
    assert tokens > 0
    assert declared == chat == streamed == 413
    assert status == 400 and answer["error"]["param"] == "messages", answer


@pytest.mark.parametrize(
    "body, param",
    [
        (_completion(max_tokens=2**32), "max_tokens"),
        (_completion(top_k=2**31), "top_k"),
        (_completion(seed=2**64), "seed"),
        (_completion(min_tokens=2**32), "min_tokens"),
        (b'{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
        (b'{"model": "x", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        (b"[" * 100_000 + b"]" * 100_000, None),
    ],
    ids=["max_tokens", "top_k", "seed", "min_tokens", "surrogate-prompt", "surrogate-chat", "deep-json"],
)
def test_malformed_values_get_400_naming_them(stack, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, answer = _http(stack, path, body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param, answer


def test_grpc_request_that_does_not_parse_gets_invalid_argument(stack):
    good = generation_pb2.GenerateRequest(prompt="AB").SerializeToString()
    raw = good.replace(b"AB", b"\xff\xfe")
    with channel(stack.gateway) as ch:
        call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, metadata=[("authorization", f"Bearer {KEY}")], timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value


def test_slow_headers_are_cut_off_and_cannot_lock_anyone_out(stack):
    """More half-sent requests than the HTTP connection cap, with the gateway's fd limit lowered: gRPC clients
    are served throughout, every half-open connection is closed after --http-header-timeout, and HTTP serves
    again."""
    pid = _pid(stack, "gateway")
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (512, 512))
    port = int(stack.http.rsplit(":", 1)[1])
    slow = []
    for _ in range(3 * MAX_HTTP):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    text, _ = _generate(stack)
    assert text, "a gRPC client was shut out by half-open HTTP connections"
    deadline = time.monotonic() + HEADER_TIMEOUT + 20
    for s in slow:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while s.recv(1024):  # until the gateway closes it (EOF), or resets it (refused at the cap)
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError("a connection that never finished its headers is still open") from None
        finally:
            s.close()
    status, answer = _http(stack, "/v1/completions", _completion())
    assert status == 200, answer


def _healthy(stack, role: str) -> int:
    return int(
        scrape(stack.metrics["gateway"])[("pdserve_gateway_workers", frozenset({("role", role), ("state", "healthy")}))]
    )


def test_a_stopped_prefill_worker_costs_its_requests_no_transfer_timeout(stack):
    """SIGSTOP one prefill worker: requests routed to it fail over when its keepalive lapses (about 20 s),
    long before the decode worker's 60 s transfer expiry; then it resumes and serves again."""
    victim = stack.procs[1]

    async def warm(i: int) -> None:
        async with Client(stack.gateway, api_key=KEY) as client:
            await asyncio.gather(
                *(client.complete(f"Warm-up {i}.{j} " * 20, max_tokens=1, timeout=120) for j in range(4))
            )

    for i in range(10):  # until the decode worker holds an open channel to the victim (so keepalive must notice)
        if stack.stats(stack.prefill[1], "prefill").requests_total:
            break
        asyncio.run(warm(i))
    assert stack.stats(stack.prefill[1], "prefill").requests_total, "no request ever reached the second prefill worker"
    victim.send_signal(signal.SIGSTOP)
    try:

        async def run() -> list[float]:
            async def one(i: int) -> float:
                start = time.monotonic()
                async with Client(stack.gateway, api_key=KEY) as client:
                    await client.complete(f"Request number {i} says", max_tokens=4, temperature=0.0, timeout=120)
                return time.monotonic() - start

            return list(await asyncio.gather(*(one(i) for i in range(6))))

        times = asyncio.run(run())
    finally:
        victim.send_signal(signal.SIGCONT)
    assert max(times) < 50, f"a request waited for the transfer to expire: {times}"
    stack.wait_idle(60)


def test_a_restarted_worker_is_routed_to_within_seconds(stack):
    """After 25 s down, a prefill worker restarted on its port takes traffic again within a few seconds (gRPC's
    own reconnect backoff would have grown past 15 s)."""
    old = stack.procs[0]
    old.kill()
    old.wait(10)
    deadline = time.monotonic() + 30
    while _healthy(stack, "prefill") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    time.sleep(25)
    new = subprocess.Popen(old.args, env={**os.environ, "PDSERVE_LOG_LEVEL": "WARNING", "PDSERVE_HTTP_PORT": "-1"})
    stack.procs[0] = new
    from tests.stack import wait_serving

    wait_serving(stack.prefill[0], new)
    up = time.monotonic()
    while _healthy(stack, "prefill") != 2:
        assert time.monotonic() - up < 8, "the restarted worker was not routed to within 8 s"
        time.sleep(0.2)
    text, _ = _generate(stack)
    assert text


def test_a_service_with_a_ca_but_no_certificate_refuses_to_start(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked before the refusal")
    from pdserve.cli.main import main

    assert main(["prefill", "--tls-ca", str(ca), "--port", "1"]) == 1


def test_metrics_stay_on_this_host_when_the_api_is_secured():
    from pdserve.cli.services import metrics_host
    from pdserve.options import ObservabilityOptions, ServerOptions

    server, observe = ServerOptions("0.0.0.0", 50051), ObservabilityOptions()
    assert metrics_host(server, observe, secured=True) == "127.0.0.1"
    assert metrics_host(server, observe, secured=False) == "0.0.0.0"
    observe = ObservabilityOptions(metrics_host="0.0.0.0")
    assert metrics_host(server, observe, secured=True) == "0.0.0.0"


async def test_a_prefill_worker_refuses_a_prompt_its_backlog_would_start_too_late(tiny_model_dir, monkeypatch):
    """A backlog whose predicted time (the worker's fitted step cost) passes the decode worker's start_within, for
    a caller with somewhere else to go (may_refuse): RESOURCE_EXHAUSTED at once (the gateway retries elsewhere),
    before any KV connection is made. Within it, or for a caller with no alternative, the job goes ahead."""
    import dataclasses

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.failures import QueueFull, of
    from pdserve.prefill_service.worker import PrefillWorker
    from pdserve.wire import PrefillJob

    worker = PrefillWorker(EngineConfig(model=str(tiny_model_dir), num_blocks=64, block_size=4), transport="tcp")
    await worker.start()
    try:
        monkeypatch.setattr(worker.core, "pending_chunks", lambda: [(500, 0), (500, 0)])
        worker.prefill_time.coef = (0.01, 0.1, 0.0)  # 0.1 s a token: a backlog of ~100 s
        job = PrefillJob(
            "r",
            [5, 6, 7],
            3,
            SamplingParams(max_tokens=2),
            "tcp://127.0.0.1:1",
            worker.layout.fingerprint,
            "t",
            "s",
            start_within=45.0,
            may_refuse=True,
        )
        with pytest.raises(QueueFull) as e:
            await worker.prefill(job)
        assert of(e.value).code == grpc.StatusCode.RESOURCE_EXHAUSTED and "backlog of 1000 tokens" in str(e.value)
        # no alternative: it queues (and fails only on the KV target, which is a hole)
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(worker.prefill(dataclasses.replace(job, transfer_id="t2", may_refuse=False)), 30)
        assert not isinstance(e.value, QueueFull)
        worker.prefill_time.coef = (0.01, 1e-3, 0.0)  # ~1 s: it goes ahead
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(worker.prefill(dataclasses.replace(job, transfer_id="t3")), 30)
        assert not isinstance(e.value, QueueFull)
    finally:
        await worker.stop()


async def test_a_prompt_still_queued_when_its_transfer_would_expire_is_dropped_not_computed(
    tiny_model_dir, monkeypatch
):
    """start_within passes while the prompt waits in the queue (here: a queue that never reaches it): the job
    ends with RESOURCE_EXHAUSTED and is taken off the engine, so it is never computed for a transfer that expired."""
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.failures import QueueFull
    from pdserve.kvtransfer.receiver import KVReceiver
    from pdserve.kvtransfer.tcp_transport import TCPTransport
    from pdserve.prefill_service.worker import PrefillWorker
    from pdserve.wire import PrefillJob

    worker = PrefillWorker(EngineConfig(model=str(tiny_model_dir), num_blocks=64, block_size=4), transport="tcp")
    layout = worker.layout
    receiver = await KVReceiver(
        torch.zeros(layout.shape, dtype=worker.core.kv_cache.dtype), layout, TCPTransport()
    ).start()
    await worker.start()
    aborted = []
    try:
        monkeypatch.setattr(worker.loop, "submit", lambda seq, on_output: None)  # the queue never gets to it
        real_abort = worker.loop.abort
        monkeypatch.setattr(worker.loop, "abort", lambda seq: (aborted.append(seq.request_id), real_abort(seq)))
        receiver.expect("t", [0, 1], "s")
        job = PrefillJob(
            "late",
            [5, 6, 7],
            3,
            SamplingParams(max_tokens=2),
            receiver.address,
            layout.fingerprint,
            "t",
            "s",
            start_within=0.3,
        )
        with pytest.raises(QueueFull, match="not started within"):
            await asyncio.wait_for(worker.prefill(job), 30)
        assert aborted == ["late"] and not worker._jobs
    finally:
        await worker.stop()
        await receiver.close()
