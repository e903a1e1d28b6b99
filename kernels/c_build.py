"""Building this package's C kernels with the machine's C compiler and loading them with ctypes.

The kernels are plain C with OpenMP, so building one needs only `cc` (no torch headers, about a second). Each
library is cached under the cache directory by a hash of its source, the flags, the compiler and this CPU, and
built for this CPU (`-march=native`, or the level `PDSERVE_CPU_ISA` caps it to: `kernels.cpu_isa`), never on
another machine, so an image built elsewhere cannot carry instructions this CPU lacks. Loaded into a process that
runs torch, a library binds to the libgomp torch already loaded, so its threads are torch's own pool. Without a C
compiler, `build` returns None and callers keep their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.kernels import cpu_isa

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")


def flags() -> tuple[str, ...]:
    return (*FLAGS, f"-march={cpu_isa.march()}")


def _cpu_id() -> str:
    """What `-march=native` compiles for: the machine and its CPU flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def _compile(compiler: str, source: Path, target: Path, defines: tuple[str, ...]) -> None:
    """Compile into a temporary file next to `target`, then rename: processes starting together never load a
    half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags(), *(f"-D{d}" for d in defines), str(source), "-o", tmp],
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
    wanted = os.environ.get("CC")
    compiler = shutil.which(wanted) if wanted else shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler (%s): %s stays on the torch path", wanted or "cc", what)
        return None
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the sources may include
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, " ".join(flags()), *defines, compiler, _cpu_id()]).encode()
    )
    name = f"{what}-{key.hexdigest()[:16]}.so"
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
    log.warning("no writable place to build %s; staying on the torch path", what)
    return None
