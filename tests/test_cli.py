"""The `pdserve` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from tests.stack import free_port, service_env


def test_parser_knows_every_service():
    p = build_parser()
    assert p.parse_args(["decode", "--port", "1", "--kv-transport", "tcp"]).kv_transport == "tcp"
    assert p.parse_args(["prefill", "--kv-cache-memory", "2G"]).kv_cache_memory == 2 << 30
    assert p.parse_args(["gateway", "--prefill", "a:1", "--decode", "b:2"]).decode == "b:2"
    assert p.parse_args(["up", "--decode-workers", "2"]).decode_workers == 2
    with pytest.raises(SystemExit):
        p.parse_args(["decode", "--kv-transport", "carrier-pigeon"])


@pytest.mark.slow
def test_up_answers_a_prompt_and_stops_cleanly():
    """What README's `make run` does, on free ports: the stack starts, answers, and every process exits."""
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "up", "--port", ports[0], "--metrics-port", "-1",
         "--prefill-port", ports[1], "--decode-port", ports[2], "--prompt", "Say hello.", "--exit-after-prompt"],
        env=service_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pdserve is up" in proc.stdout
    answer = proc.stdout.split("pdserve is up", 1)[1].split("\n", 1)[1]
    assert answer.strip(), proc.stdout
    assert "first answer" in proc.stderr


@pytest.mark.slow
def test_up_with_two_workers_per_role_spreads_requests():
    import asyncio
    import signal

    from pdserve.client import Client
    from tests.stack import Stack

    g, p0, d0 = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "up", "--port", str(g),
                             "--prefill-port", str(p0), "--decode-port", str(d0), "--prefill-workers", "2",
                             "--decode-workers", "2", "--kv-cache-memory", "128M", "--metrics-port", "-1"],
                            env=service_env(), stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("serving"):
                break
        stack = Stack(f"127.0.0.1:{g}", [f"127.0.0.1:{p0}", f"127.0.0.1:{p0 + 1}"],
                      [f"127.0.0.1:{d0}", f"127.0.0.1:{d0 + 1}"])

        async def run():
            async with Client(stack.gateway) as client:
                return await asyncio.gather(*(client.complete(prompt=f"Tell me about number {i}", max_tokens=8,
                                                              temperature=0.0) for i in range(12)))

        assert len(asyncio.run(run())) == 12
        assert all(stack.stats(a, "decode").requests_total > 0 for a in stack.decode)
        assert all(stack.stats(a, "prefill").requests_total > 0 for a in stack.prefill)
        stack.wait_idle()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
