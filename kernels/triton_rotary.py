"""Rotary embedding applied in place in Triton ("rotate half" convention, as `kernels.rotary.apply_rope`).

cos/sin are the engine's per-position tables `[T, head_dim]` whose two halves are equal, so only the first half
is read. Each program rotates one head of one token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, COS, SIN, stride_xt, stride_xh, stride_ct, stride_st, HALF: tl.constexpr,
                 BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = X + t * stride_xt + h * stride_xh
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(COS + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + offs, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(base + HALF + offs, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens, heads, dim = x.shape
    if dim % 2 or x.stride(-1) != 1:
        raise ValueError("head_dim must be even and contiguous")
    if tokens and heads:
        _rope_kernel[(tokens, heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                      HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2))


def apply_rope_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q `[T, H, D]` and k `[T, KVH, D]` in place; cos/sin `[T, D]` (or `[T, 1, D]`)."""
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos/sin must have a contiguous last dimension")
    _rotate(q, cos, sin)
    _rotate(k, cos, sin)
