"""The attention backend interface, the metadata every backend reads, and the backends.

One forward serves a flattened mixed batch: prompts (or prompt chunks) of different lengths and single decode
tokens side by side, each described by where its queries start, how long its context is, and its block table.
Every backend reads the same cache layout, a layer's `[2, num_blocks, block_size, kv_heads, head_dim]`, so
switching backends never copies the cache:

- `torch`: plain torch (`kernels.paged_attention`), runs anywhere; the oracle.
- `cpu`: torch for prompt rows, and for single-token rows the C kernel that reads the blocks in place
  (`kernels.cpu_paged_attention`, built with the machine's C compiler on first use).
- `triton`: the Triton paged-decode kernel for single-token rows, torch SDPA for prompt rows.
- `flash-attn`: `flash_attn_varlen_func` over the paged cache for mixed batches and `flash_attn_with_kvcache`
  for pure decode batches (flash-attn's paged mode wants blocks of a multiple of 256 tokens).

`select_backend("auto")` takes flash-attn > Triton > torch on a GPU, and cpu > torch on a CPU, by what the device
and install support.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.model_store import cache_dir
from pdserve.kernels import cpu_paged_attention
from pdserve.kernels.cache_ops import store_kv
from pdserve.kernels.paged_attention import decode_attention, decode_mask, prefill_attention

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flash-attn", "triton", "cpu", "torch")
FLASH_BLOCK_MULTIPLE = 256


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    query_start_loc: list[int]  # [B+1] offsets of each sequence's queries in the flat batch
    seq_lens: list[int]  # [B] context length of each sequence, new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] physical block ids, zero-padded


class AttentionBackend(Protocol):
    name: str

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's k/v into `kv_layer`, then attend q `[T, H, D]` over each sequence's context."""
        ...


class _StepTensors:
    """Per-forward tensors derived from the metadata, built once and shared by every layer."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self.decode_rows: list[int] = []
        self.prefill_rows: list[int] = []
        self.decode_tokens: torch.Tensor | None = None
        self.decode_lens: torch.Tensor | None = None
        self.decode_max_len = 0
        self.decode_tables: torch.Tensor | None = None  # [decode rows, blocks the longest of them needs]
        self.decode_mask: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None
        self.cu_q: torch.Tensor | None = None
        self.cu_k: torch.Tensor | None = None

    def update(self, meta: AttentionMetadata, device: torch.device, block_size: int) -> _StepTensors:
        if meta is self._meta:
            return self
        self._meta = meta
        qsl = meta.query_start_loc
        n = len(meta.seq_lens)
        self.decode_rows = [i for i in range(n) if qsl[i + 1] - qsl[i] == 1]
        self.prefill_rows = [i for i in range(n) if qsl[i + 1] - qsl[i] > 1]
        rows = self.decode_rows
        if rows:
            lens = [meta.seq_lens[i] for i in rows]
            self.decode_max_len = max(lens)
            n_blocks = -(-self.decode_max_len // block_size)
            self.decode_tokens = torch.tensor([qsl[i] for i in rows], dtype=torch.long, device=device)
            self.decode_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            tables = meta.block_tables if len(rows) == n else meta.block_tables[rows]
            self.decode_tables = tables[:, :n_blocks]
            self.decode_mask = decode_mask(self.decode_lens, n_blocks * block_size)
        self.seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32, device=device)
        self.cu_q = torch.tensor(qsl, dtype=torch.int32, device=device)
        self.cu_k = torch.nn.functional.pad(self.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self


class TorchAttention:
    """The reference backend: plain torch, runs anywhere."""

    name = "torch"

    def __init__(self) -> None:
        self._step = _StepTensors()

    def __call__(self, q, k, v, kv_layer, meta, scale):
        store_kv(k, v, kv_layer, meta.slot_mapping)
        step = self._step.update(meta, q.device, kv_layer.shape[2])
        if not step.prefill_rows:  # a pure decode step: every row is one token, in order
            return self._decode(q, kv_layer, step, scale)
        out = torch.empty_like(q)
        prefill_attention(
            q, kv_layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, step.prefill_rows, scale, out
        )
        if step.decode_rows:
            out[step.decode_tokens] = self._decode(q[step.decode_tokens], kv_layer, step, scale)
        return out

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor, step: _StepTensors, scale: float) -> torch.Tensor:
        assert step.decode_tables is not None and step.decode_mask is not None
        return decode_attention(q, kv_layer[0], kv_layer[1], step.decode_tables, step.decode_mask, scale)


class CpuAttention(TorchAttention):
    """The torch backend, with single-token rows through the C kernel that reads the paged cache in place."""

    name = "cpu"

    def __init__(self, kernel: cpu_paged_attention.CpuPagedAttention) -> None:
        super().__init__()
        self._kernel = kernel

    def _decode(self, q, kv_layer, step, scale):
        if not self._kernel.supports(q, kv_layer[0]):  # e.g. float16: the torch path
            return super()._decode(q, kv_layer, step, scale)
        return self._kernel.decode(
            q, kv_layer[0], kv_layer[1], step.decode_tables, step.decode_lens, step.decode_max_len, scale
        )


class TritonAttention:
    """Triton paged decode for single-token rows; prompt rows go through torch SDPA on the gathered context."""

    name = "triton"

    def __init__(self) -> None:
        from pdserve.kernels.triton_paged_attention import paged_decode_attention

        self._decode = paged_decode_attention
        self._step = _StepTensors()

    def __call__(self, q, k, v, kv_layer, meta, scale):
        store_kv(k, v, kv_layer, meta.slot_mapping)
        step = self._step.update(meta, q.device, kv_layer.shape[2])
        out = torch.empty_like(q)
        prefill_attention(
            q, kv_layer, meta.query_start_loc, meta.seq_lens, meta.block_tables, step.prefill_rows, scale, out
        )
        if step.decode_rows:
            assert step.decode_tables is not None and step.decode_lens is not None
            out[step.decode_tokens] = self._decode(
                q[step.decode_tokens],
                kv_layer[0],
                kv_layer[1],
                step.decode_tables.to(torch.int32),
                step.decode_lens,
                scale,
            )
        return out


class FlashAttention:
    """flash-attn over the paged cache: varlen for batches with prompt rows, with_kvcache for pure decode."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._step = _StepTensors()

    def __call__(self, q, k, v, kv_layer, meta, scale):
        store_kv(k, v, kv_layer, meta.slot_mapping)
        step = self._step.update(meta, q.device, kv_layer.shape[2])
        tables = meta.block_tables.to(torch.int32)
        if not step.prefill_rows:  # every row is one token: [B, 1, H, D] against the paged cache
            out = self._with_kvcache(
                q[:, None],
                kv_layer[0],
                kv_layer[1],
                cache_seqlens=step.seq_lens,
                block_table=tables,
                softmax_scale=scale,
                causal=True,
            )
            return out[:, 0]
        return self._varlen(
            q,
            kv_layer[0],
            kv_layer[1],
            step.cu_q,
            step.cu_k,
            max(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])),
            max(meta.seq_lens),
            softmax_scale=scale,
            causal=True,
            block_table=tables,
        )


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def available_backends(device: torch.device, block_size: int, dtype: torch.dtype | None = None) -> list[str]:
    """Backends that can run here, best first (flash-attn needs CUDA, fp16/bf16 and paged blocks of 256n)."""
    have = []
    if (
        device.type == "cuda"
        and _has("flash_attn")
        and block_size % FLASH_BLOCK_MULTIPLE == 0
        and (dtype is None or dtype in FLASH_DTYPES)
    ):
        have.append("flash-attn")
    if _has("triton") and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        have.append("triton")
    if device.type == "cpu":
        have.append("cpu")  # if a C compiler builds it: `select_backend` finds out
    have.append("torch")
    return have


def select_backend(
    name: str = "auto", device: torch.device | None = None, block_size: int = 16, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """Pick the attention backend; 'auto' takes the best one this device supports. Logs the choice."""
    device = device or torch.device("cpu")
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: choose from {', '.join(BACKENDS)}")
    have = available_backends(device, block_size, dtype)
    auto = name == "auto"
    if auto:
        # On CPU the Triton interpreter is a test vehicle, never a speed-up: auto takes the C kernel there.
        name = have[0] if device.type == "cuda" else "cpu"
    elif name not in have:
        why = {
            "flash-attn": f"needs CUDA, the flash-attn package, float16 or bfloat16 and a block size that is a "
            f"multiple of {FLASH_BLOCK_MULTIPLE} (have {device.type}, {dtype}, block size "
            f"{block_size})",
            "triton": "needs the triton package and CUDA (or TRITON_INTERPRET=1 on CPU)",
            "cpu": f"runs on a CPU device (have {device.type})",
        }[name]
        raise ValueError(f"attention backend {name!r} is not available here: it {why}")
    backend: AttentionBackend
    if name == "cpu":
        kernel = cpu_paged_attention.load(cache_dir() / "kernels")
        if kernel is None and not auto:
            raise ValueError(
                "attention backend 'cpu' is not available here: it needs a C compiler (cc) that "
                "builds kernels/cpu_paged_attention.c (the log says why it did not)"
            )
        backend = CpuAttention(kernel) if kernel is not None else TorchAttention()
    else:
        kinds: dict[str, type[AttentionBackend]] = {
            "flash-attn": FlashAttention,
            "triton": TritonAttention,
            "torch": TorchAttention,
        }
        backend = kinds[name]()
    log.info("attention backend: %s (available here: %s)", backend.name, ", ".join(have))
    return backend
