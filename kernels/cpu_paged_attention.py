"""The CPU decode-attention kernel (`cpu_paged_attention.c`): built with the machine's C compiler, called by ctypes.

Gathering each sequence's blocks into a padded batch and then running SDPA moves the whole context three times
per layer (read, write, read again); this kernel reads it once, in place, one group of query heads per K/V row.
Built with the machine's C compiler on first use and cached (`kernels.c_build`); without a compiler, `load`
returns None and the caller keeps the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels import c_build

SOURCE = Path(__file__).with_name("cpu_paged_attention.c")
MAX_HEAD_DIM, MAX_GROUP, LANES = 256, 16, 16
_FUNCTIONS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I, _I, _I, _I, _I, _F, _I, _I]


class CpuPagedAttention:
    """The loaded library: `decode` for float32 and bfloat16 caches."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether `decode` takes these: a CPU cache of a supported dtype, laid out as the kernel reads it."""
        _, _, kv_heads, dim = k_cache.shape
        heads = q.shape[1]
        return (
            k_cache.device.type == "cpu"
            and k_cache.dtype in self._fns
            and q.dtype == k_cache.dtype
            and k_cache.is_contiguous()
            and q.stride(2) == 1
            and dim % LANES == 0
            and dim <= MAX_HEAD_DIM
            and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUP
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        lens: torch.Tensor,
        max_len: int,
        scale: float,
    ) -> torch.Tensor:
        """q `[B, H, D]` over `[num_blocks, block_size, kv_heads, D]` K/V; `block_tables` `[B, >= blocks]` int64,
        `lens` `[B]` int32 (each >= 1, at most `max_len`). Returns `[B, H, D]` in q's dtype."""
        b, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        if block_tables.dtype != torch.int64 or block_tables.stride(1) != 1:
            block_tables = block_tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int32).contiguous()
        out = torch.empty(b, heads, dim, dtype=q.dtype)
        rc = self._fns[q.dtype](
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            lens.data_ptr(),
            out.data_ptr(),
            b,
            heads,
            kv_heads,
            dim,
            block_size,
            scale,
            max_len,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(
                f"cpu paged attention failed (code {rc}): shape {tuple(q.shape)} over {tuple(k_cache.shape)}"
            )
        return out


def load(cache_dir: Path, defines: tuple[str, ...] = ()) -> CpuPagedAttention | None:
    """The kernel, built into `cache_dir` on first use (`kernels.c_build`); None where it cannot be built.
    `CPU_ATTENTION_PORTABLE` in `defines` builds the plain-C loops even where AVX-512 is available."""
    lib = c_build.build(SOURCE, cache_dir, defines)
    return CpuPagedAttention(lib) if lib is not None else None
