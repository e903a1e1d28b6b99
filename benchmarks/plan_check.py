"""Is `pdserve plan` right? Profile this machine, predict each deployment at each rate, run it for real, compare.

    python -m pdserve.benchmarks.plan_check --workers 2 --rates 0.5 1.0 --out benchmarks/results/plan-check

For every candidate of `--workers` worker processes (colocated on all, each prefill:decode split) and every rate,
the simulator is fed the very requests `pdserve bench`'s load generator then sends (the same Poisson arrival
times and prompt lengths, from the same seed), and the stack is started with the profile's engine flags. Reports
predicted against measured goodput, TTFT p50 and TPOT p50, their median absolute errors, and whether the
recommended deployment is the measured best (or within 10% of its goodput). Writes `rows.jsonl`, `summary.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from pdserve.benchmarks.bench_stats import compute_metrics
from pdserve.benchmarks.load_gen import GrpcTarget, make_requests, run_load
from pdserve.benchmarks.local_stack import LocalStack
from pdserve.benchmarks.phase_profile import cpu_flags, profile
from pdserve.planner.plan import SLO, candidates, predict
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import Deployment
from pdserve.planner.workload import Request


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """The send times `load_gen.run_load` uses: the first at once, then exponential gaps from Random(seed)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _measure(gateway: str, reqs, rate: float, seed: int, slo: SLO) -> dict:
    target = GrpcTarget(gateway)
    try:
        warm = make_requests(2, [16], 4, seed + 1)
        results, duration, peak = await run_load(target, reqs, None, rate, seed, warm)
    finally:
        await target.close()
    slos = {"ttft": slo.ttft_s * 1000, "tpot": slo.tpot_s * 1000}
    return compute_metrics(results, duration, [50, 90, 99], slos, peak).as_dict()


def check(
    prof: Profile,
    workers: int,
    rates: list[float],
    num_requests: int,
    input_len: int,
    output_len: int,
    slo: SLO,
    worker_flags: list[str],
    seed: int = 0,
) -> list[dict]:
    """Predicted and measured goodput, TTFT p50 and TPOT p50 of every candidate deployment at every rate."""
    rows = []
    for dep in candidates(workers):
        stack = LocalStack(
            dep.prefill, dep.decode, worker_flags, [] if dep.colocated else ["--local-prefill-max-tokens", "0"]
        )
        try:
            for i, rate in enumerate(rates):
                # prompts of their own per run: one a server saw before would hit its prefix cache
                reqs = make_requests(num_requests, [input_len], output_len, seed + 7919 * (i + 1))
                times = arrivals(len(reqs), rate, seed)
                sim = [Request(t, len(r.prompt_ids), r.output_len) for t, r in zip(times, reqs)]
                predicted = predict(prof, Deployment(dep.prefill, dep.decode), sim, slo)
                measured = asyncio.run(_measure(stack.gateway, reqs, rate, seed, slo))
                row = {
                    "deployment": dep.label,
                    "rate": rate,
                    "predicted": {
                        "goodput": predicted.goodput,
                        "ttft_p50_ms": predicted.ttft_s["p50"] * 1000,
                        "tpot_p50_ms": predicted.tpot_s["p50"] * 1000,
                    },
                    "measured": {
                        "goodput": measured["request_goodput"],
                        "ttft_p50_ms": measured["ttft_ms"]["median"],
                        "tpot_p50_ms": measured["tpot_ms"]["median"],
                        "failed": measured["failed"],
                    },
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": prof.machine,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stack.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slo-ttft", type=float, default=1500.0, help="ms")
    p.add_argument("--slo-tpot", type=float, default=150.0, help="ms")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--kv-transport", default="ucx")
    p.add_argument("--profile", type=Path, default=None, help="use this profile instead of taking one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/plan-check"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    flags = ["--dtype", args.dtype, "--threads", str(args.threads), "--kv-cache-memory", "256M"]
    if args.profile is not None:
        prof = Profile.load(args.profile)
    else:
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.model_store import resolve_model

        cfg = EngineConfig(
            model=str(resolve_model(None)), dtype=args.dtype, num_threads=args.threads, kv_cache_memory=256 << 20
        )
        prof = profile(cfg, args.kv_transport, cpu_flags())
        prof.save(args.out / "profile.json")
    slo = SLO(args.slo_ttft / 1000, args.slo_tpot / 1000)
    rows = check(
        prof,
        args.workers,
        args.rates,
        args.num_requests,
        args.input_len,
        args.output_len,
        slo,
        [*flags, "--kv-transport", args.kv_transport],
        args.seed,
    )
    with (args.out / "rows.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    summary = summarize(rows, slo)
    (args.out / "summary.md").write_text(summary)
    print(summary)


def _err(p: float, m: float) -> float:
    return abs(p - m) / m if m else (0.0 if p == m else float("inf"))


def summarize(rows: list[dict], slo: SLO) -> str:
    lines = [
        f"SLOs: TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= {slo.tpot_s * 1000:.0f} ms",
        "",
        "| deployment | rate/s | goodput pred | meas | TTFT p50 pred | meas | TPOT p50 pred | meas |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        pr, me = r["predicted"], r["measured"]
        lines.append(
            f"| {r['deployment']} | {r['rate']:g} | {pr['goodput']:.2f} | {me['goodput']:.2f} | "
            f"{pr['ttft_p50_ms']:.0f} ms | {me['ttft_p50_ms']:.0f} ms | {pr['tpot_p50_ms']:.1f} ms | "
            f"{me['tpot_p50_ms']:.1f} ms |"
        )
    errors = {
        key: statistics.median(_err(r["predicted"][key], r["measured"][key]) for r in rows)
        for key in ("goodput", "ttft_p50_ms", "tpot_p50_ms")
    }
    lines += ["", "median absolute error: " + ", ".join(f"{k} {v:.0%}" for k, v in errors.items())]
    for rate in sorted({r["rate"] for r in rows}):
        at = [r for r in rows if r["rate"] == rate]
        pick = max(at, key=lambda r: r["predicted"]["goodput"])
        best = max(at, key=lambda r: r["measured"]["goodput"])
        gap = 1 - pick["measured"]["goodput"] / best["measured"]["goodput"] if best["measured"]["goodput"] else 0.0
        lines.append(
            f"rate {rate:g}/s: recommended {pick['deployment']}, measured best {best['deployment']} "
            f"(the recommendation's measured goodput is {gap:.0%} below the best)"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
