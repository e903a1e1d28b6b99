"""Migration on real processes: a decode worker killed (-9) or drained (SIGTERM) while it streams costs no
stream. The gateway resubmits prompt + tokens so far to another decode worker and the client sees one
uninterrupted stream, token for token what an unbroken run gives, greedy or seeded."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import grpc
import pytest

from pdserve.client import Client, Completion
from pdserve.protos import common_pb2
from tests.stack import Stack, free_port, scrape, service_env, start_stack, wait_serving

pytestmark = pytest.mark.slow
N = 8
MAX_TOKENS = 40
BOUND_S = 240.0  # a stream still running after this counts as lost
PROMPTS = [
    "The lighthouse keeper wrote in his log that",
    "Three reasons to learn a second language are",
    "Once upon a time, in a village by the sea,",
    "The recipe for bread needs flour, water and",
    "In the year 2150 the first city on Mars",
    "A short poem about autumn leaves:",
    "The train left the station at dawn and",
    "Dear diary, today I finally",
]


def _sampling(i: int, seeded: bool) -> dict:
    if seeded:
        return {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i, "frequency_penalty": 0.3}
    return {"temperature": 0.0}


class _Streams:
    """N streams through one gateway; each keeps what it received so far, and ends as a Completion or the
    AioRpcError that ended it."""

    def __init__(self, gateway: str, seeded: bool, extra: dict | None = None) -> None:
        self.gateway, self.seeded, self.extra = gateway, seeded, extra or {}
        self.received = [0] * N
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> list:
        async with Client(self.gateway) as client:
            return await asyncio.gather(*(self._one(client, i) for i in range(N)))

    async def _one(self, client: Client, i: int) -> Completion | grpc.aio.AioRpcError:
        out = Completion()
        kw = {"max_tokens": MAX_TOKENS, "ignore_eos": True, **_sampling(i, self.seeded), **self.extra}
        call = client.stream(prompt=PROMPTS[i], timeout=BOUND_S, **kw)
        try:
            async for resp in call:
                out.text += resp.text
                out.token_ids.extend(resp.token_ids)
                self.received[i] = len(out.token_ids)
                if resp.finish_reason:
                    out.finish_reason = common_pb2.FinishReason.Name(resp.finish_reason)
                    out.completion_tokens = resp.usage.completion_tokens
        except grpc.aio.AioRpcError as e:
            return e
        return out

    async def started(self, tokens: int = 3) -> None:
        """Until every stream has `tokens` tokens (bounded)."""
        for _ in range(int(BOUND_S / 0.05)):
            if min(self.received) >= tokens or self.task.done():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"streams did not start: {self.received}")

    async def results(self) -> list:
        return await asyncio.wait_for(self.task, BOUND_S)


_REFERENCE: dict[bool, list[Completion]] = {}


async def _reference(gateway: str, seeded: bool) -> list[Completion]:
    """The unbroken runs (computed once per kind)."""
    if seeded not in _REFERENCE:
        async with Client(gateway) as client:
            _REFERENCE[seeded] = await asyncio.gather(
                *(
                    client.complete(
                        prompt=PROMPTS[i],
                        max_tokens=MAX_TOKENS,
                        ignore_eos=True,
                        timeout=BOUND_S,
                        **_sampling(i, seeded),
                    )
                    for i in range(N)
                )
            )
    return _REFERENCE[seeded]


def _busiest(stack: Stack) -> str:
    return max(stack.decode, key=lambda a: stack.stats(a, "decode").running)


def _exact(results: list, reference: list[Completion]) -> None:
    for i, (got, want) in enumerate(zip(results, reference)):
        assert isinstance(got, Completion), (i, got)
        assert got.token_ids == want.token_ids, (i, got.token_ids, want.token_ids)
        assert got.text == want.text, i
        assert got.finish_reason == "FINISH_REASON_LENGTH" and got.completion_tokens == MAX_TOKENS, (i, got)


def _migrations(stack: Stack, reason: str | None = None) -> float:
    return sum(
        v
        for (name, labels), v in scrape(stack.metrics["gateway"]).items()
        if name == "pdserve_gateway_migrations_total" and (reason is None or ("reason", reason) in labels)
    )


async def _idle(stack: Stack, address: str) -> None:
    for _ in range(300):
        stats = stack.stats(address, "decode")
        if stats.kv_blocks_used == 0 and stats.running == 0 and stats.pending_transfers == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{address} still holds blocks: {stats}")


def _index(stack: Stack, address: str) -> int:
    """Where the process serving `address` is in stack.procs (a restart takes its predecessor's place)."""
    port = address.rsplit(":", 1)[1]
    return next(i for i, p in enumerate(stack.procs) if p.args[p.args.index("--port") + 1] == port)


def _proc(stack: Stack, address: str) -> subprocess.Popen:
    return stack.procs[_index(stack, address)]


def _restart(stack: Stack, address: str) -> None:
    i = _index(stack, address)
    stack.procs[i].wait(60)
    stack.procs[i] = subprocess.Popen(stack.procs[i].args, env=service_env())
    wait_serving(address, stack.procs[i])


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """(stack, OTLP receiver, log dir): no drain grace, so a drained worker hands back every stream and the test
    sees the migration path every time."""
    from pdserve.trace_console import OTLPReceiver

    logs = tmp_path_factory.mktemp("migration-logs")
    with OTLPReceiver() as otlp:
        stack = start_stack(
            decode_workers=2,
            prefill_workers=1,
            decode_extra=["--drain-grace", "0"],
            observe=["--otlp-endpoint", otlp.endpoint],
            log_dir=logs,
            env={"OTEL_BSP_SCHEDULE_DELAY": "100", "PDSERVE_LOG_LEVEL": "INFO", "PDSERVE_LOG_FORMAT": "json"},
        )
        try:
            yield stack, otlp, logs
            metrics = scrape(stack.metrics["gateway"])
            stall = [
                metrics.get((f"pdserve_gateway_migration_stall_seconds_{k}", frozenset()), 0) for k in ("sum", "count")
            ]
            if stall[1]:
                print(f"\nmigrations: {stall[1]:.0f} streams moved; mean stall {stall[0] / stall[1]:.3f} s")
        finally:
            stack.stop()


@pytest.fixture(scope="module")
def stack(observed):
    return observed[0]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
async def test_killing_the_busiest_decode_worker_loses_no_stream(observed, seeded):
    stack, otlp, logs = observed
    reference = await _reference(stack.gateway, seeded)
    before = _migrations(stack)
    streams = _Streams(stack.gateway, seeded)
    await streams.started()
    victim = _busiest(stack)
    _proc(stack, victim).send_signal(signal.SIGKILL)
    results = await streams.results()
    _exact(results, reference)
    moved = _migrations(stack) - before
    assert moved >= 1
    survivor = next(a for a in stack.decode if a != victim)
    await _idle(stack, survivor)
    _restart(stack, victim)
    # the trace says where each moved stream went, and the request log line how often it moved
    events = otlp.wait_for(
        lambda spans: (
            sum(1 for s in spans for e in s.events if e[1] == "pdserve.migrated" and e[2]["pdserve.from"] == victim)
            >= moved
        )
    )
    for span in events:
        for _, name, attrs in span.events:
            if name == "pdserve.migrated" and attrs["pdserve.from"] == victim:
                assert attrs["pdserve.to"] == survivor and attrs["pdserve.generated_tokens"] >= 3
                assert span.name == "/pdserve.v1.Generation/Generate" and span.attributes["pdserve.migrations"] >= 1
    lines = [json.loads(line) for line in (logs / "gateway.log").read_text().splitlines() if line.startswith("{")]
    assert sum(1 for line in lines if line.get("migrations", 0) >= 1) >= moved


ITEMS = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 6, "maxItems": 6}


async def test_a_constrained_stream_moved_by_kill_stays_valid(stack):
    """Streams under a JSON schema, the busiest decode worker killed: each moved stream's grammar state is
    rebuilt from the tokens it carries, so every answer still validates and equals its unbroken run."""
    import jsonschema

    constraint = common_pb2.Constraint(json_schema=json.dumps(ITEMS), strict=True)
    extra = {"max_tokens": 160, "temperature": 0.0, "constraint": constraint}
    async with Client(stack.gateway) as client:
        reference = await asyncio.gather(
            *(client.complete(prompt=PROMPTS[i], timeout=BOUND_S, **extra) for i in range(N))
        )
    for want in reference:
        jsonschema.validate(json.loads(want.text), ITEMS)
    before = _migrations(stack)
    streams = _Streams(stack.gateway, False, extra)
    await streams.started()
    victim = _busiest(stack)
    _proc(stack, victim).send_signal(signal.SIGKILL)
    results = await streams.results()
    assert _migrations(stack) - before >= 1
    for i, (got, want) in enumerate(zip(results, reference)):
        assert isinstance(got, Completion), (i, got)
        assert got.finish_reason == "FINISH_REASON_STOP" and got.token_ids == want.token_ids, (i, got.text)
        jsonschema.validate(json.loads(got.text), ITEMS)
    survivor = next(a for a in stack.decode if a != victim)
    await _idle(stack, survivor)
    _restart(stack, victim)


async def test_a_speculating_stream_moved_by_kill_carries_only_kept_tokens(stack):
    """Seeded streams that speculate (speculative_tokens 6), the busiest decode worker killed: guesses never enter a
    sequence's tokens, so what moves is only what was kept, and every answer equals its unbroken run without
    speculation, draw for draw."""
    reference = await _reference(stack.gateway, True)
    before = _migrations(stack)
    streams = _Streams(stack.gateway, True, {"speculative_tokens": 6})
    await streams.started()
    victim = _busiest(stack)
    _proc(stack, victim).send_signal(signal.SIGKILL)
    results = await streams.results()
    _exact(results, reference)
    assert _migrations(stack) - before >= 1
    survivor = next(a for a in stack.decode if a != victim)
    await _idle(stack, survivor)
    _restart(stack, victim)


async def test_a_rolling_restart_of_every_decode_worker_fails_nothing(stack):
    """SIGTERM each decode worker in turn under load (it drains: no grace here, so it hands back every stream
    at once), start it again, go on to the next: every stream finishes, exact."""
    reference = await _reference(stack.gateway, False)
    before = _migrations(stack, "drain")
    for address in stack.decode:
        streams = _Streams(stack.gateway, False)
        await streams.started()
        proc = _proc(stack, address)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        drained = time.monotonic() - start
        assert drained < 20, f"{address} took {drained:.1f}s to drain"
        _exact(await streams.results(), reference)
        _restart(stack, address)
    assert _migrations(stack, "drain") - before >= 2
    for address in stack.decode:
        await _idle(stack, address)


async def test_migration_limit_zero_keeps_the_old_error_naming_the_worker(stack, tmp_path):
    """A second gateway on the same workers, with --migration-limit 0: the killed worker's streams fail with
    UNAVAILABLE naming it; the others finish as before."""
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "gateway", "--port", str(port), "--http-port", "-1"]
    argv += ["--prefill", ",".join(stack.prefill), "--decode", ",".join(stack.decode), "--migration-limit", "0"]
    gateway = subprocess.Popen([*argv, "--metrics-port", "-1"], env=service_env())
    try:
        wait_serving(f"127.0.0.1:{port}", gateway)
        reference = await _reference(stack.gateway, False)
        streams = _Streams(f"127.0.0.1:{port}", False)
        await streams.started()
        victim = _busiest(stack)
        _proc(stack, victim).send_signal(signal.SIGKILL)
        results = await streams.results()
        failed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert failed, "the killed worker's streams should have failed"
        for e in failed:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and victim in (e.details() or ""), e.details()
        for got, want in zip(results, reference):
            if isinstance(got, Completion):
                assert got.token_ids == want.token_ids
        _restart(stack, victim)
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait(5)
