"""RMSNorm, rotary embedding and SiLU-and-multiply in one pass each for bfloat16 on CPU (`cpu_elementwise.c`),
and greedy decoding's argmax over a batch of logits.

Each method takes what its torch counterpart takes (`kernels.rms_norm.rms_norm`, `kernels.rotary.apply_rope`,
`kernels.activation.silu_and_mul`) and falls back to it for anything but bfloat16 CPU tensors laid out as the C
code reads them. A 2048-token prefill of SmolLM2-135M spent about 15% of its time in these operators, one op at a
time.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.kernels import c_build
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary import apply_rope

SOURCE = Path(__file__).with_name("cpu_elementwise.c")
LANES = 16
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.stride(-1) == 1


class CpuElementwise:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms = lib.rms_norm_bf16
        self._rms.argtypes, self._rms.restype = [_P, _I64, _P, _P, _I, _I, _F, _I], _I
        self._silu = lib.silu_and_mul_bf16
        self._silu.argtypes, self._silu.restype = [_P, _I64, _P, _I, _I, _I], _I
        self._rope = lib.rope_bf16
        self._rope.argtypes, self._rope.restype = [_P, _I64, _P, _P, _I64, _I, _I, _I, _I], _I
        self._argmax = lib.argmax_rows
        self._argmax.argtypes, self._argmax.restype = [_P, _I64, _I, _I, _I, _P, _P, _I], _I

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not (x.dim() == 2 and _ok(x) and _ok(weight) and weight.is_contiguous() and x.shape[1] % LANES == 0):
            return rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._check(
            self._rms(
                x.data_ptr(),
                x.stride(0),
                weight.data_ptr(),
                out.data_ptr(),
                x.shape[0],
                x.shape[1],
                eps,
                torch.get_num_threads(),
            ),
            "rms_norm",
            x,
        )
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dim() == 2 and _ok(x) and x.shape[1] % 2 == 0):
            return silu_and_mul(x)
        inter = x.shape[1] // 2
        out = torch.empty(x.shape[0], inter, dtype=x.dtype)
        self._check(
            self._silu(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], inter, torch.get_num_threads()),
            "silu_and_mul",
            x,
        )
        return out

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place (x is a view into this step's QKV projection, read by nothing else); returns x."""
        if not (
            x.dim() == 3
            and _ok(x)
            and x.stride(1) == x.shape[2]
            and cos.dim() == 3
            and _ok(cos)
            and _ok(sin)
            and cos.shape[1] == 1
            and cos.stride() == sin.stride()
            and cos.shape[0] == x.shape[0]
            and cos.shape[2] == x.shape[2]
            and x.shape[2] % 2 == 0
            and x.shape[2] <= 1024
        ):
            return apply_rope(x, cos, sin)
        self._check(
            self._rope(
                x.data_ptr(),
                x.stride(0),
                cos.data_ptr(),
                sin.data_ptr(),
                cos.stride(0),
                x.shape[0],
                x.shape[1],
                x.shape[2],
                torch.get_num_threads(),
            ),
            "rope",
            x,
        )
        return x

    def argmax(self, logits: torch.Tensor) -> tuple[list[int], set[int]] | None:
        """Each row's first maximum, and the rows whose maximum is not finite (NaN, +inf, or no finite value), for
        fp32 or bf16 CPU logits `[N, V]` with unit stride along V; None for anything else."""
        if not (
            logits.dim() == 2
            and logits.device.type == "cpu"
            and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.stride(1) == 1
            and logits.shape[1] > 0
        ):
            return None
        rows = logits.shape[0]
        idx = torch.empty(rows, dtype=torch.int64)
        bad = torch.empty(rows, dtype=torch.uint8)
        rc = self._argmax(
            logits.data_ptr(),
            logits.stride(0),
            int(logits.dtype == torch.bfloat16),
            rows,
            logits.shape[1],
            idx.data_ptr(),
            bad.data_ptr(),
            torch.get_num_threads(),
        )
        self._check(rc, "argmax", logits)
        return idx.tolist(), {i for i, b in enumerate(bad.tolist()) if b}

    @staticmethod
    def _check(rc: int, what: str, x: torch.Tensor) -> None:
        if rc != 0:
            raise RuntimeError(f"cpu {what} failed (code {rc}) on shape {tuple(x.shape)}")


def load(cache_dir: Path) -> CpuElementwise | None:
    """The kernels, built into `cache_dir` on first use (`kernels.c_build`); None where they cannot be built."""
    lib = c_build.build(SOURCE, cache_dir)
    return CpuElementwise(lib) if lib is not None else None
