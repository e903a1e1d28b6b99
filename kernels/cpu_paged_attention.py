"""The CPU decode-attention kernel (`cpu_paged_attention.c`): built with the machine's C compiler, called by ctypes.

Gathering each sequence's blocks into a padded batch and then running SDPA moves the whole context three times
per layer (read, write, read again); this kernel reads it once, in place, one group of query heads per K/V row.
It is plain C with OpenMP, so building it needs only `cc` (no torch headers, about a second); the library is
cached under the cache directory by a hash of its source, the flags and this CPU, and built for this CPU
(`-march=native`). Without a C compiler, `load` returns None and the caller keeps the torch path.
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

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
MAX_HEAD_DIM, MAX_GROUP, LANES = 256, 16, 16
_FUNCTIONS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I, _I, _I, _I, _I, _F, _I, _I]


class CpuPagedAttention:
    """The loaded library: `decode` for float32 and bfloat16 caches."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether `decode` takes these: a CPU cache of a supported dtype, laid out as the kernel reads it."""
        _, _, kv_heads, dim = k_cache.shape
        heads = q.shape[1]
        return (k_cache.device.type == "cpu" and k_cache.dtype in self._fns and q.dtype == k_cache.dtype
                and k_cache.is_contiguous() and q.stride(2) == 1 and dim % LANES == 0 and dim <= MAX_HEAD_DIM
                and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
        """q `[B, H, D]` over `[num_blocks, block_size, kv_heads, D]` K/V; `block_tables` `[B, >= blocks]` int64,
        `lens` `[B]` int32 (each >= 1, at most `max_len`). Returns `[B, H, D]` in q's dtype."""
        b, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        if block_tables.dtype != torch.int64 or block_tables.stride(1) != 1:
            block_tables = block_tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int32).contiguous()
        out = torch.empty(b, heads, dim, dtype=q.dtype)
        rc = self._fns[q.dtype](q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                                block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(), out.data_ptr(),
                                b, heads, kv_heads, dim, block_size, scale, max_len, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"cpu paged attention failed (code {rc}): shape {tuple(q.shape)} over "
                               f"{tuple(k_cache.shape)}")
        return out


def _cpu_id() -> str:
    """What `-march=native` compiles for: the machine and its CPU flags."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def _build(compiler: str, target: Path, defines: tuple[str, ...]) -> None:
    """Compile into a temporary file next to `target`, then rename: processes starting together never load a
    half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *(f"-D{d}" for d in defines), str(SOURCE), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(cache_dir: Path, defines: tuple[str, ...] = ()) -> CpuPagedAttention | None:
    """The kernel, built into `cache_dir` on first use (or into the temp directory where that is read-only);
    None, with the reason logged, where there is no C compiler or it fails. `defines` are preprocessor symbols
    (`CPU_ATTENTION_PORTABLE` builds the plain-C loops even where AVX-512 is available)."""
    wanted = os.environ.get("CC")
    compiler = shutil.which(wanted) if wanted else shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler (%s): CPU decode attention stays on the torch path", wanted or "cc")
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), *defines, compiler, _cpu_id()]).encode())
    name = f"cpu_paged_attention-{key.hexdigest()[:16]}.so"
    for root in (cache_dir, Path(tempfile.gettempdir()) / "pdserve-kernels"):
        path = root / name
        try:
            if not path.exists():
                _build(compiler, path, defines)
            return CpuPagedAttention(ctypes.CDLL(str(path)), path)
        except subprocess.CalledProcessError as e:
            log.warning("building the CPU attention kernel failed; staying on the torch path:\n%s", e.stderr)
            return None
        except (OSError, subprocess.SubprocessError) as e:
            log.info("CPU attention kernel in %s: %s", root, e)
    log.warning("no writable place to build the CPU attention kernel; staying on the torch path")
    return None
