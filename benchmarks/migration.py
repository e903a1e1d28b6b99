"""What a migration costs a stream: 1 prefill + 2 decode workers + gateway on this machine, N greedy streams,
then the decode worker running the most of them is killed (-9) or drained (SIGTERM), and each stream's tokens are
timed at the client.

    python -m pdserve.benchmarks.migration --event kill drain --streams 8 --max-tokens 96

For each event: how many streams moved (the gateway's own count), the client's gap across a move (the
gateway's `pdserve_gateway_migration_stall_seconds`: last token before the move to first after), each stream's
largest inter-token gap next to the run's median ITL, whether every text equals the unbroken run's, and how
long the drained worker took to exit. Writes one JSON line per event to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import time
import urllib.request
from pathlib import Path

import grpc

from pdserve.benchmarks.local_stack import LocalStack
from pdserve.client import Client
from pdserve.protos import worker_pb2, worker_pb2_grpc

PROMPTS = [f"Story {i}: the lighthouse keeper opened the door and" for i in range(64)]


def _running(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.DecodeServiceStub(ch).GetStats(worker_pb2.StatsRequest(), timeout=5).running


def _stall(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the gateway's migration stall histogram."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    found = {}
    for line in text.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f"pdserve_gateway_migration_stall_seconds_{key} "):
                found[key] = float(line.split()[-1])
    return found.get("sum", 0.0), found.get("count", 0.0)


async def _streams(gateway: str, n: int, max_tokens: int, on_started=None) -> list[dict]:
    """n concurrent greedy streams; each returns its token ids and the arrival time of each message."""
    started = asyncio.Event()
    counts = [0] * n

    async def one(client: Client, i: int) -> dict:
        ids, times = [], []
        try:
            async for resp in client.stream(
                prompt=PROMPTS[i], max_tokens=max_tokens, ignore_eos=True, temperature=0.0, timeout=600
            ):
                ids.extend(resp.token_ids)
                times.append(time.perf_counter())
                counts[i] = len(ids)
                if min(counts) >= 4:
                    started.set()
        except grpc.aio.AioRpcError as e:
            return {"ids": ids, "times": times, "error": f"{e.code().name}: {e.details()}"}
        return {"ids": ids, "times": times, "error": None}

    async with Client(gateway) as client:
        tasks = [asyncio.ensure_future(one(client, i)) for i in range(n)]
        if on_started is not None:
            await asyncio.wait_for(started.wait(), 300)
            await asyncio.get_running_loop().run_in_executor(None, on_started)
        return await asyncio.gather(*tasks)


def run_event(stack: LocalStack, event: str, args: argparse.Namespace) -> dict:
    reference = asyncio.run(_streams(stack.gateway, args.streams, args.max_tokens))
    before = _stall(stack.metrics)
    timing: dict[str, float] = {}

    def strike() -> None:
        victim = max(stack.decode, key=_running)
        timing["victim_running"] = _running(victim)
        proc = stack.procs[victim]
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGKILL if event == "kill" else signal.SIGTERM)
        proc.wait(120)
        timing["exit_s"] = time.perf_counter() - t0
        timing["victim"] = victim  # type: ignore[assignment]

    moved = asyncio.run(_streams(stack.gateway, args.streams, args.max_tokens, strike))
    after = _stall(stack.metrics)
    stack.start(str(timing["victim"]))
    gaps = [b - a for r in reference for a, b in zip(r["times"], r["times"][1:])]
    largest = sorted(max((b - a for a, b in zip(r["times"], r["times"][1:])), default=0.0) for r in moved)
    count = after[1] - before[1]
    return {
        "event": event,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "victim_running": timing["victim_running"],
        "moved": count,
        "stall_mean_s": round((after[0] - before[0]) / count, 4) if count else None,
        "largest_gap_per_stream_s": [round(g, 3) for g in largest],
        "itl_median_unbroken_s": round(statistics.median(gaps), 4),
        "failed": [r["error"] for r in moved if r["error"]],
        "exact": all(m["ids"] == r["ids"] for m, r in zip(moved, reference)),
        "victim_exit_s": round(timing["exit_s"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--event", nargs="+", default=["kill", "drain"], choices=["kill", "drain"])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--drain-grace", type=float, default=0.0, help="the decode workers' --drain-grace")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per event here")
    args = p.parse_args()
    common = ["--dtype", args.dtype, "--threads", str(args.threads), "--kv-cache-memory", "256M"]
    stack = LocalStack(1, 2, common, ["--drain-grace", str(args.drain_grace), "--local-prefill-max-tokens", "0"])
    try:
        for event in args.event:
            row = run_event(stack, event, args)
            print(json.dumps(row), flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with args.out.open("a") as f:
                    f.write(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **row}) + "\n")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
