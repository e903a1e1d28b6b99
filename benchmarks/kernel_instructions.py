"""Instructions per weight byte of `cpu_linear.c`'s products, counted, not timed.

A cap (`PDSERVE_CPU_ISA=avx2`) runs the AVX2 paths on a bigger core but says nothing of their speed on a real AVX2
one; the instructions a path executes per weight byte hold on every core. This builds the kernels at an ISA level
(`-march` as `kernels.c_build` would), runs one decoder layer's projections of the built-in model's shape through
each packing at 1 and 8 rows under valgrind (callgrind), and prints instructions per weight byte: 1 and 3 repeats,
so the difference is the products alone, without set-up.

    python -m pdserve.benchmarks.kernel_instructions [--level avx2] [--rows 1 8]     # needs valgrind and cc
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.kernels import c_build, cpu_isa

HARNESS = Path(__file__).with_name("kernel_instructions.c")
SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "cpu_linear.c"
PACKINGS = {"bf16": 1, "q8_0": 2, "q4_0": 3, "q4_1": 4, "q8_0_q8": 6, "q4_0_q8": 7, "q4_1_q8": 8}


def count(binary: Path, code: int, rows: int, reps: int) -> tuple[int, int]:
    """(instructions, weight bytes) of one run."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            str(binary),
            str(code),
            str(rows),
            str(reps),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : ([\d,]+)", run.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from valgrind:\n{run.stderr}")
    return int(found.group(1).replace(",", "")), int(run.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", default="avx2", choices=list(cpu_isa.MARCH))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--packings", nargs="+", default=list(PACKINGS), choices=list(PACKINGS))
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "kernel_instructions"
        flags = [f for f in c_build.flags(cpu_isa.MARCH[args.level]) if f not in ("-shared", "-fPIC")]
        subprocess.run(["cc", *flags, str(HARNESS), str(SOURCE), "-o", str(binary), "-lm"], check=True)
        print(f"cpu_linear.c at -march={cpu_isa.MARCH[args.level]}, one thread, bf16 activations")
        print("| packing | rows | weight bytes | instructions | per weight byte |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name in args.packings:
            for rows in args.rows:
                one, nbytes = count(binary, PACKINGS[name], rows, 1)
                three, _ = count(binary, PACKINGS[name], rows, 3)
                per = (three - one) / 2
                print(f"| {name} | {rows} | {nbytes} | {per:.0f} | {per / nbytes:.2f} |", flush=True)


if __name__ == "__main__":
    main()
