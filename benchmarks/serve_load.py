"""Load through the gateway: output tokens/s, TTFT and ITL percentiles, service memory and KV pool use.

    python -m benchmarks.serve_load --concurrency 1 8 32 --requests 8 32 64 --dtype bfloat16

Starts `pdserve up` (gateway + 1 prefill + 1 decode) on free ports unless --gateway points at a running one.
Every request has a prompt of about --prompt-len tokens and produces exactly --output-len tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.client import Client, build_request
from protos import worker_pb2, worker_pb2_grpc


@dataclass
class Timing:
    start: float
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int, length: int, seed: int) -> list[str]:
    from engine.model_store import resolve_model
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model(None))
    rng = random.Random(seed)
    words = "time river light stone garden music paper window engine silver forest market signal winter".split()
    out = []
    for _ in range(n):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(length * 2)))[:length]
        out.append(tok.decode(ids))
    return out


async def _one(client: Client, prompt: str, out_len: int) -> Timing:
    t = Timing(time.perf_counter())
    call = client.stub.Generate(build_request(prompt=prompt, max_tokens=out_len, temperature=0.0, ignore_eos=True))
    async for resp in call:
        if resp.token_ids:
            t.token_times.append(time.perf_counter())
            t.tokens += len(resp.token_ids)
    return t


async def _sample_pool(decode: list[str], samples: list[tuple[int, int]], stop: asyncio.Event) -> None:
    channels = [grpc.aio.insecure_channel(a) for a in decode]
    stubs = [worker_pb2_grpc.DecodeServiceStub(c) for c in channels]
    while not stop.is_set():
        for stub in stubs:
            s = await stub.GetStats(worker_pb2.StatsRequest())
            if s.kv_blocks_used:
                samples.append((s.tokens_held, s.kv_blocks_used * s.block_size))
        await asyncio.sleep(0.2)
    for c in channels:
        await c.close()


async def run_level(gateway: str, decode: list[str], prompts: list[str], concurrency: int, out_len: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    pool: list[tuple[int, int]] = []
    stop = asyncio.Event()
    async with Client(gateway) as client:
        await _one(client, prompts[0], 4)  # warm-up

        async def bounded(p: str) -> Timing:
            async with sem:
                return await _one(client, p, out_len)

        sampler = asyncio.create_task(_sample_pool(decode, pool, stop))
        t0 = time.perf_counter()
        timings = await asyncio.gather(*(bounded(p) for p in prompts))
        elapsed = time.perf_counter() - t0
        stop.set()
        await sampler
    ttft = [t.token_times[0] - t.start for t in timings]
    itl = [b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:])]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (t.tokens - 1) for t in timings if t.tokens > 1]
    tokens = sum(t.tokens for t in timings)
    held = sum(h for h, _ in pool)
    cap = sum(c for _, c in pool)
    return {"concurrency": concurrency, "requests": len(prompts), "seconds": elapsed,
            "output_tok_s": tokens / elapsed, "req_s": len(prompts) / elapsed,
            "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99), "tpot_mean": statistics.fmean(tpot),
            "itl_p50": _pct(itl, 0.5), "itl_p99": _pct(itl, 0.99), "kv_utilization": held / cap if cap else None}


def _rss_mb(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[pid] = int(line.split()[1]) / 1024
        except OSError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, nargs="+", default=None, help="requests per level (default 2x conc, >=8)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-transport", default="ucx")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    counts = args.requests or [max(8, 2 * c) for c in args.concurrency]
    ports = [_free_port() for _ in range(3)]
    gateway, decode = f"127.0.0.1:{ports[0]}", [f"127.0.0.1:{ports[2]}"]
    t0 = time.perf_counter()
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "up", "--port", str(ports[0]),
                           "--prefill-port", str(ports[1]), "--decode-port", str(ports[2]), "--dtype", args.dtype,
                           "--kv-transport", args.kv_transport, "--kv-cache-memory", "1G",
                           "--prompt", "Say hello.", "--max-num-seqs", str(max(args.concurrency)),
                           *(["--threads", str(args.threads)] if args.threads else [])],
                          stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        for line in up.stdout:
            if line.startswith("serving"):
                break
        ready_s = time.perf_counter() - t0
        print(f"pdserve up -> first answer -> serving: {ready_s:.1f}s (dtype {args.dtype}, KV over {args.kv_transport})")
        print(f"{'conc':>4} {'reqs':>4} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
              f" {'KV util':>7}")
        for conc, n in zip(args.concurrency, counts):
            prompts = _prompts(n, args.prompt_len, seed=conc)
            row = asyncio.run(run_level(gateway, decode, prompts, conc, args.output_len))
            rows.append(row)
            util = f"{row['kv_utilization']:.3f}" if row["kv_utilization"] is not None else "-"
            print(f"{conc:>4} {n:>4} {row['output_tok_s']:>9.1f} {row['ttft_p50']:>8.3f}s {row['ttft_p99']:>8.3f}s "
                  f"{row['itl_p50'] * 1e3:>6.1f}ms {row['itl_p99'] * 1e3:>6.1f}ms {util:>7}", flush=True)
        children = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
        rss = _rss_mb([int(p) for p in children])
        roles = ["prefill", "decode", "gateway"]
        print("peak RSS: " + ", ".join(f"{roles[i] if i < 3 else pid}: {mb:.0f} MiB"
                                       for i, (pid, mb) in enumerate(sorted(rss.items()))))
    finally:
        up.terminate()
        up.wait(60)
    if args.json:
        Path(args.json).write_text(json.dumps({"ready_s": ready_s, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
