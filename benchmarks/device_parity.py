"""Greedy tokens of the pdserve engine (or a served stack) against transformers on the same device and dtype.

The device check's correctness half (`benchmarks/gpu_check.sh`): fp32 must match token for token; bf16 is
reported as the fraction of matching tokens (rounding differs between kernels). Prints one JSON object.

    python -m pdserve.benchmarks.device_parity --device cuda --dtype float32
    python -m pdserve.benchmarks.device_parity --device cuda --dtype float32 --served 127.0.0.1:50051 --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import torch


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length + 7 * i)] for i in range(n)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def engine_greedy(path: str, device: str, dtype: str, backend: str, batch: list[list[int]], n: int) -> list[list[int]]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.sampling_params import SamplingParams

    core = EngineCore(
        EngineConfig(
            model=path,
            dtype=dtype,
            device=device,
            attention_backend=backend,
            max_num_seqs=len(batch),
            kv_cache_memory=256 << 20,
        )
    )
    return core.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


async def served_greedy(address: str, batch: list[list[int]], n: int) -> list[list[int]]:
    from pdserve.client import Client

    async with Client(address) as client:
        done = await asyncio.gather(
            *(client.complete(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True) for p in batch)
        )
    return [list(d.token_ids) for d in done]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="auto", help="the engine's attention backend")
    ap.add_argument("--served", default=None, help="a gateway address: check the served stack instead")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from pdserve.engine.config import parse_dtype
    from pdserve.engine.model_store import resolve_model, transformers_dir

    model_dir = resolve_model(args.model)
    path = str(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(transformers_dir(model_dir)), dtype=parse_dtype(args.dtype))
    hf = hf.eval().to(args.device)
    batch = prompts(args.requests, args.prompt_len)
    want = [hf_greedy(hf, p, args.tokens) for p in batch]
    if args.served:
        got = asyncio.run(served_greedy(args.served, batch, args.tokens))
    else:
        got = engine_greedy(path, args.device, args.dtype, args.backend, batch, args.tokens)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    total = sum(len(w) for w in want)
    print(
        json.dumps(
            {
                "what": "served" if args.served else f"engine ({args.backend})",
                "device": args.device,
                "dtype": args.dtype,
                "requests": len(batch),
                "tokens": total,
                "matching": same,
                "match": same / total,
                "exact": got == want,
            }
        )
    )
    if args.dtype == "float32" and got != want:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
