"""The `pdserve` command: run one service, the whole stack, or a client.

    pdserve up [--prompt TEXT]          gateway + prefill + decode workers on this machine
    pdserve gateway|prefill|decode      one service (what compose runs)
    pdserve generate TEXT               stream a completion from a running gateway
    pdserve generate --local TEXT       run the engine in this process instead
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("pdserve")


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="model directory, .gguf file, or 'default' (SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=_size, default=_size("512M"), help="KV pool size, e.g. 512M, 2G")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads for this worker")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flash-attn", "triton", "torch"],
                   help="auto: flash-attn > triton > torch, by what the device supports (logged at start-up)")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto; the KV transfer moves host memory, so "
                                                   "disaggregated workers run on cpu")
    p.add_argument("--kv-transport", default=os.environ.get("PDSERVE_KV_TRANSPORT", "ucx"), choices=["ucx", "tcp"])


def _observability_args(p: argparse.ArgumentParser, metrics_port: int) -> None:
    from pdserve.tracing import TracingConfig

    env = TracingConfig.from_env()
    p.add_argument("--metrics-port", type=int, default=metrics_port,
                   help="HTTP port of /metrics (Prometheus); -1 turns it off" +
                        (" (up: the gateway's; workers take the next ones)" if metrics_port == 9400 else ""))
    p.add_argument("--metrics-host", default=None, help="address /metrics binds (default: --host)")
    p.add_argument("--otlp-endpoint", default=env.endpoint,
                   help="OTLP trace collector, e.g. http://127.0.0.1:4318 (default $OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "unset: tracing off)")
    p.add_argument("--otlp-protocol", default=env.protocol, choices=["http/protobuf", "grpc"])
    p.add_argument("--trace-sample-ratio", type=float, default=env.sample_ratio,
                   help="fraction of requests traced (parent-based)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", default=os.environ.get("PDSERVE_LOG_FORMAT", "text"), choices=["text", "json"],
                        help="json: one JSON object per line (request lines carry request_id and trace_id)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start gateway + prefill + decode workers on this machine")
    _engine_args(up)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051, help="the gateway's gRPC port")
    up.add_argument("--prefill-workers", type=int, default=1)
    up.add_argument("--decode-workers", type=int, default=1)
    up.add_argument("--colocated", action="store_true",
                    help="no disaggregation: --decode-workers workers that each prefill and decode themselves")
    up.add_argument("--prefill-port", type=int, default=50061, help="first prefill worker port")
    up.add_argument("--decode-port", type=int, default=50071, help="first decode worker port")
    up.add_argument("--prompt", default=None, help="answer this prompt once the stack is up")
    up.add_argument("--exit-after-prompt", action="store_true", help="stop the stack after answering --prompt")
    _observability_args(up, 9400)

    gw = sub.add_parser("gateway", help="the public gRPC API")
    gw.add_argument("--model", default="default")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=50051)
    gw.add_argument("--prefill", default=os.environ.get("PDSERVE_PREFILL", ""),
                    help="comma-separated host:port list of prefill workers")
    gw.add_argument("--decode", default=os.environ.get("PDSERVE_DECODE", ""),
                    help="comma-separated host:port list of decode workers")
    gw.add_argument("--ready-timeout", type=float, default=600.0)
    gw.add_argument("--discover", action="store_true", default=os.environ.get("PDSERVE_DISCOVER") == "1",
                    help="treat --prefill/--decode as DNS names and follow every address they resolve to "
                         "(compose --scale, Kubernetes headless services)")
    _observability_args(gw, 9400)

    roles = {"prefill": "a prefill worker", "decode": "a decode worker",
             "colocated": "a worker that prefills and decodes itself (no KV transfer; the gateway treats it as a "
                          "decode worker and needs no --prefill)"}
    for role, text in roles.items():
        w = sub.add_parser(role, help=text)
        _engine_args(w)
        w.add_argument("--host", default="127.0.0.1")
        w.add_argument("--port", type=int, default=50061 if role == "prefill" else 50071)
        _observability_args(w, 9401 if role == "prefill" else 9402)
        if role == "decode":
            w.add_argument("--kv-host", default=None,
                           help="address prefill workers use to reach this worker's KV receiver (default: --host)")
        if role != "prefill":
            w.add_argument("--max-queued", type=int, default=256,
                           help="requests that may wait for KV blocks before RESOURCE_EXHAUSTED")

    tr = sub.add_parser("traces", help="receive OTLP/HTTP traces and print each request's span tree")
    tr.add_argument("--host", default="127.0.0.1")
    tr.add_argument("--port", type=int, default=4318)
    tr.add_argument("--quiet", type=float, default=8.0, help="print a trace once it has been quiet this long (s)")

    from benchmarks.load_gen import add_arguments as bench_arguments

    bench = sub.add_parser("bench", help="load-test the gateway (or any OpenAI-compatible server): vLLM's metrics")
    bench_arguments(bench)

    hc = sub.add_parser("health", help="exit 0 when a service answers gRPC health SERVING (container healthcheck)")
    hc.add_argument("--address", default=os.environ.get("PDSERVE_HEALTH_ADDRESS", "127.0.0.1:50051"))
    hc.add_argument("--timeout", type=float, default=3.0)

    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    gen.add_argument("--local", action="store_true", help="run the engine in this process, no services")
    gen.add_argument("--model", default="default")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="cpu", help="with --local: cpu, cuda[:N] or auto")
    _sampling_args(gen)
    return parser


def _model_and_dtype(model: str, dtype: str) -> tuple[str, str]:
    """Resolve the model directory, and 'auto' to the dtype its checkpoint was saved in."""
    import json

    from engine.model_store import resolve_model

    path = resolve_model(model)
    if dtype == "auto":
        cfg = json.loads((path / "config.json").read_text())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return str(path), dtype


def _engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig

    path, dtype = _model_and_dtype(args.model, args.dtype)
    return EngineConfig(model=path, dtype=dtype, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        num_threads=args.threads, attention_backend=args.attention_backend, device=args.device)


def _run(main) -> int:
    from pdserve.grpc_server import install_uvloop

    install_uvloop()
    asyncio.run(main())
    return 0


def _tracing(args: argparse.Namespace):
    from pdserve.tracing import Tracing, TracingConfig

    config = TracingConfig(args.otlp_endpoint, args.otlp_protocol, args.trace_sample_ratio)
    return Tracing(f"pdserve-{args.command}", config, instance=f"{args.host}:{args.port}")


def _routable(host: str) -> str:
    """An address other hosts can reach: a wildcard bind address becomes this host's own address."""
    if host in ("0.0.0.0", "::", ""):
        import socket

        return socket.gethostbyname(socket.gethostname())
    return host


def _metrics_server(args: argparse.Namespace, registry):
    from pdserve.metrics_server import MetricsServer

    if args.metrics_port < 0:
        return None
    server = MetricsServer(registry, args.metrics_host or args.host, args.metrics_port).start()
    log.info("metrics on %s", server.url)
    return server


def cmd_worker(args: argparse.Namespace) -> int:
    from pdserve.grpc_server import serve_until_signal

    cfg = _engine_config(args)

    async def main() -> None:
        tracing = _tracing(args)
        extra = None
        if args.command == "prefill":
            from prefill_service.server import serve

            server, _, worker = await serve(cfg, args.host, args.port, args.kv_transport, tracing=tracing)
        elif args.command == "colocated":
            from decode_service.server import serve_colocated

            server, _, worker = await serve_colocated(cfg, args.host, args.port, args.max_queued, tracing=tracing)
        else:
            from decode_service.server import serve

            server, _, worker, extra = await serve(cfg, args.host, args.port, args.kv_transport,
                                                   _routable(args.kv_host or args.host), max_queued=args.max_queued,
                                                   tracing=tracing)
        metrics = _metrics_server(args, worker.metrics.registry)

        async def stop() -> None:
            from kvtransfer.transport import shutdown_transports

            await server.stop(grace=30)
            await worker.stop()
            if extra is not None:
                await extra.close()
            shutdown_transports()
            if metrics is not None:
                metrics.stop()
            tracing.shutdown()

        await serve_until_signal(stop)

    return _run(main)


def cmd_gateway(args: argparse.Namespace) -> int:
    from engine.model_store import resolve_model
    from gateway.server import serve
    from pdserve.grpc_server import serve_until_signal

    path = resolve_model(args.model)
    prefill = [a for a in args.prefill.split(",") if a]
    decode = [a for a in args.decode.split(",") if a]

    async def main() -> None:
        from gateway.metrics import GatewayMetrics

        tracing, gateway_metrics = _tracing(args), GatewayMetrics()
        server, _, router = await serve(path, args.host, args.port, prefill, decode, args.ready_timeout,
                                        tracing=tracing, metrics=gateway_metrics, discover=args.discover)
        metrics = _metrics_server(args, gateway_metrics.registry)
        print(f"pdserve gateway ready on {args.host}:{args.port}", flush=True)

        async def stop() -> None:
            await server.stop(grace=30)
            await router.close()
            if metrics is not None:
                metrics.stop()
            tracing.shutdown()

        await serve_until_signal(stop)

    return _run(main)


async def _stream(address: str, args: argparse.Namespace, out=sys.stdout) -> int:
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
    async with Client(address) as client:
        try:
            async for resp in client.stream(**kw, **sampling):
                first = first or time.perf_counter()
                n += len(resp.token_ids)
                out.write(resp.text)
                out.flush()
        except grpc.aio.AioRpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    end = time.perf_counter()
    out.write("\n")
    if first is not None:
        print(f"[{n} tokens, first after {first - start:.2f}s, {n / (end - start):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_traces(args: argparse.Namespace) -> int:
    from pdserve.trace_console import serve_console

    serve_console(args.host, args.port, args.quiet)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.load_gen import bench

    record = asyncio.run(bench(args))
    return 0 if record["failed"] == 0 else 1


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    print(f"{args.address}: {name}")
    return 0 if status.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_generate(args: argparse.Namespace) -> int:
    if args.local:
        return _generate_local(args)
    return asyncio.run(_stream(args.address, args))


def _generate_local(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from gateway.text_stream import IncrementalDetokenizer, StopStringMatcher
    from gateway.tokenizer import Tokenizer

    path, dtype = _model_and_dtype(args.model, args.dtype)
    cfg = EngineConfig(model=path, dtype=dtype, kv_cache_memory=256 << 20, max_num_seqs=8, device=args.device)
    tokenizer = Tokenizer(cfg.model)
    engine = LLMEngine(cfg)
    ids = tokenizer.encode(args.prompt) if args.raw else tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}])
    engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                           top_p=args.top_p or 1.0, seed=args.seed), "cli")
    detok, stops = IncrementalDetokenizer(tokenizer.hf), StopStringMatcher(args.stop)
    start, n = time.perf_counter(), 0
    while engine.has_work and not stops.stopped:
        for step in engine.step():
            n += len(step.new_token_ids)
            sys.stdout.write(stops.feed(detok.add(step.new_token_ids)))
            if step.finished:
                sys.stdout.write(stops.feed(detok.flush()) + stops.flush())
            sys.stdout.flush()
    print(f"\n[{n} tokens in {time.perf_counter() - start:.2f}s]", file=sys.stderr)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Spawn the workers and the gateway as child processes; stop them all on Ctrl-C / SIGTERM."""
    from engine.model_store import resolve_model

    resolve_model(args.model)  # convert the default model once, before three processes race to do it
    exe = [sys.executable, "-m", "pdserve.cli", "--log-level", args.log_level, "--log-format", args.log_format]
    if args.colocated:
        args.prefill_workers = 0
    workers = args.prefill_workers + args.decode_workers
    threads = args.threads or max(1, (os.cpu_count() or 1) // workers)
    common = ["--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size),
              "--kv-cache-memory", str(args.kv_cache_memory), "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--threads", str(threads),
              "--kv-transport", args.kv_transport]
    if args.max_model_len:
        common += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        common += ["--no-prefix-caching"]
    common += ["--attention-backend", args.attention_backend, "--device", args.device]
    observe = ["--otlp-protocol", args.otlp_protocol, "--trace-sample-ratio", str(args.trace_sample_ratio)]
    if args.otlp_endpoint:
        observe += ["--otlp-endpoint", args.otlp_endpoint]
    if args.metrics_host:
        observe += ["--metrics-host", args.metrics_host]
    metric_ports = iter(range(args.metrics_port, args.metrics_port + 1 + workers) if args.metrics_port >= 0
                        else [-1] * (1 + workers))
    gateway_metrics_port = next(metric_ports)
    prefill = [f"{args.host}:{args.prefill_port + i}" for i in range(args.prefill_workers)]
    decode = [f"{args.host}:{args.decode_port + i}" for i in range(args.decode_workers)]
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop_all(*_):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        for p in reversed(procs):  # gateway first: no new requests, then workers finish what is in flight
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(0)))
    try:
        for role, addrs in (("prefill", prefill), ("colocated" if args.colocated else "decode", decode)):
            for addr in addrs:
                host, port = addr.rsplit(":", 1)
                procs.append(subprocess.Popen([*exe, role, "--host", host, "--port", port, *common, *observe,
                                               "--metrics-port", str(next(metric_ports))]))
        procs.append(subprocess.Popen([*exe, "gateway", "--model", args.model, "--host", args.host,
                                       "--port", str(args.port), "--prefill", ",".join(prefill),
                                       "--decode", ",".join(decode), *observe,
                                       "--metrics-port", str(gateway_metrics_port)]))
        gateway = f"{args.host}:{args.port}"
        t0 = time.perf_counter()
        asyncio.run(_wait_healthy(gateway, procs, timeout=600))
        print(f"pdserve is up: gateway {gateway}, prefill {prefill}, decode {decode} "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)
        if args.metrics_port >= 0:
            print(f"metrics: http://{args.metrics_host or args.host}:{args.metrics_port}/metrics (gateway), "
                  f"ports {args.metrics_port + 1}-{args.metrics_port + workers} (prefill, then decode)", flush=True)
        if args.prompt:
            ns = argparse.Namespace(prompt=args.prompt, max_tokens=256, temperature=0.0, top_p=None, seed=None,
                                    stop=[], raw=False)
            asyncio.run(_stream(gateway, ns))
            print(f"[first answer {time.perf_counter() - t0:.1f}s after start]", file=sys.stderr)
            if args.exit_after_prompt:
                return 0
        print("serving; Ctrl-C stops", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        log.error("a service exited: %s", [(p.args[4], p.returncode) for p in procs if p.poll() is not None])
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all()


async def _wait_healthy(address: str, procs: list[subprocess.Popen], timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a pdserve service exited during start-up (see its log above)")
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"gateway {address} not healthy after {timeout:.0f}s")


def main(argv: list[str] | None = None) -> int:
    from pdserve.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format, args.command)
    handlers = {"up": cmd_up, "gateway": cmd_gateway, "prefill": cmd_worker, "decode": cmd_worker,
                "generate": cmd_generate, "traces": cmd_traces,
                "health": cmd_health, "colocated": cmd_worker,
                "bench": cmd_bench}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
