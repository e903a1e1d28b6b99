"""Offline generation throughput: the pdserve engine vs `transformers.generate`, same prompts, one run.

    python -m pdserve.benchmarks.engine_throughput --batches 1 8 32 --repeats 3 --dtype bfloat16

Every prompt is exactly `--prompt-len` tokens and every request produces exactly `--output-len` tokens
(the engine with ignore_eos, transformers with min_new_tokens), so both do the same work.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def bench_engine(engine, prompts, out_len) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o) == out_len for o in outs)
    return len(prompts) * out_len / elapsed


def bench_hf(model, prompts, out_len) -> float:
    ids = torch.tensor(prompts, device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=0,
        )
    if out.is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + out_len
    return len(prompts) * out_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: both engines run there")
    ap.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes for the engine's KV pool")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from pdserve.engine.config import EngineConfig, parse_dtype
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.model_store import resolve_model, transformers_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    dtype = parse_dtype(args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(transformers_dir(path)), dtype=dtype).eval().to(args.device)
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            dtype=args.dtype,
            max_num_seqs=max(args.batches),
            kv_cache_memory=args.kv_cache_memory,
            device=args.device,
        )
    )
    bench_engine(engine, _prompts(2, 16, 0), 4)  # warm-up
    rows = []
    print(
        f"dtype={args.dtype} device={args.device} threads={torch.get_num_threads()} prompt={args.prompt_len} "
        f"out={args.output_len}"
    )
    print(f"{'batch':>5} {'pdserve tok/s':>14} {'HF tok/s':>10} {'ratio':>6}   (median of {args.repeats})")
    for b in args.batches:
        ours, theirs = [], []
        for r in range(args.repeats):
            prompts = _prompts(b, args.prompt_len, seed=r + 1)
            ours.append(bench_engine(engine, prompts, args.output_len))
            theirs.append(bench_hf(hf, prompts, args.output_len))
        row = {
            "batch": b,
            "pdserve": statistics.median(ours),
            "hf": statistics.median(theirs),
            "pdserve_runs": ours,
            "hf_runs": theirs,
        }
        row["ratio"] = row["pdserve"] / row["hf"]
        rows.append(row)
        print(f"{b:>5} {row['pdserve']:>14.1f} {row['hf']:>10.1f} {row['ratio']:>6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "device": args.device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
