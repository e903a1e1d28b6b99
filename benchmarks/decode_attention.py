"""The CPU decode attention kernel alone, against this machine's limits measured in the same run.

    python -m pdserve.benchmarks.decode_attention [--batch 8] [--context 192] [--dtype bfloat16] [--guesses 0]
    PDSERVE_CPU_ISA=avx2 python -m pdserve.benchmarks.decode_attention     # the AVX2 build on an AVX-512 machine

A decode step attends over every layer's cache once, and between two layers the weights stream through the
caches, so each layer's K and V come from memory. This times `cpu_paged_attention.c` the same way: one paged
cache per layer (the built-in model's shape by default), blocks in a shuffled order as a busy pool hands them out,
both in huge pages as the engine allocates them, and `--between-mb` of other data read between two layers
(default: one bf16 layer of the built-in model's weights). It prints microseconds per layer and two ratios: to
the K/V bytes at the streaming bandwidth, and to the flops at the fp32 GEMM rate (`benchmarks.roofline`'s probes).
`--in-cache` attends over one layer's cache again and again with nothing between: what the kernel's instructions
cost when the memory is not in the way. `--guesses g` gives each sequence 1 + g rows, as a step that checks g
speculative guesses has them (row j over the context and the first j guesses).
"""

from __future__ import annotations

from pdserve.kernels import cpu_isa

cpu_isa.apply_cap()  # before torch: the cap reaches torch's kernels too

import argparse  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402


@dataclass
class Result:
    us_per_layer: float
    kv_bytes: int  # K and V read per layer
    flops: float  # per layer: q.k and p.v, 2 flops a multiply-add
    bandwidth: float  # bytes/s, measured in the same run
    gemm: float  # flop/s, measured in the same run

    @property
    def bytes_ratio(self) -> float:
        return self.us_per_layer * 1e-6 / (self.kv_bytes / self.bandwidth)

    @property
    def flops_ratio(self) -> float:
        return self.us_per_layer * 1e-6 / (self.flops / self.gemm)


def measure(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    layers: int,
    block_size: int,
    dtype: torch.dtype,
    between_mb: float,
    in_cache: bool,
    reps: int,
    limits: tuple[float, float] | None = None,
    guesses: int = 0,
) -> Result:
    """`limits` (bytes/s, flop/s): given, instead of measured after the kernel."""
    from pdserve.benchmarks.roofline import bandwidth, gemm_rate
    from pdserve.engine.host_memory import zeros_in_huge_pages
    from pdserve.engine.model_store import cache_dir
    from pdserve.kernels import cpu_paged_attention

    kernel = cpu_paged_attention.load(cache_dir() / "kernels")
    if kernel is None:
        raise SystemExit("cpu_paged_attention.c could not be built here (no C compiler?)")
    gen = torch.Generator().manual_seed(0)
    rows = 1 + guesses
    per_seq = -(-(context + guesses) // block_size)
    shape = (batch * per_seq, block_size, kv_heads, head_dim)
    caches = []
    for _ in range(1 if in_cache else layers):
        k, v = zeros_in_huge_pages(shape, dtype), zeros_in_huge_pages(shape, dtype)
        k.copy_(torch.randn(shape, generator=gen)), v.copy_(torch.randn(shape, generator=gen))
        caches.append((k, v))
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).repeat_interleave(rows, 0)
    lens = (context + torch.arange(rows, dtype=torch.int32)).repeat(batch)
    q = torch.randn(batch * rows, heads, head_dim, generator=gen).to(dtype)
    other = None if in_cache or between_mb <= 0 else torch.ones(int(between_mb * 2**20) // 4)
    scale = head_dim**-0.5

    def one_pass() -> float:
        spent = 0.0
        for k, v in caches * (layers // len(caches)):
            if other is not None:
                other.sum()
            t = time.perf_counter()
            kernel.decode(q, k, v, tables, lens, context + guesses, scale)
            spent += time.perf_counter() - t
        return spent / layers

    one_pass()
    best = min(one_pass() for _ in range(reps))
    kv_bytes = 2 * batch * (context + guesses) * kv_heads * head_dim * dtype.itemsize
    flops = 2 * 2 * batch * heads * head_dim * int(lens[:rows].sum())
    bw, gemm = limits if limits is not None else (bandwidth(), gemm_rate())
    return Result(best * 1e6, kv_bytes, flops, bw, gemm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--heads", type=int, default=9, help="query heads (the built-in model's)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--between-mb", type=float, default=7.1, help="data read between two layers (MiB)")
    ap.add_argument("--in-cache", action="store_true", help="one layer's cache, attended over again and again")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--guesses", type=int, default=0, help="speculative guesses each sequence checks (1 + g rows)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r = measure(
        args.batch,
        args.context,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.layers,
        args.block_size,
        getattr(torch, args.dtype),
        args.between_mb,
        args.in_cache,
        args.reps,
        guesses=args.guesses,
    )
    where = "one layer's cache, in cache" if args.in_cache else f"{args.layers} layers, {args.between_mb} MiB between"
    print(
        f"CPU level {cpu_isa.level()}, {args.threads} threads, batch {args.batch} x {1 + args.guesses} rows, "
        f"context {args.context}, "
        f"{args.dtype}, {where}: {r.us_per_layer:.1f} us a layer\n"
        f"  K/V {r.kv_bytes / 1e6:.2f} MB a layer at {r.bandwidth / 1e9:.1f} GB/s: "
        f"{r.bytes_ratio:.2f}x the bytes limit; "
        f"{r.flops / 1e6:.1f} Mflop at {r.gemm / 1e9:.0f} GFLOP/s: {r.flops_ratio:.2f}x the flops limit"
    )


if __name__ == "__main__":
    main()
