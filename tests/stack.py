"""Start real pdserve services as subprocesses on free 127.0.0.1 ports, and stop them."""

from __future__ import annotations

import os
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

from protos import worker_pb2, worker_pb2_grpc


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """A live /metrics page, parsed by Prometheus' own text parser: {(sample name, labels): value}."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n", PYTHONUNBUFFERED="1")
    env.setdefault("PDSERVE_LOG_LEVEL", "WARNING")
    return env


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service {proc.args} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
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

    def stats(self, address: str, role: str) -> worker_pb2.WorkerStats:
        stub_cls = worker_pb2_grpc.PrefillServiceStub if role == "prefill" else worker_pb2_grpc.DecodeServiceStub
        with grpc.insecure_channel(address) as channel:
            return stub_cls(channel).GetStats(worker_pb2.StatsRequest(), timeout=5)

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


def start_stack(extra: list[str] = (), dtype: str = "float32", threads: int = 1, decode_extra: list[str] = (),
                observe: list[str] = (), env: dict | None = None, log_dir: Path | None = None,
                colocated: bool = False, decode_workers: int = 1, gateway_extra: list[str] = ()) -> Stack:
    """Prefill, decode (`decode_workers` of them) and gateway on free ports; `observe` goes to all of them
    (e.g. --otlp-endpoint). With `log_dir`, each service's stderr goes to `<role>.log` there."""
    exe = [sys.executable, "-m", "cli"]
    env = {**service_env(), **(env or {})}
    p_port, g_port = free_port(), free_port()
    d_ports = [free_port() for _ in range(decode_workers)]
    metric_ports = {role: free_port() for role in ("prefill", "decode", "gateway")}
    stack = Stack(f"127.0.0.1:{g_port}", [] if colocated else [f"127.0.0.1:{p_port}"],
                  [f"127.0.0.1:{p}" for p in d_ports],
                  metrics={role: f"http://127.0.0.1:{port}/metrics" for role, port in metric_ports.items()})
    common = ["--dtype", dtype, "--threads", str(threads), "--kv-cache-memory", "128M", *extra]

    def spawn(role: str, args: list[str], metrics_port: int, log_name: str) -> None:
        argv = [*exe, role, *args, "--metrics-port", str(metrics_port), *observe]
        if log_dir is None:
            stack.procs.append(subprocess.Popen(argv, env=env))
            return
        with open(log_dir / f"{log_name}.log", "w") as err:
            stack.procs.append(subprocess.Popen(argv, env=env, stderr=err))

    try:
        if not colocated:
            spawn("prefill", ["--port", str(p_port), *common], metric_ports["prefill"], "prefill")
        for i, port in enumerate(d_ports):
            metrics = metric_ports["decode"] if i == 0 else free_port()
            spawn("colocated" if colocated else "decode", ["--port", str(port), *common, *decode_extra], metrics,
                  "decode" if i == 0 else f"decode{i}")
        spawn("gateway", ["--port", str(g_port), "--prefill", ",".join(stack.prefill), "--decode",
                          ",".join(stack.decode), *gateway_extra], metric_ports["gateway"], "gateway")
        for addr, proc in zip([*stack.prefill, *stack.decode, stack.gateway], stack.procs):
            wait_serving(addr, proc)
    except BaseException:
        stack.stop()
        raise
    return stack
