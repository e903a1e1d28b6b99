"""Start real pdserve services as subprocesses on free 127.0.0.1 ports, and stop them."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protos import worker_pb2, worker_pb2_grpc


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """A live /metrics page, parsed by Prometheus' own text parser: {(sample name, labels): value}."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


_given: set[int] = set()
_rng = random.Random(os.getpid())


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """The first of `span` consecutive free 127.0.0.1 ports below the kernel's ephemeral range, never handed out
    twice in this run: ports the kernel picks for listeners that bind port 0 (UCX's KV listeners, clients) never
    land on them in the moment between choosing them and a service binding them."""
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(range_file.read_text().split()[0]) if range_file.is_file() else 32768
    for _ in range(1000):
        base = _rng.randrange(max(1024, low - 12000), low - span)
        ports = range(base, base + span)
        if any(p in _given for p in ports) or not all(_free(p) for p in ports):
            continue
        _given.update(ports)
        return base
    raise RuntimeError("no free port below the ephemeral range")


def service_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n", PYTHONUNBUFFERED="1")
    env.setdefault("PDSERVE_LOG_LEVEL", "WARNING")
    env["PDSERVE_HTTP_PORT"] = "-1"  # the OpenAI API's default port (8000) is not the tests' to take
    return env


def channel(address: str, tls=None) -> grpc.Channel:
    """A blocking channel to a service (TLS, with this test's client certificate, when `tls` is given)."""
    creds = tls.channel_credentials() if tls is not None else None
    return (
        grpc.secure_channel(address, creds, options=tls.channel_options()) if creds else grpc.insecure_channel(address)
    )


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 180.0, tls=None) -> None:
    deadline = time.monotonic() + timeout
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service {proc.args} exited with {proc.returncode}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(f"{address} not serving after {timeout}s")


@dataclass
class Stack:
    gateway: str
    prefill: list[str]
    decode: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)  # role -> /metrics URL
    tls: object = None  # a TLSConfig when the stack speaks TLS
    http: str = ""  # base URL of the gateway's OpenAI-compatible API

    def stats(self, address: str, role: str) -> worker_pb2.WorkerStats:
        stub_cls = worker_pb2_grpc.PrefillServiceStub if role == "prefill" else worker_pb2_grpc.DecodeServiceStub
        with channel(address, self.tls) as ch:
            return stub_cls(ch).GetStats(worker_pb2.StatsRequest(), timeout=5)

    def wait_idle(self, timeout: float = 30.0) -> worker_pb2.WorkerStats:
        """Until every worker holds no KV block for a request (cached prefix blocks are free)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = [self.stats(a, "decode") for a in self.decode] + [self.stats(a, "prefill") for a in self.prefill]
            if all(s.kv_blocks_used == 0 and s.running == 0 and s.pending_transfers == 0 for s in stats):
                return stats[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not idle after {timeout}s: {stats}")
            time.sleep(0.2)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def wait_routable(stack: Stack, timeout: float = 60.0) -> None:
    """Until the gateway counts every worker healthy. It serves once one worker of each role answers its poll,
    and one still starting then joins at a later probe: requests sent before that would all go to the others
    (a routing test saw 10, 5 and 0 prefills on three workers). A stack with a worker the gateway refuses still
    starts, after `timeout`; its test asserts what follows."""
    want = {"prefill": len(stack.prefill), "decode": len(stack.decode)}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen = scrape(stack.metrics["gateway"])
        except OSError:
            seen = {}
        healthy = {
            r: seen.get(("pdserve_gateway_workers", frozenset({("role", r), ("state", "healthy")})), 0) for r in want
        }
        if all(healthy[r] >= n for r, n in want.items()):
            return
        time.sleep(0.05)


def start_stack(
    extra: list[str] = (),
    dtype: str = "float32",
    threads: int = 1,
    decode_extra: list[str] = (),
    observe: list[str] = (),
    env: dict | None = None,
    log_dir: Path | None = None,
    colocated: bool = False,
    decode_workers: int = 1,
    gateway_extra: list[str] = (),
    everyone: list[str] = (),
    tls=None,
    prefill_workers: int = 1,
) -> Stack:
    """Prefill, decode (`decode_workers` of them) and gateway on free ports; `observe` goes to all of them
    (e.g. --otlp-endpoint), and so does `everyone` (e.g. TLS flags; pass the test's own `tls` for its
    channels). With `log_dir`, each service's stderr goes to `<role>.log` there."""
    exe = [sys.executable, "-m", "pdserve.cli"]
    env = {k: v for k, v in {**service_env(), **(env or {})}.items() if v is not None}  # None: unset it
    g_port, h_port = free_port(), free_port()
    p_ports = [free_port() for _ in range(0 if colocated else prefill_workers)]
    d_ports = [free_port() for _ in range(decode_workers)]
    metric_ports = {role: free_port() for role in ("prefill", "decode", "gateway")}
    stack = Stack(
        f"127.0.0.1:{g_port}",
        [f"127.0.0.1:{p}" for p in p_ports],
        [f"127.0.0.1:{p}" for p in d_ports],
        metrics={role: f"http://127.0.0.1:{port}/metrics" for role, port in metric_ports.items()},
        tls=tls,
        http=f"{'https' if tls is not None else 'http'}://127.0.0.1:{h_port}",
    )
    common = ["--dtype", dtype, "--threads", str(threads), "--kv-cache-memory", "128M", *extra]

    def spawn(role: str, args: list[str], metrics_port: int, log_name: str) -> None:
        argv = [*exe, role, *args, "--metrics-port", str(metrics_port), *observe, *everyone]
        if log_dir is None:
            stack.procs.append(subprocess.Popen(argv, env=env))
            return
        with open(log_dir / f"{log_name}.log", "w") as err:
            stack.procs.append(subprocess.Popen(argv, env=env, stderr=err))

    try:
        for i, port in enumerate(p_ports):
            spawn(
                "prefill",
                ["--port", str(port), *common],
                metric_ports["prefill"] if i == 0 else free_port(),
                "prefill" if i == 0 else f"prefill{i}",
            )
        for i, port in enumerate(d_ports):
            metrics = metric_ports["decode"] if i == 0 else free_port()
            # every prompt crosses the KV path unless a test asks for conditional disaggregation
            remote = [] if colocated else ["--local-prefill-max-tokens", "0"]
            spawn(
                "colocated" if colocated else "decode",
                ["--port", str(port), *common, *remote, *decode_extra],
                metrics,
                "decode" if i == 0 else f"decode{i}",
            )
        spawn(
            "gateway",
            [
                "--port",
                str(g_port),
                "--http-port",
                str(h_port),
                "--prefill",
                ",".join(stack.prefill),
                "--decode",
                ",".join(stack.decode),
                *gateway_extra,
            ],
            metric_ports["gateway"],
            "gateway",
        )
        for addr, proc in zip([*stack.prefill, *stack.decode, stack.gateway], stack.procs):
            wait_serving(addr, proc, tls=tls)
        wait_routable(stack)
    except BaseException:
        stack.stop()
        raise
    return stack
