"""The CPU levels the kernel tests build for: every ISA level this machine can execute, and its own -march=native
(what it has beyond its level, e.g. AVX512-BF16's vdpbf16ps paths, which no level includes)."""

from __future__ import annotations

import pytest

from pdserve.kernels import c_build, cpu_isa

LEVELS = [lv for lv in cpu_isa.LEVELS if cpu_isa.LEVELS.index(lv) <= cpu_isa.LEVELS.index(cpu_isa.detected())]
LEVELS.append("native")


def build_for(mp: pytest.MonkeyPatch, level: str) -> None:
    """Make the kernels built from here on target `level` (the cap chooses -march and cpu_linear's tiles)."""
    if level == "native":
        mp.delenv(cpu_isa.ENV, raising=False)
    else:
        mp.setenv(cpu_isa.ENV, level)


def require_built(lib: object, what: str) -> None:
    """Skip where there is no C compiler; where there is one, a library that did not build is a failure (a compile
    error at one level once showed up here as 250 skipped tests)."""
    if lib is None:
        if c_build._compiler()[0] is None:
            pytest.skip("no C compiler")
        pytest.fail(f"{what} did not build with the C compiler this machine has (see the log for gcc's error)")
