"""What speculation buys: served latency and throughput with it and without, on prompts whose answer copies from them
and on prompts with nothing to copy; by prompt lookup alone, or with a draft model (`--draft gguf`).

    python -m pdserve.benchmarks.speculation [--model PATH] [--k 8] [--rounds 3] [--dtype auto] [--draft none]

One `pdserve up --colocated` (speculation off by default; `--draft` is its `--speculative-draft`); each request turns
it on or off with its own `speculative_tokens`, and the two sides' rounds are interleaved so that a busy spell of the
machine falls on both.

- c=1: time per output token (TPOT: from the first token to the last, over the tokens after the first) p50 over
  every request, greedy and drawn (seeded); and whether each answer is the same token for token with and without
  (every prompt is served once first, so both sides find it in the prefix cache alike).
- c=8: output tokens per second with 8 requests in flight (a closed loop over 24 requests, the set's prompts in
  turn), median over blocks: over the whole block, and while all 8 clients still had requests to send (the
  block's wind-down left out: `_c8`). (Rounds of 8 that start together measure the slowest of the 8 instead.)
- The decode worker's counters: guesses proposed and kept.
- The c=8 ceiling, this machine's own limit measured in the same run: the engine's decode step timed at 8, 16, ...
  rows (8 sequences at the copy-heavy context, each checking 0, 1, ... guesses, every guess kept) gives the most
  tokens per second any acceptance could reach, as a ratio to 8 rows without guesses. Past the rows a step reads
  its weights for, each row costs its own arithmetic, and the ceiling says what is left to win.

Copy-heavy prompts edit, fix or reformat a text or code they carry (this package's own source and docstrings, so
nothing is downloaded); the others ask for new text.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def copy_prompts() -> list[str]:
    from pdserve.engine import engine_loop, scheduler, speculation

    code = inspect.getsource(speculation.NgramIndex)
    prose = (scheduler.__doc__ or "").strip()
    loop_doc = (engine_loop.__doc__ or "").strip()
    return [
        f"Rename the variable `tokens` to `ids` in this Python code and return the whole code:\n\n{code}",
        f"Fix any spelling mistakes in this text and return the whole corrected text:\n\n{prose}",
        f"Rewrite this text with each sentence on its own line, changing nothing else:\n\n{loop_doc}",
        f"Add a comment line above every method of this class and return the whole code:\n\n{code}",
    ]


NO_COPY = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle's gears work, for a ten-year-old.",
    "Give me ten ideas for a rainy-day activity with friends, with a sentence on each.",
    "Describe the water cycle in a few paragraphs.",
]
OUTPUT = 160
CLOSED_LOOP_REQUESTS = 24  # per c=8 block: the last few requests run in a smaller batch


async def _one(
    client, prompt: str, k: int, temperature: float, seed: int, on_tokens: Callable[[int], None] | None = None
) -> tuple[list[int], float, float]:
    """(tokens, time to the first, time from the first to the last); `on_tokens` hears of each batch as it comes."""
    start = time.perf_counter()
    first = last = 0.0
    tokens: list[int] = []
    async for resp in client.stream(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=OUTPUT,
        temperature=temperature,
        seed=seed,
        speculative_tokens=k,
    ):
        if not resp.token_ids:
            continue
        now = time.perf_counter() - start
        if not tokens:
            first = now
        last = now
        tokens.extend(resp.token_ids)
        if on_tokens is not None:
            on_tokens(len(resp.token_ids))
    return tokens, first, last - first


def _tpot(tokens: list[int], gap: float) -> float | None:
    return gap / (len(tokens) - 1) if len(tokens) > 1 else None


async def _c1(address: str, prompts: list[str], k: int, rounds: int, temperature: float) -> dict:
    """Each prompt `rounds` times, off and on in turn: TPOTs of each side and whether the answers matched."""
    from pdserve.client import Client

    tpot: dict[int, list[float]] = {0: [], k: []}
    same, answers = 0, 0
    async with Client(address) as client:
        for prompt in prompts:  # warm, and every prompt in the prefix cache: both sides compute the same tail
            await _one(client, prompt, 0, temperature, 0)
        for r in range(rounds):
            for i, prompt in enumerate(prompts):
                got = {}
                for side in (0, k) if (r + i) % 2 == 0 else (k, 0):
                    tokens, _, gap = await _one(client, prompt, side, temperature, 100 * r + i)
                    got[side] = tokens
                    if (t := _tpot(tokens, gap)) is not None:
                        tpot[side].append(t)
                answers += 1
                same += got[0] == got[k]
    return {"tpot": tpot, "same": same, "answers": answers}


@dataclass
class _Block:
    """One closed-loop block's output: all of it, and what had come when the first client ran out of requests."""

    start: float
    produced: int = 0
    in_flight: tuple[int, float] | None = None  # (tokens, seconds) while all 8 clients had a request in flight

    def add(self, n: int) -> None:
        self.produced += n

    def client_done(self) -> None:
        if self.in_flight is None:
            self.in_flight = (self.produced, time.perf_counter() - self.start)


async def _c8(address: str, prompts: list[str], k: int, rounds: int) -> dict[str, dict[int, list[float]]]:
    """Output tokens per second at concurrency 8 (each client sends its next request when one ends, as `pdserve
    bench --max-concurrency 8` and vLLM's benchmark do), 24 requests a block, off and on in turn: over the whole
    block ("block"), and up to the moment the first client finds no request left ("8 in flight"). A block's last
    requests end one by one, with fewer in flight. Without speculation all 8 advance one token a step, so answers
    of the same length end together; with it each goes at its own pace, and the whole-block rate charges it for a
    wind-down that a server under a steady load does not have."""
    from pdserve.client import Client

    rates: dict[str, dict[int, list[float]]] = {"block": {0: [], k: []}, "8 in flight": {0: [], k: []}}
    async with Client(address) as client:
        for r in range(rounds):
            for side in (0, k) if r % 2 == 0 else (k, 0):
                todo = list(range(CLOSED_LOOP_REQUESTS))
                block = _Block(time.perf_counter())

                async def client_loop(side: int = side, todo: list[int] = todo, block: _Block = block) -> None:
                    while todo:
                        i = todo.pop()
                        await _one(client, prompts[i % len(prompts)], side, 0.0, i, block.add)
                    block.client_done()

                await asyncio.gather(*(client_loop() for _ in range(8)))
                rates["block"][side].append(block.produced / (time.perf_counter() - block.start))
                assert block.in_flight is not None
                rates["8 in flight"][side].append(block.in_flight[0] / block.in_flight[1])
    return rates


def _counters(metrics_port: int) -> tuple[float, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return (
        values.get("pdserve_decode_speculative_proposed_tokens_total", 0.0),
        values.get("pdserve_decode_speculative_accepted_tokens_total", 0.0),
    )


def guess_steps(core, guesses: int, context: int, steps: int, rng) -> list[float]:
    """Seconds of each of `steps` decode steps of 8 sequences of `context` random tokens, each checking `guesses`
    guessed tokens (random ones: a step's forward is the same whatever it keeps), so that a sequence's rows sit
    together as in a served step."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.speculation import Speculation

    greedy = SamplingParams(max_tokens=min(4096, core.max_model_len - context), temperature=0.0, ignore_eos=True)
    vocab = min(core.model_config.vocab_size, 40000)
    seqs = [core.add_request([rng.randrange(vocab // 2, vocab) for _ in range(context)], greedy) for _ in range(8)]
    while any(s.num_output_tokens == 0 for s in seqs):
        core.step()

    def propose() -> None:  # in place of the engine's own choice of guesses: every sequence checks `guesses`
        for s in seqs:
            s.speculation = s.speculation or Speculation(guesses)
            s.speculation.draft = [rng.randrange(vocab // 2, vocab) for _ in range(guesses)]

    core._propose = propose  # an attribute of this engine, over its method until the `finally`
    try:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
    finally:
        del core._propose
        for s in seqs:
            core.abort(s)
    return times


def ceiling(model: str, dtype: str, quantization: str, k: int, context: int = 400, steps: int = 6) -> list[str]:
    """The most speculation can give at c=8 here: 8 sequences, each checking g guesses that are all kept, make
    8 (1 + g) tokens a step of 8 (1 + g) rows, timed as such (guess_steps)."""
    import random

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.model_store import resolve_model

    path = str(resolve_model(model))
    dtype = "bfloat16" if dtype == "auto" else dtype  # what `pdserve up` picks wherever its C kernels run
    guesses = [g for g in (0, 1, 2, 3, 4, 6, 8, 12, 16) if g <= k]
    core = EngineCore(
        EngineConfig(
            model=path,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=8,
            kv_cache_memory=3 << 30,
            max_num_batched_tokens=8192,
        )
    )
    rng = random.Random(0)
    step_ms = {g: min(guess_steps(core, g, context, steps, rng)) * 1e3 for g in guesses}
    base = 8 / step_ms[0]
    gains = {g: 8 * (1 + g) / step_ms[g] / base for g in guesses}
    best = max(gains, key=lambda g: gains[g])
    table = ", ".join(f"{8 * (1 + g)} rows {step_ms[g]:.1f} ms" for g in guesses)
    return [
        f"c=8 ceiling ({dtype}, {quantization}, context {context}): decode step {table}",
        f"c=8 ceiling: at most {gains[best]:.2f}x tokens/s, with {best} guesses a sequence all kept "
        f"(1 guess each: {gains[guesses[1]] if len(guesses) > 1 else 1.0:.2f}x)",
    ]


def served(
    model: str, dtype: str, k: int, rounds: int, c1: bool = True, quantization: str = "none", draft: str = "none"
) -> list[str]:
    from pdserve.benchmarks.compare import free_port, pdserve_up

    lines = []
    metrics = free_port()  # the gateway's; the colocated worker's is the next
    log = Path(tempfile.mkdtemp()) / "up.log"
    sets = {"copy-heavy": copy_prompts(), "nothing to copy": NO_COPY}
    extra = ("--speculative-draft", draft)
    with pdserve_up(log, dtype, quantization, colocated=True, model=model, metrics_port=metrics, extra=extra) as (
        address,
        _,
    ):
        for name, prompts in sets.items():
            for temperature in (0.0, 0.8) if c1 else ():
                one = asyncio.run(_c1(address, prompts, k, rounds, temperature))
                off, on = statistics.median(one["tpot"][0]) * 1e3, statistics.median(one["tpot"][k]) * 1e3
                same = f"; same answers {one['same']}/{one['answers']}"
                lines.append(
                    f"{name}, temperature {temperature}, c=1: TPOT p50 off {off:.2f} ms, on (k={k}) {on:.2f} ms "
                    f"({off / on:.2f}x faster){same}"
                )
            c8 = asyncio.run(_c8(address, prompts, k, max(2, rounds)))
            for window, rates in c8.items():
                off8, on8 = statistics.median(rates[0]), statistics.median(rates[k])
                lines.append(
                    f"{name}, greedy, c=8 ({window}): off {off8:.1f} tokens/s, on {on8:.1f} tokens/s "
                    f"({on8 / off8:.2f}x)"
                )
        proposed, accepted = _counters(metrics + 1)
        lines.append(f"decode worker: {proposed:.0f} guesses proposed, {accepted:.0f} kept")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="a model directory or .gguf (default: the built-in model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=8, help="speculative_tokens of the requests that speculate")
    ap.add_argument("--rounds", type=int, default=3, help="passes over each prompt set per point")
    ap.add_argument("--quantization", default="none", help="the worker's --quantization (gguf: the file's blocks)")
    ap.add_argument("--c8-only", action="store_true", help="skip the c=1 points")
    ap.add_argument("--ceiling-only", action="store_true", help="only the c=8 ceiling (no server)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the c=8 ceiling")
    ap.add_argument("--draft", default="none", help="the worker's --speculative-draft (gguf: the file's own blocks)")
    args = ap.parse_args()
    from pdserve.kernels.cpu_isa import isa_flags

    print(f"CPU flags: {isa_flags()}")
    if not args.ceiling_only:
        c1 = not args.c8_only
        for line in served(args.model, args.dtype, args.k, args.rounds, c1, args.quantization, args.draft):
            print(line, flush=True)
    for line in [] if args.no_ceiling else ceiling(args.model, args.dtype, args.quantization, args.k):
        print(line, flush=True)


if __name__ == "__main__":
    main()
