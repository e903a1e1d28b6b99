"""The CPU's instruction-set level, and a cap that makes one machine run (and test) the paths of lower ones.

Levels, lowest first: `portable` (any x86-64, or another architecture), `avx2` (AVX2 + FMA + F16C: many clouds
and laptops), `avx512` (AVX-512 F/BW/VL/DQ). `PDSERVE_CPU_ISA=portable|avx2|avx512` caps the level: the C kernels
are then built for it (`-march=x86-64`, `x86-64-v3`, `x86-64-v4` instead of `native`), and `torch_env` names the
variables that cap torch's own kernels the same way (ATen's, oneDNN's and MKL's), which must be set before torch is
imported: `pdserve` and the test suite do so at start. Nothing here imports torch.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

LEVELS = ("portable", "avx2", "avx512")
ENV = "PDSERVE_CPU_ISA"
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
}
MARCH = {"portable": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
# (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS): torch's fp32 GEMM is MKL's
_TORCH = {"portable": ("default", "SSE41", "SSE4_2"), "avx2": ("avx2", "AVX2", "AVX2")}


def _flags() -> list[str]:
    """The first CPU's flags, in /proc/cpuinfo's order (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return line.partition(":")[2].split()


def cpu_flags() -> set[str]:
    return set(_flags())


def isa_flags() -> str:
    """The vector flags (avx*, amx*, fma, f16c) in /proc/cpuinfo's order: what a measurement names its CPU by."""
    return " ".join(f for f in _flags() if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))


def detected() -> str:
    """The highest level this CPU has."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "portable"
    flags = cpu_flags()
    for level in ("avx512", "avx2"):
        if _NEEDS[level] <= flags:
            return level
    return "portable"


def cap() -> str | None:
    """The level PDSERVE_CPU_ISA asks for (None: no cap); ValueError for a name that is not a level."""
    name = os.environ.get(ENV, "").strip().lower()
    if not name:
        return None
    if name not in LEVELS:
        raise ValueError(f"{ENV}={name!r}: use one of {', '.join(LEVELS)}")
    return name


def level() -> str:
    """What the fast paths may use: the CPU's level, lowered to the cap."""
    have, limit = detected(), cap()
    if limit is None:
        return have
    return LEVELS[min(LEVELS.index(have), LEVELS.index(limit))]


def march() -> str:
    """The compiler's -march for the C kernels: this CPU's own, unless capped."""
    return "native" if cap() is None else MARCH[level()]


def torch_env() -> dict[str, str]:
    """Variables that cap torch's kernels at the capped level (empty without a cap or at the CPU's own level)."""
    limit = cap()
    if limit is None or level() == detected() or level() not in _TORCH:
        return {}
    aten, onednn, mkl = _TORCH[level()]
    return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn, "MKL_ENABLE_INSTRUCTIONS": mkl}


def apply_cap() -> None:
    """Cap torch in this process (call before torch is imported; children inherit the variables)."""
    for name, value in torch_env().items():
        os.environ.setdefault(name, value)
