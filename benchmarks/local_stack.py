"""A stack of pdserve processes on this machine for a benchmark: workers and a gateway on free loopback ports,
each started with the CLI and waited for until its health says SERVING; `start` brings one back after a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.benchmarks.compare import free_port


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(f"{address} not serving after {timeout:.0f}s")


class LocalStack:
    """`prefill` prefill workers and `decode` decode workers (colocated ones when `prefill` is 0) behind a
    gateway; `common` goes to every worker, `decode_args` to the decode workers, `gateway_args` to the gateway."""

    def __init__(
        self,
        prefill: int,
        decode: int,
        common: list[str],
        decode_args: list[str] = (),  # type: ignore[assignment]
        gateway_args: list[str] = (),  # type: ignore[assignment]
    ) -> None:
        self.exe = [sys.executable, "-m", "pdserve.cli"]
        self.env = {**os.environ, "UCX_NET_DEVICES": "lo", "PDSERVE_LOG_LEVEL": "WARNING", "PDSERVE_HTTP_PORT": "-1"}
        self.prefill = [f"127.0.0.1:{free_port()}" for _ in range(prefill)]
        self.decode = [f"127.0.0.1:{free_port()}" for _ in range(decode)]
        self.gateway = f"127.0.0.1:{free_port()}"
        metrics_port = free_port()
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        self.argv: dict[str, list[str]] = {}
        for p in self.prefill:
            self.argv[p] = ["prefill", "--port", p.rsplit(":", 1)[1], *common]
        role = "decode" if prefill else "colocated"
        for d in self.decode:
            self.argv[d] = [role, "--port", d.rsplit(":", 1)[1], *common, *decode_args]
        self.argv[self.gateway] = [
            "gateway",
            "--port",
            self.gateway.rsplit(":", 1)[1],
            "--prefill",
            ",".join(self.prefill),
        ]
        self.argv[self.gateway] += [
            "--decode",
            ",".join(self.decode),
            "--metrics-port",
            str(metrics_port),
            *gateway_args,
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            for address in self.argv:
                self.start(address)
        except BaseException:
            self.stop()
            raise

    def start(self, address: str) -> None:
        argv = self.argv[address] + ([] if address == self.gateway else ["--metrics-port", "-1"])
        self.procs[address] = subprocess.Popen([*self.exe, *argv], env=self.env)
        wait_serving(address, self.procs[address])

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
