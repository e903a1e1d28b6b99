"""The client-side commands: generate, bench, traces, health."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from pdserve.cli.errors import CLIError
from pdserve.cli.services import check_quantization, model_and_dtype, tls_config
from pdserve.flags import from_args
from pdserve.options import TLSOptions


async def stream_completion(address: str, args: argparse.Namespace, out=sys.stdout) -> int:
    import grpc

    from pdserve.client import Client

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.stop:
        sampling["stop"] = args.stop
    kw = {"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}
    start = time.perf_counter()
    first = None
    n = 0
    async with Client(
        address, api_key=getattr(args, "api_key", None), tls=tls_config(from_args(TLSOptions, args))
    ) as client:
        try:
            async for resp in client.stream(**kw, **sampling):
                first = first or time.perf_counter()
                n += len(resp.token_ids)
                out.write(resp.text)
                out.flush()
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and first is None and "connect" in (e.details() or "").lower():
                raise CLIError(f"cannot reach a gateway at {address}; start one with `pdserve up`") from None
            if first is not None:
                out.write("\n")
            raise CLIError(f"{e.code().name}: {e.details()}") from None
    end = time.perf_counter()
    out.write("\n")
    if first is not None:
        print(f"[{n} tokens, first after {first - start:.2f}s, {n / (end - start):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.local:
        return _generate_local(args)
    return asyncio.run(stream_completion(args.address, args))


def _generate_local(args: argparse.Namespace) -> int:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.gateway.text_stream import IncrementalDetokenizer, StopStringMatcher
    from pdserve.gateway.tokenizer import Tokenizer

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p or 1.0, seed=args.seed
    ).validate()  # before the model loads: a bad value costs nothing
    path, dtype = model_and_dtype(args.model, args.dtype, args.device)
    check_quantization(args.quantization, args.device, path, args.model)
    cfg = EngineConfig(
        model=path,
        dtype=dtype,
        kv_cache_memory=256 << 20,
        max_num_seqs=8,
        device=args.device,
        quantization=args.quantization,
    )
    tokenizer = Tokenizer(Path(path))
    engine = EngineCore(cfg)
    ids = (
        tokenizer.encode(args.prompt)
        if args.raw
        else tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    )
    engine.add_request(ids, params, "cli")
    detok, stops = IncrementalDetokenizer(tokenizer), StopStringMatcher(args.stop)
    start, n = time.perf_counter(), 0
    while engine.has_work and not stops.stopped:
        for step in engine.step():
            n += 1
            sys.stdout.write(stops.feed(detok.add([step.token_id])))
            if step.finished:
                sys.stdout.write(stops.feed(detok.flush()) + stops.flush())
            sys.stdout.flush()
    print(f"\n[{n} tokens in {time.perf_counter() - start:.2f}s]", file=sys.stderr)
    return 0


def cmd_traces(args: argparse.Namespace) -> int:
    from pdserve.trace_console import serve_console

    serve_console(args.host, args.port, args.quiet)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.benchmarks.load_gen import bench

    record = asyncio.run(bench(args))
    if record["completed"] == 0:
        where = args.address if args.backend == "pdserve" else args.base_url
        errors = "; ".join(record["errors"][:2])
        raise CLIError(
            f"no request succeeded against {where} ({errors})"
            + ("; start a stack with `pdserve up`" if args.backend == "pdserve" else "")
        )
    return 0 if record["failed"] == 0 else 1


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tls = tls_config(from_args(TLSOptions, args))
    creds = tls.channel_credentials() if tls is not None else None
    with (
        grpc.secure_channel(args.address, creds, options=tls.channel_options())
        if creds and tls is not None
        else grpc.insecure_channel(args.address)
    ) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    print(f"{args.address}: {name}")
    return 0 if status.status == health_pb2.HealthCheckResponse.SERVING else 1
