"""`pdserve up`: the whole stack on this machine, as child processes of this one.

Everything that can be checked is checked before anything starts (the model, the KV budget, every port). The
workers start first; the gateway starts once every one of them answers health, so its first poll sees them
all. Children die with this process, however it ends (SIGTERM, Ctrl-C, even SIGKILL: each child asks the kernel
for a SIGTERM when its parent goes), and if one child exits the others are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from pdserve.cli.clients import stream_completion
from pdserve.cli.errors import CLIError
from pdserve.cli.parent import child_env
from pdserve.cli.services import engine_config, tls_config, usable_cpus
from pdserve.config import ColocatedConfig, DecodeConfig, GatewayConfig, PrefillConfig, StackConfig
from pdserve.flags import from_args, to_argv
from pdserve.options import (
    DecodeOptions,
    DrainOptions,
    EngineOptions,
    GatewayOptions,
    ObservabilityOptions,
    PrefillWorkersOptions,
    QueueOptions,
    ServerOptions,
    TokenizerOptions,
    UpOptions,
    WorkerOptions,
)


@dataclass
class Service:
    role: str
    address: str
    proc: subprocess.Popen

    def __str__(self) -> str:
        return f"the {self.role} on {self.address}"


PORT_FLAGS = "--port, --http-port, --prefill-port, --decode-port, --metrics-port"


def _check_ports_free(host: str, ports: list[tuple[str, int]]) -> None:
    """One line naming the port and its flag when a port is taken. Sockets in TIME_WAIT, which a stack that just
    stopped leaves behind, do not count: every server here binds with SO_REUSEADDR, and so does this check."""
    seen: dict[int, str] = {}
    for what, port in ports:
        if port in seen:
            raise CLIError(
                f"the {what} port {port} is also the {seen[port]} port; pick ports that do not overlap "
                f"({PORT_FLAGS}; workers take consecutive ports)"
            )
        seen[port] = what
    for what, port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise CLIError(
                    f"{what} port {host}:{port} is not free ({e.strerror}); is another stack running? "
                    f"Stop it, or pick other ports ({PORT_FLAGS})"
                ) from None


async def _wait_serving(services: list[Service], timeout: float, tls=None) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.grpc_server import open_channel

    deadline = time.monotonic() + timeout
    for service in services:
        async with open_channel(service.address, tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if service.proc.poll() is not None:
                    raise CLIError(
                        f"{service} exited during start-up with status {service.proc.returncode} (its log is above)"
                    )
                try:
                    resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise CLIError(f"{service} did not become healthy within {timeout:.0f}s")
                await asyncio.sleep(0.3)


@dataclass
class Child:
    """One process of the stack: what it is, where it listens, and its `pdserve` arguments."""

    role: str
    address: str
    argv: list[str]
    env: dict[str, str] | None = None


@dataclass
class StackPlan:
    workers: list[Child]
    gateway: Child
    ports: list[tuple[str, int]]  # (what, port): every port the stack will bind, checked before anything starts
    metric_ports: list[int]


def _threads(engine: EngineOptions, up: UpOptions) -> tuple[int, int, int]:
    """(cores, prefill threads, decode threads). Prefill and decode workers share this machine's cores: decode
    workers get them all between them (prefill comes in bursts, and a decode step is latency-bound), prefill
    workers half, so that when both run, fewer OpenMP threads than twice the cores fight over them. On 2 cores
    (c=1 / 8 / 32, tok/s): one thread each 60.7 / 256 / 472, two each 77.9 / 174 / 425, prefill one and decode
    two 70.0 / 287 / 476."""
    cores = usable_cpus()[0]
    prefill = engine.threads or max(1, cores // 2 // max(1, up.prefill_workers))
    decode = engine.threads or max(1, cores // up.decode_workers)
    return cores, prefill, decode


def plan_stack(cfg: StackConfig) -> StackPlan:
    """Every child's configuration, rendered as its argument list: the same dataclasses the parser was built from."""
    host, up, observe = cfg.server.host, cfg.up, cfg.observability
    if up.colocated:
        up = replace(up, prefill_workers=0)
    if up.decode_workers < 1 or up.prefill_workers < 0:
        raise CLIError("--decode-workers must be >= 1 and --prefill-workers >= 0")
    prefill = [f"{host}:{up.prefill_port + i}" for i in range(up.prefill_workers)]
    decode = [f"{host}:{up.decode_port + i}" for i in range(up.decode_workers)]
    n = len(prefill) + len(decode)
    metric_ports = list(range(observe.metrics_port, observe.metrics_port + 1 + n)) if observe.metrics_port >= 0 else []
    workers = _workers(cfg, up, prefill, decode, iter(metric_ports[1:] + [-1] * (1 + n)))
    gateway = GatewayConfig(
        cfg.server,
        TokenizerOptions(cfg.engine.model),
        PrefillWorkersOptions(",".join(prefill)),
        GatewayOptions(decode=",".join(decode)),
        cfg.routing,
        cfg.migration,
        cfg.http,
        replace(observe, metrics_port=metric_ports[0] if metric_ports else -1),
        cfg.tls,
        cfg.api_key,
    )
    key = cfg.api_key.api_key
    gateway_child = Child(
        "gateway",
        f"{host}:{cfg.server.port}",
        ["gateway", *to_argv(gateway, api_key=None, api_key_file=None)],  # the key never on argv, where ps shows it
        {**os.environ, "PDSERVE_API_KEY": key} if key else None,
    )
    ports = [("gateway", cfg.server.port)] + ([("HTTP API", cfg.http.http_port)] if cfg.http.http_port >= 0 else [])
    ports += [(c.role, int(c.address.rsplit(":", 1)[1])) for c in workers]
    ports += [("metrics", p) for p in metric_ports]
    return StackPlan(workers, gateway_child, ports, metric_ports)


def _workers(
    cfg: StackConfig, up: UpOptions, prefill: list[str], decode: list[str], metrics: Iterator[int]
) -> list[Child]:
    """The workers' children: prefill workers, then decode (or colocated) workers, each on its own metrics port."""
    cores, prefill_threads, decode_threads = _threads(cfg.engine, up)
    worker = WorkerOptions()

    def common(address: str, threads: int) -> tuple[ServerOptions, EngineOptions]:
        h, port = address.rsplit(":", 1)
        return ServerOptions(h, int(port)), replace(cfg.engine, threads=threads)

    def observed() -> ObservabilityOptions:
        return replace(cfg.observability, metrics_port=next(metrics))

    children = []
    for a in prefill:
        config = PrefillConfig(*common(a, prefill_threads), worker, observed(), cfg.tls)
        children.append(Child("prefill worker", a, ["prefill", *to_argv(config)]))
    # a prefill worker on the same cores: the decode workers make room for it while it computes
    share = max(1, decode_threads - prefill_threads) if prefill_threads + decode_threads > cores else None
    for a in decode:
        server, engine = common(a, decode_threads)
        if up.colocated:
            colocated = ColocatedConfig(server, engine, worker, QueueOptions(), DrainOptions(), observed(), cfg.tls)
            children.append(Child("colocated worker", a, ["colocated", *to_argv(colocated)]))
            continue
        decode_cfg = DecodeConfig(
            server,
            engine,
            worker,
            DecodeOptions(threads_while_prefilling=share),
            PrefillWorkersOptions(",".join(prefill)),
            cfg.local_prefill,
            QueueOptions(),
            DrainOptions(),
            observed(),
            cfg.tls,
        )
        children.append(Child("decode worker", a, ["decode", *to_argv(decode_cfg)]))
    return children


class _Processes:
    """The children this command started; `stop` ends them all, gateway first."""

    def __init__(self, exe: list[str]) -> None:
        self.exe = exe
        self.services: list[Service] = []

    def spawn(self, child: Child) -> Service:
        # a process group of its own: Ctrl-C in the terminal reaches only this process, which stops the children
        # in order (they still get SIGTERM if this process dies: pdserve.cli.parent). Not a session of its own: the
        # kernel's autogroup scheduler would then split the cores per child, not per thread (measured: TTFT at
        # c=8 1.05-1.2 s instead of 0.4-0.9 s)
        proc = subprocess.Popen([*self.exe, *child.argv], env=child_env(child.env), process_group=0)
        self.services.append(Service(child.role, child.address, proc))
        return self.services[-1]

    def check_running(self) -> None:
        exited = [s for s in self.services if s.proc.poll() is not None]
        if exited:
            raise CLIError(
                "; ".join(f"{s} exited with status {s.proc.returncode}" for s in exited) + "; stopped the stack"
            )

    def stop(self) -> None:
        """Gateway first (no new requests), then the workers, all draining in parallel."""
        for s in reversed(self.services):
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 45
        for s in self.services:
            try:
                s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.engine.model_store import needs_conversion

    cfg = from_args(StackConfig, args)
    if needs_conversion(cfg.engine.model):
        print("pdserve up: converting the model for first use (once; about 20 s)...", file=sys.stderr, flush=True)
    plan = plan_stack(cfg)
    engine_config(cfg.engine, copies=len(plan.workers))  # model, dtype, KV budget: checked before anything starts
    tls = tls_config(cfg.tls, serving=True)
    _check_ports_free(cfg.server.host, plan.ports)
    # an answer on this terminal (--prompt) is not interleaved with the services' INFO lines, unless asked for
    prompt = cfg.up.prompt
    level = args.log_level if prompt is None or getattr(args, "log_level_given", True) else "WARNING"
    children = _Processes([sys.executable, "-m", "pdserve.cli", "--log-level", level, "--log-format", args.log_format])
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    t0 = time.perf_counter()
    try:
        asyncio.run(_wait_serving([children.spawn(c) for c in plan.workers], timeout=600, tls=tls))
        asyncio.run(_wait_serving([children.spawn(plan.gateway)], timeout=120, tls=tls))
        _say_up(cfg, plan, time.perf_counter() - t0)
        if prompt:
            asyncio.run(stream_completion(plan.gateway.address, _prompt_args(cfg, prompt)))
            print(f"[first answer {time.perf_counter() - t0:.1f}s after start]", file=sys.stderr)
            if cfg.up.exit_after_prompt:
                return 0
        print("serving; Ctrl-C stops", flush=True)
        while True:
            children.check_running()
            time.sleep(0.5)
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        children.stop()


def _say_up(cfg: StackConfig, plan: StackPlan, seconds: float) -> None:
    prefill = [c.address for c in plan.workers if c.role == "prefill worker"]
    decode = [c.address for c in plan.workers if c.role != "prefill worker"]
    print(
        f"pdserve is up: gateway {plan.gateway.address}, prefill {prefill}, decode {decode} ({seconds:.1f}s)",
        flush=True,
    )
    host, http = cfg.server.host, cfg.http
    if http.http_port >= 0:
        print(f"OpenAI-compatible API: http://{http.http_host or host}:{http.http_port}/v1", flush=True)
    if plan.metric_ports:
        ports = plan.metric_ports
        roles = " and ".join(f"{role}s" for role in dict.fromkeys(c.role for c in plan.workers))
        span = f"port {ports[1]}" if len(ports) == 2 else f"ports {ports[1]}-{ports[-1]}"
        where = cfg.observability.metrics_host or host
        print(f"metrics: http://{where}:{ports[0]}/metrics (gateway), {span} ({roles})", flush=True)


def _prompt_args(cfg: StackConfig, prompt: str) -> argparse.Namespace:
    """What `pdserve generate` would be given for the answer `up --prompt` prints."""
    return argparse.Namespace(
        prompt=prompt,
        max_tokens=256,
        temperature=0.0,
        top_p=None,
        seed=None,
        stop=[],
        raw=False,
        api_key=cfg.api_key.api_key,
        **vars(cfg.tls),
    )
