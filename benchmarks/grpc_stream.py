"""What streaming tokens over gRPC costs in CPU on this machine, paced as decode steps pace them.

    python -m pdserve.benchmarks.grpc_stream [--streams 8] [--steps 300] [--step-ms 18]

At concurrency c a decode worker sends, every step, one `DecodeResponse` on each of c streams, and the gateway
receives them and sends as many on. On a machine whose cores also run the step, that CPU comes out of the step.
This runs a grpc.aio server (uvloop, as the services run) in a child process that sends, every `--step-ms`, one
message of one token on each of `--streams` streams; then the same tokens as one message a step on a single stream,
which is what one stream carrying every request's tokens between a worker and a gateway would send. It prints the
CPU each side spent per step and per message.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import grpc

from pdserve.protos import worker_pb2

METHOD = "/pdserve.bench.TokenStream/Tokens"
T = TypeVar("T")


@dataclass
class Result:
    streams: int
    tokens_per_message: int
    steps: int
    server_cpu_s: float  # from the first step to the last message sent
    client_cpu_s: float  # from the first message received to the last
    wall_s: float

    @property
    def messages(self) -> int:
        return self.streams * self.steps

    def per_step_us(self, cpu_s: float) -> float:
        return cpu_s / self.steps * 1e6

    def per_message_us(self, cpu_s: float) -> float:
        return cpu_s / self.messages * 1e6


def _run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop, as the services run, where it is installed; the global loop policy stays as it was."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _serve(conn: Connection, streams: int, tokens: int, steps: int, step_s: float) -> None:
    """Wait for `streams` calls, then send each one message a step; report the CPU spent sending."""
    arrived = asyncio.Event()
    ticks = [asyncio.Event() for _ in range(steps)]
    calls = 0

    async def tokens_stream(request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        nonlocal calls
        calls += 1
        if calls == streams:
            arrived.set()
        for i in range(steps):
            await ticks[i].wait()
            yield worker_pb2.DecodeResponse(token_ids=[i % 50000] * tokens)

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(
        tokens_stream,
        request_deserializer=worker_pb2.DecodeRequest.FromString,
        response_serializer=worker_pb2.DecodeResponse.SerializeToString,
    )
    service, method = METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    await asyncio.wait_for(arrived.wait(), 60.0)
    start = _cpu()
    loop = asyncio.get_running_loop()
    due = loop.time()
    for tick in ticks:
        tick.set()
        due += step_s
        await asyncio.sleep(max(0.0, due - loop.time()))
    conn.send(_cpu() - start)
    await server.stop(5.0)


def _server_main(conn: Connection, streams: int, tokens: int, steps: int, step_s: float) -> None:
    _run(_serve(conn, streams, tokens, steps, step_s))


async def _receive(port: int, streams: int, steps: int) -> tuple[float, float]:
    """Open the streams and read them to their end: (CPU, wall) from the first message received to the last."""
    first: list[tuple[float, float]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(
            METHOD,
            request_serializer=worker_pb2.DecodeRequest.SerializeToString,
            response_deserializer=worker_pb2.DecodeResponse.FromString,
        )

        async def one() -> int:
            got = 0
            async for _ in call(worker_pb2.DecodeRequest(), timeout=steps * 10.0 + 60.0):
                if not first:
                    first.append((_cpu(), time.perf_counter()))
                got += 1
            return got

        counts = await asyncio.gather(*(one() for _ in range(streams)))
        cpu, wall = _cpu(), time.perf_counter()
    if counts != [steps] * streams:
        raise RuntimeError(f"expected {steps} messages on each of {streams} streams, got {counts}")
    return cpu - first[0][0], wall - first[0][1]


def measure(streams: int, tokens_per_message: int, steps: int, step_s: float) -> Result:
    """One run: a server process sending `streams` paced streams, this process receiving them."""
    context = multiprocessing.get_context("spawn")  # the child starts its own gRPC runtime
    ours, theirs = context.Pipe()
    server = context.Process(
        target=_server_main, args=(theirs, streams, tokens_per_message, steps, step_s), daemon=True
    )
    server.start()
    theirs.close()  # the child holds its own end
    try:
        if not ours.poll(120.0):
            raise RuntimeError("the benchmark's gRPC server did not start")
        port = ours.recv()
        client_cpu, wall = _run(_receive(port, streams, steps))
        if not ours.poll(60.0):
            raise RuntimeError("the benchmark's gRPC server did not report")
        server_cpu = ours.recv()
    finally:
        ours.close()
        server.join(10.0)
        if server.is_alive():
            server.kill()
            server.join()
    return Result(streams, tokens_per_message, steps, server_cpu, client_cpu, wall)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams, one token each per step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=18.0, help="time between steps")
    args = ap.parse_args(argv)
    if args.streams < 1 or args.steps < 1 or args.step_ms < 0:
        ap.error("--streams and --steps must be at least 1, --step-ms at least 0")
    step_s = args.step_ms / 1e3
    runs = [measure(args.streams, 1, args.steps, step_s), measure(1, args.streams, args.steps, step_s)]
    print(f"{args.steps} steps, one every {args.step_ms:g} ms; CPU per step (per message) on each side")
    for r in runs:
        shape = f"{r.streams} stream(s) x {r.tokens_per_message} token(s) a message"
        print(
            f"  {shape:36s} sender {r.per_step_us(r.server_cpu_s):7.0f} us ({r.per_message_us(r.server_cpu_s):5.0f})"
            f"   receiver {r.per_step_us(r.client_cpu_s):7.0f} us ({r.per_message_us(r.client_cpu_s):5.0f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
