"""Where one decode step's time goes: the engine's own step at a fixed batch and context, timed and profiled.

    python -m pdserve.benchmarks.step_profile --batch 32 --context 192 --dtype bfloat16 --threads 2 \
        [--attention-backend torch]

Fills the engine with `--batch` sequences whose prompts are `--context` tokens, then times `--steps` pure
decode steps (schedule, forward, sample, update: what the serving loop runs) and prints the median step
time and a `torch.profiler` table of the operators that take the time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none", help="none, q8_0, q4_0 or gguf (CPU weight format)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--rows", type=int, default=25, help="profiler table rows")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--attention-backend", default="auto", help="auto, cpu or torch on a CPU")
    args = ap.parse_args()

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.model_store import resolve_model
    from pdserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = EngineCore(
        EngineConfig(
            model=str(resolve_model(None)),
            dtype=args.dtype,
            max_num_seqs=args.batch,
            kv_cache_memory=1 << 30,
            max_num_batched_tokens=max(2048, args.context),
            attention_backend=args.attention_backend,
            quantization=args.quantization,
        )
    )
    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=4096 - args.context,
        temperature=args.temperature,
        top_p=args.top_p,
        ignore_eos=True,
        seed=1 if args.temperature else None,
    )
    for _ in range(args.batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(args.context)], params)
    while (
        any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()  # prefill everything first
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    print(
        f"batch {args.batch}, context {args.context}, {args.dtype}, {args.threads} threads, "
        f"{engine.runner.backend.name} attention: "
        f"decode step {step * 1e3:.1f} ms median of {args.steps} ({args.batch / step:.0f} tok/s)"
    )
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
