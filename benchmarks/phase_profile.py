"""`pdserve profile`: time an engine's steps on this machine and model, fit the step cost, write a profile.

Steps are timed in-process on the engine the workers run (same flags: dtype, threads, weights, budget), from the
scheduled batch to the committed tokens, and named by what they computed (`planner.cost.StepShape`): prompts
alone by total tokens (one long prompt, chunked above the budget, and several short ones together), decode
batches by size and context, and decode batches with a prompt chunk mixed in (a colocated step). The KV transfer
is timed between two processes over the workers' transport, at two sizes, for its fixed cost and its rate.
Bounded: a few minutes on 2 cores for a 135M model.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.planner.cost import StepShape, fit, relative_errors
from pdserve.planner.profile import Profile


@dataclass(frozen=True)
class Grid:
    """What is measured: prompts by tokens, decode batches by size at each context, repeats of each."""

    prompts: tuple[int, ...] = (16, 64, 256, 1024, 2048)
    batches: tuple[int, ...] = (1, 4, 16, 32)
    contexts: tuple[int, ...] = (128, 1024)
    repeats: int = 3


FULL = Grid()
QUICK = Grid(prompts=(16, 64, 128, 256), batches=(1, 2, 4, 8), contexts=(128,), repeats=2)  # short prompts only


class _Progress:
    def __init__(self, total: int, out=sys.stderr) -> None:
        self.total, self.done, self.out = total, 0, out

    def tick(self, what: str) -> None:
        self.done += 1
        filled = round(30 * self.done / self.total)
        self.out.write(f"\rprofile [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {what:<28}")
        if self.done == self.total:
            self.out.write("\n")
        self.out.flush()


class _Timer:
    """Runs an engine step by step and records each step's shape and duration."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.rng = random.Random(0)
        self.shapes: list[StepShape] = []
        self.seconds: list[float] = []

    def prompt(self, n: int, max_tokens: int) -> Sequence:
        vocab = self.engine.model_config.vocab_size
        ids = [self.rng.randrange(10, vocab - 1) for _ in range(n)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = Sequence("profile", ids, params)
        self.engine.add(seq)
        return seq

    def step(self, record: bool = True) -> None:
        e = self.engine
        batch = e.schedule()
        chunks, contexts = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens + n < len(seq.token_ids) or n > 1 or seq.num_computed_tokens == 0:
                chunks.append((n, seq.num_computed_tokens))
            else:
                contexts.append(seq.num_computed_tokens + 1)
        start = time.perf_counter()
        e.update(batch, e.execute(batch))
        took = time.perf_counter() - start
        if record and batch.seqs:
            self.shapes.append(StepShape(tuple(chunks), tuple(contexts)))
            self.seconds.append(took)

    def drain(self, record: bool = True) -> None:
        while self.engine.has_work:
            self.step(record)


def _limit(engine: EngineCore) -> int:
    """The longest prompt or context measured: what the model and half the pool take."""
    return min(engine.max_model_len - 8, engine.pool_tokens // 2)


def _steps(engine: EngineCore, grid: Grid, tick: Callable[[str], None]) -> _Timer:
    t = _Timer(engine)
    budget = engine.scheduler.max_num_batched_tokens
    limit = _limit(engine)
    t.prompt(64, 2)
    t.drain(record=False)  # warm-up: first-touch of weights and buffers
    for n in grid.prompts:
        if n <= limit:
            for _ in range(grid.repeats):
                t.prompt(n, 1)
                t.drain()
        tick(f"prompt {n}")
    for _ in range(grid.repeats):  # several prompts in one step
        for _ in range(4):
            t.prompt(min(128, budget // 4), 1)
        t.drain()
    tick("4 prompts together")
    for context in grid.contexts:
        for batch in grid.batches:
            if context >= limit or batch > engine.scheduler.max_num_seqs or batch * (context + 8) > engine.pool_tokens:
                tick(f"decode b={batch} skipped")
                continue
            for _ in range(batch):
                t.prompt(context, 2 + grid.repeats)
            while any(s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.scheduler.running) or (
                engine.scheduler.waiting
            ):
                t.step(record=False)
            t.drain()
            tick(f"decode b={batch} ctx={context}")
    mixed = min(256, budget // 2, limit)
    for batch in (4, 16):
        if batch > engine.scheduler.max_num_seqs:
            tick(f"mixed b={batch} skipped")
            continue
        for _ in range(batch):
            t.prompt(128, 2 + 2 * grid.repeats)
        while engine.scheduler.waiting or any(
            s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.scheduler.running
        ):
            t.step(record=False)
        for _ in range(grid.repeats):
            t.prompt(mixed, 1)
            t.step()  # the decode batch with the prompt mixed in
            t.step()
        t.drain()
        tick(f"mixed b={batch}")
    return t


def _transfer(engine: EngineCore, transport: str, repeats: int, tick: Callable[[str], None]) -> tuple[float, float]:
    """(fixed seconds, bytes/s) of one request's KV transfer, fitted to a small and a large transfer (timed as
    `benchmarks.kv_transfer` times them, into a receiver in another process)."""
    import dataclasses

    from pdserve.benchmarks.kv_transfer import pdserve_seconds, receiver_process, stop_receiver
    from pdserve.kvtransfer.backends import make_transport, shutdown_transports
    from pdserve.kvtransfer.registered import ONE_SIDED, STAGED, open_plane
    from pdserve.kvtransfer.sender import KVSender

    layout = engine.layout
    small = 1
    large = max(small + 1, min(layout.num_blocks, 8192 // layout.block_size))
    registered = open_plane(engine.kv_cache, layout, transport, "auto", "prefill")  # what a prefill worker runs
    path = "tcp" if transport == "tcp" else ONE_SIDED if registered is not None else STAGED
    proc, pipe, addresses = receiver_process(dataclasses.asdict(layout.with_blocks(large)), (path,))

    async def run() -> dict[int, float]:
        sender = KVSender(engine.kv_cache, layout, make_transport(transport), registered=registered)
        out: dict[int, float] = {}
        try:
            for blocks in (small, large):
                seconds = await pdserve_seconds(sender, addresses[path], pipe, path, blocks, repeats)
                out[blocks] = statistics.median(seconds)
                tick(f"KV transfer {blocks} blocks")
        finally:
            await sender.close()
        return out

    try:
        measured = asyncio.run(run())
    finally:
        stop_receiver(proc, pipe)
        shutdown_transports()
    per_block = max(measured[large] - measured[small], 1e-9) / (large - small)
    rate = layout.block_nbytes / per_block
    fixed = max(0.0, measured[small] - layout.block_nbytes / rate)
    return fixed, rate


def profile(cfg: EngineConfig, transport: str = "tcp", machine: str = "", grid: Grid = FULL) -> Profile:
    engine = EngineCore(cfg)
    progress = _Progress(len(grid.prompts) + 1 + len(grid.contexts) * len(grid.batches) + 2 + 2)
    timer = _steps(engine, grid, progress.tick)
    cost = fit(timer.shapes, timer.seconds)
    errors = relative_errors(cost, timer.shapes, timer.seconds)
    fixed, rate = _transfer(engine, transport, grid.repeats, progress.tick)
    layout = engine.layout
    return Profile(
        model=engine.model_config.name,
        step=cost,
        kv_bytes_per_token=layout.block_nbytes // layout.block_size,
        kv_capacity_tokens=engine.pool_tokens,
        num_layers=layout.num_layers,
        transfer_latency_s=fixed,
        transfer_bytes_per_s=rate,
        max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
        max_num_seqs=engine.scheduler.max_num_seqs,
        device=str(cfg.device),
        dtype=layout.dtype,
        threads=cfg.num_threads or 0,
        machine=machine,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        steps=[
            {"chunks": [list(c) for c in s.chunks], "contexts": list(s.contexts), "seconds": round(t, 6)}
            for s, t in zip(timer.shapes, timer.seconds)
        ],
        fit_error={"median": statistics.median(errors), "p90": sorted(errors)[int(0.9 * (len(errors) - 1))]},
    )


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                keep = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "avx512_vnni")
                return " ".join(f for f in line.split(":", 1)[1].split() if f in keep)
    except OSError:
        pass
    return ""
