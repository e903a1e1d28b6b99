"""What an idle stack costs: 1 prefill + 1 decode worker and a gateway (OpenAI API on) on this machine, one 1-token
request prefilled remotely to connect everything (the KV plane included), then nothing. For each process and each
kind of thread: wake-ups a second (context switches that blocked, /proc) and CPU milliseconds a second (schedstat
run time).

    python -m pdserve.benchmarks.idle --seconds 10 --windows 2

A timed wake-up that finds nothing to do is what an idle service spends, and its price differs between hosts far
more than the count does (1,000 empty wake-ups a second took 3% of a core on one Sapphire Rapids VM, 36-48% on one
EPYC VM): report both, with the CPU flags, and compare counts across machines, milliseconds only on one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.compare import free_port
from pdserve.benchmarks.local_stack import LocalStack
from pdserve.client import Client
from pdserve.kernels.cpu_isa import isa_flags


@dataclass(frozen=True)
class ThreadSample:
    name: str
    switches: int  # voluntary context switches so far: each one a sleep that something later ended
    run_ns: int  # time on a CPU so far


def threads(pid: int) -> dict[int, ThreadSample]:
    """Every thread of `pid` now; threads that end while being read are left out."""
    out: dict[int, ThreadSample] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            name = Path(f"{base}/comm").read_text().strip()
            status = Path(f"{base}/status").read_text()
            run_ns = int(Path(f"{base}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out[int(tid)] = ThreadSample(name, int(fields["voluntary_ctxt_switches"]), run_ns)
    return out


def window(pids: dict[str, int], seconds: float) -> dict[str, dict[str, tuple[float, float]]]:
    """role -> thread name -> (wake-ups a second, CPU ms a second) over `seconds`, threads of one name summed."""
    before = {role: threads(pid) for role, pid in pids.items()}
    time.sleep(seconds)
    after = {role: threads(pid) for role, pid in pids.items()}
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for role in pids:
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for tid, now in after[role].items():
            then = before[role].get(tid, ThreadSample(now.name, 0, 0))
            sums[now.name][0] += (now.switches - then.switches) / seconds
            sums[now.name][1] += (now.run_ns - then.run_ns) / 1e6 / seconds
        out[role] = {name: (w, ms) for name, (w, ms) in sums.items() if w or ms}
    return out


async def _connect(gateway: str) -> None:
    async with Client(gateway) as client:
        await client.complete(prompt="Hi", max_tokens=1, timeout=300)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each measured window")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--settle", type=float, default=6.0, help="seconds after the request before measuring")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    print(f"CPU flags: {isa_flags()}")
    common = ["--dtype", args.dtype, "--threads", "1", "--kv-cache-memory", "64M"]
    remote = ["--local-prefill-max-tokens", "0"]  # the request's prompt goes through the KV plane
    stack = LocalStack(1, 1, common, remote, ["--http-port", str(free_port())])
    try:
        asyncio.run(_connect(stack.gateway))
        time.sleep(args.settle)
        roles = ("prefill", "decode", "gateway")
        pids = {role: stack.procs[a].pid for role, a in zip(roles, [*stack.prefill, *stack.decode, stack.gateway])}
        for i in range(args.windows):
            seen = window(pids, args.seconds)
            for role, by_name in seen.items():
                wakeups = sum(w for w, _ in by_name.values())
                ms = sum(m for _, m in by_name.values())
                top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:4]
                parts = ", ".join(f"{name} {w:.1f}/s {m:.2f} ms" for name, (w, m) in top)
                print(
                    f"window {i + 1} {role:8s} {wakeups:6.1f} wake-ups/s {ms:6.2f} ms/s ({ms / 10:.3f}% of a core)"
                    f"  [{parts}]",
                    flush=True,
                )
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
