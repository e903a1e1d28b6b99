"""`pdserve profile` and `pdserve plan`: measure this machine's phases, then size a deployment for a workload."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.cli.errors import CLIError
from pdserve.flags import from_args
from pdserve.options import EngineOptions


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, required=True, help="a profile written by `pdserve profile`")
    p.add_argument("--workers", type=int, default=2, help="worker processes (or GPUs) to split between roles")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (synthetic workloads)")
    p.add_argument("--arrival", default="poisson", choices=("poisson", "bursty"), help="arrival process")
    p.add_argument("--num-requests", type=int, default=500, help="requests simulated (synthetic workloads)")
    p.add_argument("--input-len", default="128", help="prompt tokens: N, or LO-HI for a uniform spread")
    p.add_argument("--output-len", default="128", help="output tokens: N, or LO-HI")
    p.add_argument("--trace", type=Path, default=None, help="JSONL trace (Mooncake or vllm-bench style) instead")
    p.add_argument("--slo-ttft", type=float, default=1000.0, help="time to first token SLO, ms")
    p.add_argument("--slo-tpot", type=float, default=100.0, help="time per output token SLO, ms")
    p.add_argument(
        "--local-prefill-max-tokens", type=int, default=0, help="disaggregated candidates: conditional prefill"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write SLO attainment against rate (PNG) here")


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.benchmarks.phase_profile import FULL, QUICK, cpu_flags, profile
    from pdserve.cli.services import engine_config

    engine = from_args(EngineOptions, args)
    cfg = engine_config(engine)
    machine = cpu_flags() if cfg.device == "cpu" else str(cfg.device)
    result = profile(cfg, engine.kv_transport, machine, QUICK if args.quick else FULL)
    result.save(args.out)
    print(
        f"wrote {args.out}: {len(result.steps)} steps, fit error median {result.fit_error['median']:.1%} "
        f"(p90 {result.fit_error['p90']:.1%}); KV transfer {result.transfer_latency_s * 1000:.2f} ms + "
        f"{result.transfer_bytes_per_s / 1e9:.2f} GB/s"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.planner import workload
    from pdserve.planner.plan import SLO, as_json, plan, plot, table
    from pdserve.planner.profile import Profile

    if args.workers < 1 or args.num_requests < 1 or args.rate <= 0:
        raise CLIError("--workers, --num-requests and --rate must be positive")
    try:
        prof = Profile.load(args.profile)
        if args.trace is not None:
            requests = workload.from_trace(args.trace)
            shape = {"trace": str(args.trace), "requests": len(requests)}
        else:
            requests = workload.synthetic(
                args.rate,
                args.num_requests,
                workload.lengths(args.input_len),
                workload.lengths(args.output_len),
                args.arrival,
                seed=args.seed,
            )
            shape = {k: getattr(args, k) for k in ("rate", "arrival", "num_requests", "input_len", "output_len")}
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(str(e)) from None
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError("--plot needs matplotlib: pip install 'pdserve[plan]' (or matplotlib)") from None
    slo = SLO(args.slo_ttft / 1000, args.slo_tpot / 1000)
    predictions = plan(prof, args.workers, requests, slo, args.local_prefill_max_tokens)
    if args.json:
        json.dump(as_json(predictions, slo, prof, shape), sys.stdout, indent=1)
        print()
    else:
        print(table(predictions, slo))
    if args.plot is not None:
        plot(predictions, slo, args.plot)
    return 0
