"""The engine against this machine's own limits: streaming-read bandwidth and GEMM rate, measured in the same run.

    python -m pdserve.benchmarks.roofline [--formats fp32 bf16 q8_0 q4_0 gguf] [--threads 2] [--json out.json]
    PDSERVE_CPU_ISA=avx2 python -m pdserve.benchmarks.roofline      # the AVX2 paths on an AVX-512 machine
    python -m pdserve.benchmarks.roofline --formats fp32 bf16 gguf --served bf16 gguf   # and served
    python -m pdserve.benchmarks.roofline --model random:llama-3.2-1b --formats gguf --served gguf  # a 1B shape

For each weight format it times the engine's decode step (batch 1 / 8 / 32, context 192: schedule, forward,
sample) and a prompt's prefill (128 and 1024 tokens, one step each), and divides each by its limit: the bytes
the step must read (weights once, plus the KV cache it attends over) at the measured bandwidth, or its flops at
the measured GEMM rates, whichever is larger (each limit the best of the measurements taken before and after every
format). A ratio of 1.0 is the machine's limit; 2.0 takes twice that. The linears of the formats that multiply
int8 activations (q8_0, q4_0, gguf) count at the int8 GEMM rate, everything else at the fp32 one: an integer
product is not held to fp32's rate (on a Zen 5 the int8 rate is ~9x fp32's, and the fp32 limit called the gguf
step at batch 1 flops-bound, 1.5x, when its bytes put it at 1.7x).

On a shared machine both limits move from minute to minute with the neighbours (one 2-core VM read 41 to 78 GB/s
within an hour), and the best of the run is a limit the step may never have had. So each row is also divided by
the limits measured just before and just after it (the better of the two): the `beside` ratio, what the code
reached against what the machine gave it at the time. Both are printed; the first is the stricter.

`--served` then starts `pdserve up --colocated` with each format it names (all, naming none) and streams 128-token
random prompts with 128 greedy tokens out through the gateway's gRPC API at concurrency 1, 8 and 32: ITL p50 at c=1
and c=8 against the decode step's limit at that batch, and at c=32 the time per output token (1 / throughput)
against what the machine needs per output token, its share of a decode step's limit at batch 32 plus its share of
its prompt's prefill flops. Everything the server does counts (gRPC, the gateway, the load generator sharing the
cores).
"""

from __future__ import annotations

from pdserve.kernels import cpu_isa

cpu_isa.apply_cap()  # before torch: the cap reaches torch's kernels too

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from pdserve.benchmarks import random_gguf  # noqa: E402

FORMATS = {  # name: (dtype, --quantization, --activations)
    "fp32": ("float32", "none", "exact"),
    "bf16": ("bfloat16", "none", "exact"),
    "q8_0": ("bfloat16", "q8_0", "q8"),
    "q4_0": ("bfloat16", "q4_0", "q8"),
    "gguf": ("bfloat16", "gguf", "q8"),  # the file's blocks against int8 activations (the default for them)
    "gguf-exact": ("bfloat16", "gguf", "exact"),  # the file's blocks against bf16 activations
    "gguf-fp32": ("float32", "gguf", "exact"),  # the file's blocks, fp32 activations and KV cache
}
INTEGER = [name for name, (_, _, activations) in FORMATS.items() if activations == "q8"]
CONTEXT = 192
SERVED = ((1, 16), (8, 32), (32, 64))  # (concurrency, requests)
PROMPT, OUTPUT = 128, 128  # served request shape; CONTEXT is where a decode step of one sits on average


@dataclass
class Row:
    format: str
    what: str
    ms: float
    bytes: float  # what it must read
    flops: float  # what it must compute
    beside: Limits | None = None  # measured around this row: Beside
    int_flops: float = 0.0  # the part of `flops` computed as int8 products
    limit_ms: float = 0.0  # bind() sets these two
    bound: str = ""  # "bytes" or "flops": which limit binds

    def bind(self, limits: Limits) -> None:
        self.limit_ms, self.bound = limits.limit(self.bytes, self.flops, self.int_flops)

    @property
    def ratio(self) -> float:
        return self.ms / self.limit_ms

    @property
    def ratio_beside(self) -> float:
        """Against the limits measured around this row (0 when none were)."""
        return self.ms / self.beside.limit(self.bytes, self.flops, self.int_flops)[0] if self.beside else 0.0


@dataclass(frozen=True)
class Limits:
    """This machine's limits: streaming-read bytes/s, fp32 and int8 GEMM flop/s (a multiply-add is 2 flops)."""

    bw: float
    gemm: float
    int8: float

    def limit(self, nbytes: float, flops: float, int_flops: float = 0.0) -> tuple[float, str]:
        """(ms, what binds): the bytes at `bw`, or `int_flops` at the int8 rate and the rest at fp32's."""
        by_bytes = nbytes / self.bw * 1e3
        by_flops = ((flops - int_flops) / self.gemm + int_flops / self.int8) * 1e3
        return max(by_bytes, by_flops), "bytes" if by_bytes >= by_flops else "flops"

    def best(self, other: Limits) -> Limits:
        return Limits(max(self.bw, other.bw), max(self.gemm, other.gemm), max(self.int8, other.int8))


@dataclass(frozen=True)
class Sizes:
    """What a step must read and compute, from the loaded model."""

    weights: int  # bytes of weights a decode step reads
    params: int  # multiply-adds per token in the linear layers
    kv_token: int  # KV-cache bytes per token of context
    attn: int  # num_layers * num_heads * head_dim: attention's multiply-adds per (query, key) pair / 2

    def decode(self, batch: int, context: int) -> tuple[float, float]:
        """Bytes and flops of a decode step of `batch` sequences at `context` tokens."""
        return self.weights + batch * context * self.kv_token, 2 * batch * self.params

    def linear_flops(self, tokens: float) -> float:
        return 2 * tokens * self.params

    def prefill_flops(self, n: int) -> float:
        return 2 * n * self.params + 2 * 2 * self.attn * n * n / 2


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bandwidth(reps: int = 5) -> float:
    """Bytes per second a sum over 1 GiB reads (best of `reps`): what a decode step's weight reads can reach. The
    GiB lies in huge pages where the kernel gives them, as the engine's weights and KV cache do (engine.host_memory);
    in 4 KiB pages the same sum read 26.5 GB/s on a Sapphire Rapids VM where huge pages gave 30."""
    from pdserve.engine.host_memory import zeros_in_huge_pages

    big = zeros_in_huge_pages((256 << 20,), torch.float32).fill_(1.0)
    return big.numel() * 4 / _best(big.sum, reps)


def gemm_rate(reps: int = 5) -> float:
    """fp32 flops per second of torch's GEMM at 2048^3 (best of `reps`)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / _best(lambda: a @ b, reps)


def int8_rate(reps: int = 5) -> float:
    """Flops (2 a multiply-add) per second of torch's int8 GEMM (int32 sums) at 2048^3, best of `reps`; 0 where torch
    has none on this CPU. Zen 5, 2 cores: 1.8-2.0 TOP/s, 86-94% of a loop of vpdpbusd timed beside it (2 a cycle
    at 4.1 GHz)."""
    a = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    b = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    try:
        return 2 * 2048**3 / _best(lambda: torch._int_mm(a, b), reps)
    except RuntimeError:
        return 0.0


def limits(reps: int = 5) -> Limits:
    """The int8 rate is never taken below fp32's: a CPU whose torch multiplies int8 slowly keeps the fp32 limit."""
    gemm = gemm_rate(reps)
    return Limits(bandwidth(reps), gemm, max(gemm, int8_rate(reps)))


class Beside:
    """The limits just before and just after a measurement, the better of each: `with Beside() as near: ...`,
    then `near.limits`."""

    def __enter__(self) -> Beside:
        self.limits = limits(2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.limits = self.limits.best(limits(2))


def _engine(fmt: str, batch: int, model: str | None):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.model_store import resolve_model

    dtype, quantization, activations = FORMATS[fmt]
    return EngineCore(
        EngineConfig(
            model=str(resolve_model(model)),
            dtype=dtype,
            quantization=quantization,
            activations=activations,
            max_num_seqs=batch,
            kv_cache_memory=1 << 30,
            max_num_batched_tokens=2048,
        )
    )


def decode_steps(
    core, batch: int, context: int, steps: int, rng: random.Random, beside: Beside | None = None
) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences of `context` random tokens (prefilled first,
    aborted after), timed inside `beside` where given."""
    from pdserve.engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    seqs = [core.add_request([rng.randrange(100, 40000) for _ in range(context)], greedy) for _ in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        core.step()
    times = []
    with beside or contextlib.nullcontext():
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
    for s in seqs:
        core.abort(s)
    return times


def measure(fmt: str, steps: int, model: str | None = None) -> tuple[list[Row], Sizes]:
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.weight_format import decode_linears, weight_bytes

    core = _engine(fmt, 32, model)
    cfg = core.runner.config
    sizes = Sizes(
        weights=weight_bytes(core.runner.model),
        params=sum(m.in_features * m.out_features for m in decode_linears(core.runner.model)),
        kv_token=cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * core.layout.element_size,
        attn=cfg.num_layers * cfg.num_heads * cfg.head_dim,
    )
    integer = fmt in INTEGER
    rng = random.Random(0)
    rows: list[Row] = []
    for batch in (1, 8, 32):
        near = Beside()
        ms = statistics.median(decode_steps(core, batch, CONTEXT, steps, rng, near)) * 1e3
        read, flops = sizes.decode(batch, CONTEXT + steps)
        rows.append(Row(fmt, f"decode b={batch}", ms, read, flops, near.limits, flops if integer else 0.0))
    for n in (128, 1024):

        def prefill(n: int = n) -> None:
            """A prompt of fresh random tokens (nothing in the prefix cache), prefilled in one step."""
            seq = core.add_request([rng.randrange(100, 40000) for _ in range(n)], SamplingParams(max_tokens=1))
            while not seq.is_finished:
                core.step()

        with Beside() as near:
            ms = _best(prefill, 3) * 1e3
        int_flops = sizes.linear_flops(n) if integer else 0.0
        rows.append(Row(fmt, f"prefill {n}", ms, 0, sizes.prefill_flops(n), near.limits, int_flops))
    return rows, sizes


def served(fmt: str, sizes: Sizes, log: Path, model: str | None = None) -> list[Row]:
    """The format served by `pdserve up --colocated` at each concurrency of SERVED (see the module's docstring)."""
    from pdserve.benchmarks.bench_stats import compute_metrics
    from pdserve.benchmarks.compare import load_target, pdserve_up
    from pdserve.benchmarks.load_gen import GrpcTarget, make_requests

    dtype, quantization, activations = FORMATS[fmt]
    integer = fmt in INTEGER
    rows: list[Row] = []
    up = pdserve_up(log, dtype, quantization, colocated=True, activations=activations, model=model or "default")
    with up as (address, _):
        for concurrency, n in SERVED:
            reqs = make_requests(n, [PROMPT], OUTPUT, concurrency, None, vocab=(1000, 40000))
            warm = make_requests(2, [PROMPT], 8, 1000 + concurrency, None, vocab=(1000, 40000))
            with Beside() as near:
                results, duration, peak = asyncio.run(load_target(lambda: GrpcTarget(address), reqs, concurrency, warm))
            m = compute_metrics(results, duration, [50], None, peak)
            if m.failed:
                raise RuntimeError(f"{m.failed} of {n} requests failed serving {fmt} (see {log})")
            read, flops = sizes.decode(concurrency, CONTEXT)
            if concurrency != SERVED[-1][0]:
                int_flops = flops if integer else 0.0
                itl = m.itl_ms.median
                rows.append(Row(fmt, f"served c={concurrency} ITL p50", itl, read, flops, near.limits, int_flops))
            else:  # the top concurrency: a token's share of a full decode step and of its prompt's prefill
                flops = flops / concurrency + sizes.prefill_flops(PROMPT) / OUTPUT
                int_flops = sizes.linear_flops(1 + PROMPT / OUTPUT) if integer else 0.0
                ms = 1e3 / m.output_throughput
                row = Row(
                    fmt, f"served c={concurrency} ms/token", ms, read / concurrency, flops, near.limits, int_flops
                )
                rows.append(row)
    return rows


def _model(arg: str | None) -> str | None:
    """The model to run: `random:SHAPE` becomes that random GGUF in the cache (written the first time)."""
    if arg is None or not arg.startswith("random:"):
        return arg
    from pdserve.engine.model_store import cache_dir

    shape = arg.removeprefix("random:")
    if shape not in random_gguf.SHAPES:
        raise SystemExit(f"--model {arg}: no shape {shape!r} (there are {', '.join(random_gguf.SHAPES)})")
    path = cache_dir() / "random" / f"{shape}-random.Q4_0.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        random_gguf.write(random_gguf.SHAPES[shape], path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS)[:5], choices=list(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per batch size (median)")
    ap.add_argument("--json", help="write the rows and the limits here")
    ap.add_argument(
        "--served", nargs="*", choices=list(FORMATS), help="also serve these formats (none named: all) at c=1, 8, 32"
    )
    ap.add_argument("--log-dir", type=Path, default=Path("."), help="where --served writes the server's logs")
    ap.add_argument(
        "--model",
        help="a model directory or .gguf file (default: the built-in one), or random:SHAPE for a random-weight Q4_0 "
        f"GGUF of that shape ({', '.join(random_gguf.SHAPES)}), written once to the cache",
    )
    args = ap.parse_args()
    model = _model(args.model)
    if args.served is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    flags = cpu_isa.isa_flags()
    # the limits before and after each format, the best of them kept: neighbours on a shared machine lower both
    # the limits and the steps, and a limit taken in a slow minute would flatter every step timed in a fast one
    best = limits()
    rows: list[Row] = []
    for fmt in args.formats:
        measured, sizes = measure(fmt, args.steps, model)
        if args.served is not None and (not args.served or fmt in args.served):
            measured += served(fmt, sizes, args.log_dir / f"roofline-served-{fmt}.log", model)
        rows += measured
        best = best.best(limits())
    print(f"model {model or 'default'}; CPU level {cpu_isa.level()} (flags: {flags}), {args.threads} threads")
    print(
        f"limits (best in the run): streaming read {best.bw / 1e9:.1f} GB/s, fp32 GEMM {best.gemm / 1e9:.0f} "
        f"GFLOP/s, int8 GEMM {best.int8 / 1e9:.0f} GOP/s (the linears of {', '.join(INTEGER)})\n"
    )
    print("| format | step | ms | limit ms | bound by | ratio | beside: GB/s | ratio |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        row.bind(best)
        print(
            f"| {row.format} | {row.what} | {row.ms:.1f} | {row.limit_ms:.1f} | {row.bound} | {row.ratio:.2f} "
            f"| {row.beside.bw / 1e9 if row.beside else 0.0:.1f} | {row.ratio_beside:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": model or "default",
                    "level": cpu_isa.level(),
                    "flags": flags.split(),
                    "bandwidth_gbs": best.bw / 1e9,
                    "gemm_gflops": best.gemm / 1e9,
                    "int8_gops": best.int8 / 1e9,
                    "rows": [{**asdict(r), "ratio": r.ratio, "ratio_beside": r.ratio_beside} for r in rows],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
