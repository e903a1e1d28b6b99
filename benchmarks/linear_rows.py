"""The integer products' speed by rows, on the built-in model's shapes, and against another build of them.

    python -m pdserve.benchmarks.linear_rows [--rows 1 4 8 16 32] [--rounds 25]
    python -m pdserve.benchmarks.linear_rows --against ../old-worktree/kernels      # the same points, both builds

Times `cpu_linear.c`'s products with int8 activations (the Q4_1 projections of one decoder layer and the Q8_0
output layer, random weights of the built-in model's shapes, 2 threads) at each row count: microseconds, GMAC/s,
and the share of this machine's int8 GEMM rate (`roofline.int8_rate`) measured in the same run. The weights fit
the caches, so this is the arithmetic, not the memory.

`--against DIR` builds `DIR/cpu_linear.c` (another checkout's kernels) and times every point alternately on both
builds, `--rounds` times, after checking that they give the same results bit for bit. On a shared 2-vCPU VM one
build timed in separate runs moved by 10-20% (the host's pace drifts), the interleaved ratio by a few percent:
compare builds this way, and over more than one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.benchmarks.roofline import int8_rate
from pdserve.kernels import c_build, cpu_isa, quant_linear

SHAPES = (
    ("q4_1", 3072, 576, "gate/up"),
    ("q4_1", 576, 1536, "down"),
    ("q4_1", 576, 576, "o"),
    ("q8_0", 49152, 576, "lm_head"),
)


def _build(source: Path, where: Path) -> quant_linear.CpuLinear:
    lib = c_build.build(source, where)
    if lib is None:
        raise SystemExit(f"{source} could not be built here (no C compiler?)")
    return quant_linear.CpuLinear(lib, cpu_isa.level())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=25, help="alternations per point (median of each build's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", type=Path, help="a kernels directory whose cpu_linear.c is timed beside this one's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds = [_build(quant_linear.SOURCE, Path(tmp) / "this")]
        if args.against is not None:
            builds.append(_build(args.against / "cpu_linear.c", Path(tmp) / "other"))
        peak = int8_rate(3) / 2  # multiply-adds a second
        print(f"{builds[0].q8_isa}; CPU level {cpu_isa.level()}; {args.threads} threads")
        print(f"CPU flags: {cpu_isa.isa_flags()}")
        print(f"int8 GEMM (torch._int_mm, 2048^3): {peak / 1e9:.0f} GMAC/s\n")
        head = "| weight | rows | us | GMAC/s | of int8 GEMM |"
        print(head + (" other build, us | other / this |" if len(builds) > 1 else ""))
        print("| --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if len(builds) > 1 else ""))
        gen = torch.Generator().manual_seed(0)
        for fmt, n, k, name in SHAPES:
            packed = quant_linear.pack_q8(quant_linear.quantize(torch.randn(n, k, generator=gen) * 0.05, fmt))
            packing = quant_linear.Q8_ACTIVATIONS[fmt]
            reps = max(1, int(2e8 / (n * k * 8)))  # ~a millisecond a timing at 8 rows
            for m in args.rows:
                x = torch.randn(m, k, generator=gen).bfloat16()
                outs = [b.linear(x, packed, packing, n, None) for b in builds]
                if not all(torch.equal(outs[0], o) for o in outs[1:]):
                    raise SystemExit(f"the builds differ at {name} {m} rows: compare only builds that agree")
                times: list[list[float]] = [[] for _ in builds]
                for _ in range(args.rounds):
                    for i, b in enumerate(builds):
                        start = time.perf_counter()
                        for _ in range(reps):
                            b.linear(x, packed, packing, n, None)
                        times[i].append((time.perf_counter() - start) / reps)
                us = [statistics.median(t) * 1e6 for t in times]
                rate = m * n * k / us[0] * 1e6
                line = f"| {name} {fmt} {n}x{k} | {m} | {us[0]:.1f} | {rate / 1e9:.0f} | {rate / peak:.2f} |"
                if len(builds) > 1:
                    line += f" {us[1]:.1f} | {us[1] / us[0]:.2f} |"
                print(line, flush=True)


if __name__ == "__main__":
    main()
