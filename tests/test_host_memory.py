"""glibc's malloc keeps freed activation memory in the process once the engine raises its thresholds; weights and
the KV cache go into memory advised for huge pages."""

from __future__ import annotations

import platform
import sys

import pytest
import torch
from torch import nn

from pdserve.engine.host_memory import (
    HUGE_PAGE,
    huge_page_buffer,
    keep_freed_memory,
    thp_mode,
    weights_into_huge_pages,
    zeros_in_huge_pages,
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_thresholds_are_accepted_and_tensors_still_work():
    assert keep_freed_memory()
    for size in (1 << 16, 8 << 20, 40 << 20):  # below, between and above the thresholds
        t = torch.full((size // 4,), 3.0)
        assert float(t.sum()) == 3.0 * (size // 4)
        del t


def test_huge_page_buffer_starts_on_a_huge_page_and_is_advised_where_linux_has_them():
    buf, advised = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 5
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert advised == (sys.platform.startswith("linux") and thp_mode() in ("always", "madvise", "never"))
    z = zeros_in_huge_pages((3, 5, 7), torch.bfloat16)
    assert z.shape == (3, 5, 7) and z.dtype == torch.bfloat16 and z.is_contiguous() and not z.any()
    assert z.data_ptr() % HUGE_PAGE == 0


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(10, dtype=torch.int64))
        self.register_buffer("part", self.proj.weight.detach()[2:5])  # a view of part of another's storage
        # the same storage as another dtype and shape (a packed copy that is the weight's own bytes)
        self.register_buffer("raw", self.embed.weight.detach().view(torch.uint8).view(-1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(ids)))[..., :16]) + self.table[0]


def test_weights_move_into_one_buffer_with_their_values_ties_and_views():
    torch.manual_seed(0)
    model = _Tied()
    ids = torch.tensor([[1, 7, 49]])
    before = model(ids)
    part_ptr, embed = model.part.data_ptr(), model.embed.weight
    moved = weights_into_huge_pages(model)
    assert moved.tensors == 4  # embed (tied to head, and raw), proj weight and bias, table: the view stays put
    assert moved.nbytes == 4 * 4096  # each from its own 4 KiB page
    assert torch.equal(model(ids), before)
    assert model.head.weight is model.embed.weight is embed  # the same Parameter, now over the buffer
    assert model.part.data_ptr() == part_ptr
    assert model.raw.dtype == torch.uint8 and model.raw.shape == (50 * 16 * 4,)
    assert model.embed.weight.shape == (50, 16) and model.embed.weight.dtype == torch.float32
    assert model.raw.data_ptr() == model.embed.weight.data_ptr()  # still one storage
    assert torch.equal(model.raw, model.embed.weight.detach().view(torch.uint8).view(-1))
    addrs = sorted(t.data_ptr() for t in (model.embed.weight, model.proj.weight, model.proj.bias, model.table))
    assert addrs[0] % HUGE_PAGE == 0 and [b - a for a, b in zip(addrs, addrs[1:])] == [4096] * 3
    assert "4 weight tensors" in moved.describe()
    loss = model(ids).sum()  # still trainable parameters: autograd reaches them
    loss.backward()
    assert model.proj.weight.grad is not None
