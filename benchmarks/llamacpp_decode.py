"""llama.cpp's decode step, timed the way `pdserve.benchmarks.roofline` times pdserve's: B sequences of a 192-token
context, one new token each per step, median step time. Run it with the Python that has llama-cpp-python:

    /path/to/llamacpp-venv/bin/python benchmarks/llamacpp_decode.py MODEL.gguf --threads 2 --batches 1 8

It imports nothing of pdserve (llama.cpp lives in its own venv; see docs/PERFORMANCE.md). llama-cpp-python's server
holds one sequence at a time, so this, through its low-level API, is how llama.cpp's batch-8 step is measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> None:
    import llama_cpp as L

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    L.llama_backend_init()
    model = L.llama_model_load_from_file(args.gguf.encode(), L.llama_model_default_params())
    for seqs in args.batches:
        cp = L.llama_context_default_params()
        cp.n_ctx = seqs * (args.context + args.steps + 8)
        cp.n_batch = cp.n_ubatch = max(512, seqs * args.context)
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch = seqs, args.threads, args.threads
        ctx = L.llama_init_from_model(model, cp)
        batch = L.llama_batch_init(seqs * args.context, 0, seqs)

        def fill(batch: Any, tokens: list[tuple[int, int, int, bool]]) -> None:
            batch.n_tokens = len(tokens)
            for i, (token, pos, seq, logits) in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits

        prompt = [
            (1000 + (s * 7 + p) % 30000, p, s, p == args.context - 1) for s in range(seqs) for p in range(args.context)
        ]
        fill(batch, prompt)
        if L.llama_decode(ctx, batch):
            raise RuntimeError("llama_decode failed on the prompts")
        times = []
        for step in range(args.steps):
            fill(batch, [(2000 + s + step, args.context + step, s, True) for s in range(seqs)])
            start = time.perf_counter()
            if L.llama_decode(ctx, batch):
                raise RuntimeError(f"llama_decode failed at step {step}")
            times.append(time.perf_counter() - start)
        warm = times[4:]
        print(
            f"llama.cpp decode b={seqs}: {statistics.median(warm) * 1e3:.2f} ms "
            f"(median of {len(warm)}, {args.threads} threads)"
        )
        L.llama_batch_free(batch)
        L.llama_free(ctx)


if __name__ == "__main__":
    main()
