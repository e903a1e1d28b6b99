"""The requests a plan is for: arrivals at a rate (Poisson or bursty) with prompt and output lengths, or a trace.

Traces are JSON lines. Mooncake's (`timestamp` in ms, `input_length`, `output_length`) and the plain form
`vllm bench`-style tools write (`arrival` or `timestamp` in seconds, `prompt_len`/`input_len`,
`output_len`/`output_tokens`) are both read; arrival times are shifted to start at 0.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds from the start
    prompt: int  # tokens
    output: int  # tokens to generate (>= 1)


def lengths(spec: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64-512' -> a uniform range."""
    lo, _, hi = spec.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise ValueError(f"length {spec!r}: give N or LO-HI with 0 < LO <= HI")
    return a, b


def synthetic(
    rate: float,
    num_requests: int,
    prompt: tuple[int, int],
    output: tuple[int, int],
    arrival: str = "poisson",
    burstiness: float = 4.0,
    seed: int = 0,
) -> list[Request]:
    """`num_requests` arrivals at `rate`/s: Poisson, or bursty (gamma gaps whose variance is `burstiness` times
    Poisson's: the same mean rate in clumps)."""
    if rate <= 0 or num_requests <= 0:
        raise ValueError("rate and num_requests must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(Request(t, rng.randint(*prompt), rng.randint(*output)))
        if arrival == "poisson":
            t += rng.expovariate(rate)
        elif arrival == "bursty":
            shape = 1.0 / burstiness
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
        else:
            raise ValueError(f"arrival {arrival!r}: poisson or bursty")
    return out


def from_trace(path: Path, limit: int | None = None) -> list[Request]:
    rows: list[tuple[float, int, int]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if "timestamp" in d and "input_length" in d:  # Mooncake: milliseconds
                at = float(d["timestamp"]) / 1000.0
            else:
                at = float(d.get("arrival", d.get("timestamp", 0.0)))
            prompt = d.get("input_length", d.get("prompt_len", d.get("input_len")))
            output = d.get("output_length", d.get("output_len", d.get("output_tokens")))
            if prompt is None or output is None:
                raise ValueError(f"{path}:{n}: a trace line needs a prompt length and an output length")
            rows.append((at, max(1, int(prompt)), max(1, int(output))))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort()
    start = rows[0][0]
    return [Request(at - start, p, o) for at, p, o in rows]


def scaled(requests: list[Request], factor: float) -> list[Request]:
    """The same requests arriving `factor` times as fast."""
    return [Request(r.arrival / factor, r.prompt, r.output) for r in requests]
