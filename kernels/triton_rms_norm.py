"""Fused residual add + RMSNorm in Triton: one read of x and the residual, one write of each result.

Numerics follow the reference (`kernels.rms_norm.add_rms_norm`, itself Hugging Face Llama's): the residual sum
is rounded to the model dtype, the norm is computed in fp32, cast back, then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(X, R, W, O, eps, hidden, stride_x, stride_r, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
    s = (x + r).to(R.dtype.element_ty)
    tl.store(R + row * stride_r + offs, s, mask=mask)
    h = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = w * (h * inv).to(O.dtype.element_ty)
    tl.store(O + row * stride_o + offs, y.to(O.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` in place; returns (rms_norm(residual) * weight, residual). x, residual `[T, H]`."""
    if x.shape != residual.shape or x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("x and residual must be [T, H] with a contiguous last dimension")
    rows, hidden = x.shape
    out = torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](x, residual, weight, out, eps, hidden, x.stride(0), residual.stride(0),
                                      out.stride(0), BLOCK=triton.next_power_of_2(hidden))
    return out, residual
