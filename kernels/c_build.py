"""Building this package's C kernels with the machine's C compiler and loading them with ctypes.

The kernels are plain C with OpenMP, so building one needs only `cc` (no torch headers, about a second). Each
library is cached under the cache directory by a hash of its source, the flags, the compiler and this CPU, and
built for this CPU (`-march=native`, or the level `PDSERVE_CPU_ISA` caps it to: `kernels.cpu_isa`), never on
another machine, so an image built elsewhere cannot carry instructions this CPU lacks. Loaded into a process that
runs torch, a library binds to the libgomp torch already loaded, so its threads are torch's own pool. Without a C
compiler, `build` returns None and callers keep their torch paths.

Where nothing can be built or loaded (no compiler, a read-only cache and a `noexec` /tmp: a hardened container),
libraries prebuilt per CPU level (`python -m pdserve.kernels.c_build --prebuild DIR`, done in the image) are
loaded from `<cache>/prebuilt` or `$PDSERVE_KERNELS_PREBUILT`: the one for this CPU's level (`-march=x86-64-v4`
for avx512, `-v3` for avx2), never one above it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.kernels import cpu_isa

log = logging.getLogger(__name__)

# -fno-trapping-math: no kernel reads floating-point exception flags, and without it gcc keeps the comparisons of
# exp's clamp out of vectorized loops (SiLU-and-mul ran scalar on AVX2); it changes no result, only what may vectorize
FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")


PREBUILT_ENV = "PDSERVE_KERNELS_PREBUILT"


def flags(march: str | None = None) -> tuple[str, ...]:
    return (*FLAGS, f"-march={march or cpu_isa.march()}")


def _included(source: Path) -> list[Path]:
    """The sibling files `source` includes by name (a library may compile other kernels' sources into itself)."""
    seen: list[Path] = []
    todo = [source]
    while todo:
        for name in re.findall(r'^#include "([^"]+)"', todo.pop().read_text(), re.MULTILINE):
            path = source.parent / name
            if path.is_file() and path not in seen:
                seen.append(path)
                todo.append(path)
    return seen


def _sources_key(source: Path, extra: list[str]) -> str:
    headers = sorted({*source.parent.glob("*.h"), *_included(source)})  # what the source may include
    texts = [source.read_text(), *(h.read_text() for h in headers)]
    return hashlib.sha256("\0".join([*texts, *extra]).encode()).hexdigest()[:16]


def prebuilt_name(source: Path, level: str, defines: tuple[str, ...] = ()) -> str:
    """A library built for a CPU level, not a machine: its name holds the level and a hash of source and flags."""
    return f"{source.stem}-{level}-{_sources_key(source, [' '.join(flags(cpu_isa.MARCH[level])), *defines])}.so"


def _cpu_id() -> str:
    """What `-march=native` compiles for: the machine and its CPU flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def _compiler() -> tuple[str | None, str]:
    """The C compiler's path ($CC, else cc or gcc; None where there is none) and the name asked for."""
    wanted = os.environ.get("CC")
    return (shutil.which(wanted) if wanted else shutil.which("cc") or shutil.which("gcc")), wanted or "cc"


def _compile(compiler: str, source: Path, target: Path, defines: tuple[str, ...], march: str | None = None) -> None:
    """Compile into a temporary file next to `target`, then rename: processes starting together never load a
    half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags(march), *(f"-D{d}" for d in defines), str(source), "-o", tmp],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(source: Path, cache_dir: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` built into `cache_dir` on first use (or into the temp directory where that is read-only) and
    loaded; None, with the reason logged, where there is no C compiler or it fails. `defines` are preprocessor
    symbols."""
    what = source.stem
    compiler, wanted = _compiler()
    if compiler is None:
        return _prebuilt(source, cache_dir, defines, f"no C compiler ({wanted})")
    name = f"{what}-{_sources_key(source, [' '.join(flags()), *defines, compiler, _cpu_id()])}.so"
    for root in (cache_dir, Path(tempfile.gettempdir()) / "pdserve-kernels"):
        path = root / name
        try:
            if not path.exists():
                _compile(compiler, source, path, defines)
            return ctypes.CDLL(str(path))
        except subprocess.CalledProcessError as e:
            log.warning("building %s failed; staying on the torch path:\n%s", what, e.stderr)
            return None
        except (OSError, subprocess.SubprocessError) as e:
            log.info("%s in %s: %s", what, root, e)
    return _prebuilt(source, cache_dir, defines, "no writable, executable place to build it")


def _prebuilt(source: Path, cache_dir: Path, defines: tuple[str, ...], why: str) -> ctypes.CDLL | None:
    """The library prebuilt for this CPU's level, where one was shipped; else None (the torch path)."""
    level = cpu_isa.level()
    if level in cpu_isa.MARCH and platform.machine() in ("x86_64", "AMD64"):
        folder = Path(os.environ.get(PREBUILT_ENV) or cache_dir / "prebuilt")
        path = folder / prebuilt_name(source, level, defines)
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                log.warning("%s: the prebuilt %s does not load either (%s)", why, path, e)
            else:
                log.info("%s: %s loaded prebuilt for %s from %s", why, source.stem, level, folder)
                return lib
    log.warning("%s: %s stays on the torch path", why, source.stem)
    return None


def prebuild(sources: list[Path], folder: Path) -> list[Path]:
    """Every source built for every CPU level, into `folder` (an image build does this once)."""
    compiler, wanted = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C compiler ({wanted}) to prebuild the kernels with")
    built = []
    for source in sources:
        for level, march in cpu_isa.MARCH.items():
            target = folder / prebuilt_name(source, level)
            _compile(compiler, source, target, (), march)
            built.append(target)
    return built


def main() -> None:
    import argparse

    from pdserve.kernels import cpu_decoder_layer, cpu_elementwise, cpu_paged_attention, quant_linear

    parser = argparse.ArgumentParser(description="prebuild the C kernels for every CPU level (for images)")
    parser.add_argument("--prebuild", type=Path, required=True, help="folder to put the libraries in")
    args = parser.parse_args()
    sources = [cpu_elementwise.SOURCE, cpu_paged_attention.SOURCE, quant_linear.SOURCE, cpu_decoder_layer.SOURCE]
    for path in prebuild(sources, args.prebuild):
        print(path)


if __name__ == "__main__":
    main()
