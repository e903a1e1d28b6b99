"""The gated activation of Llama-family MLPs, in plain torch (the reference the CPU C kernel is held to)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for x = [gate | up] along the last dimension (the fused gate/up projection's output)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
