"""glibc's malloc keeps freed activation memory in the process once the engine raises its thresholds."""

from __future__ import annotations

import platform

import pytest
import torch

from pdserve.engine.host_memory import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_thresholds_are_accepted_and_tensors_still_work():
    assert keep_freed_memory()
    for size in (1 << 16, 8 << 20, 40 << 20):  # below, between and above the thresholds
        t = torch.full((size // 4,), 3.0)
        assert float(t.sum()) == 3.0 * (size // 4)
        del t
