"""Host memory the CPU engine reads at speed: freed memory kept in the process, and weights in huge pages.

Keep freed memory in the process (glibc's malloc), so a step's tensors do not fault in fresh pages every step.

glibc serves allocations above a threshold (128 KiB at start, adjusted upwards as large blocks are freed) with
their own mmap and gives memory at the top of the heap back to the system once more than a trim threshold is
free. A forward allocates and frees the same few-megabyte activations every layer of every step, so by default
many of them come back as fresh pages, and the page faults cost more than the arithmetic on them: a
2048-token prefill of SmolLM2-135M took 830 ms, 680 ms with the thresholds raised, and a sampled decode step at
batch 32 38 ms, 33 ms. (vLLM's CPU backend gets the same from preloading tcmalloc.)

Put what every decode step streams (the weights, the KV cache) in transparent huge pages. Linux backs anonymous
memory with 4 KiB pages unless a range asks for 2 MiB ones (`/sys/kernel/mm/transparent_hugepage/enabled` is
`madvise` on most distributions), and a core streaming 4 KiB pages runs out of TLB entries and restarts its
hardware prefetcher at every page boundary. 212 MB of bf16 weights at one row, 2 threads, on a Sapphire Rapids VM:
the AVX2 kernels 14.5 -> 22.6 GB/s, the AVX-512 bf16_rows one 29.7 -> 33.6 GB/s (benchmarks/roofline.py's
bandwidth probe reads huge pages too, so its limit is the machine's best).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 512 << 20
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MADV_HUGEPAGE = 14
ALIGN = 4096  # where each tensor starts in a huge-page buffer: no two share a page of 4 KiB
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("mallopt refused the thresholds; freed memory goes back to the system as usual")
    return ok


@functools.cache  # find_library runs ldconfig: once a process, not once a buffer
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise, never), or "none" where there is none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "none"
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else "none"


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """An untouched uint8 CPU tensor of `nbytes` that starts on a 2 MiB boundary, and whether the kernel took the
    advice to back it with huge pages (it does so as the pages are first written: the advice must come first)."""
    span = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # advised whole: the tail's huge page is ours too
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start : start + nbytes]
    madvise = _madvise()
    advised = madvise is not None and nbytes > 0 and madvise(buf.data_ptr(), span, MADV_HUGEPAGE) == 0
    return buf, advised


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in huge pages where the kernel gives them."""
    buf, _ = huge_page_buffer(math.prod(shape) * dtype.itemsize)
    return buf.view(dtype).view(shape).zero_()


@dataclass(frozen=True)
class Moved:
    tensors: int
    nbytes: int
    advised: bool  # the kernel took the advice (huge pages, where it has them to give)
    mode: str  # thp_mode()

    def describe(self) -> str:
        where = "transparent huge pages" if self.advised and self.mode in ("always", "madvise") else "4 KiB pages"
        why = "" if where != "4 KiB pages" else f" (transparent huge pages: {self.mode})"
        return f"{self.tensors} weight tensors, {self.nbytes / 2**20:.0f} MiB, in {where}{why}"


def _movable(t: torch.Tensor) -> bool:
    """A plain CPU tensor that is all of its storage (a view of part of another is left where it is)."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_mkldnn
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.numel() > 0
    )


def _slots(model: nn.Module) -> Iterable[tuple[dict, str, torch.Tensor, int]]:
    """(table, name, tensor, address) of every movable parameter and buffer; a tied one appears once a module."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and _movable(t):
                    yield table, name, t, t.data_ptr()


def weights_into_huge_pages(model: nn.Module) -> Moved:
    """Copy every parameter and buffer of a CPU model into one huge-page buffer, in place: the modules hold views of
    it from then on, and the old storage is freed. Tensors over the same storage (a tied embedding, a packed
    buffer that is a weight's bytes seen as another dtype and shape) are copied once and stay one storage, each
    keeping its own dtype and shape. Call before anything keeps a pointer to a weight (the fused C layers bind
    theirs after)."""
    slots = list(_slots(model))
    offsets: dict[int, int] = {}
    total = 0
    for _, _, t, key in slots:
        if key not in offsets:
            offsets[key] = total
            total += (t.untyped_storage().nbytes() + ALIGN - 1) // ALIGN * ALIGN
    buf, advised = huge_page_buffer(total)
    copied: set[int] = set()
    while slots:  # popped, so each old tensor is freed once moved: the peak is one copy, not two
        table, name, t, key = slots.pop()
        at = offsets[key]
        view = buf[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        if key not in copied:
            view.copy_(t)
            copied.add(key)
        if isinstance(t, nn.Parameter):
            t.data = view
        else:
            table[name] = view
    return Moved(len(offsets), total, advised, thp_mode())
