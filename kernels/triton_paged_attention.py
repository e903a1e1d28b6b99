"""Paged-attention decode in Triton: one query token per sequence attends over its KV blocks.

Each program owns one (sequence, query head): it walks the sequence's block table one KV block at a time with an
online softmax (running max and sum in fp32), so any context length runs in one pass with no gather. GQA maps
query head h to KV head h // group. It reads the engine's cache layout as is: K and V `[num_blocks, block_size,
kv_heads, head_dim]` (a layer's `kv[0]` and `kv[1]`), the same tensors flash-attn's paged API reads.
Reference: `kernels.paged_attention` (its single-token rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    Q,
    K,
    V,
    O,
    block_tables,
    seq_lens,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    length = tl.load(seq_lens + seq)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_SIZE)
    dmask = offs_d < HEAD_DIM
    q = tl.load(Q + seq * stride_qb + head * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(block_tables + seq * stride_tb + i).to(tl.int64)
        smask = i * BLOCK_SIZE + offs_s < length
        mask = smask[:, None] & dmask[None, :]
        k = tl.load(
            K + block * stride_kb + offs_s[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        scores = tl.where(smask, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(
            V + block * stride_vb + offs_s[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    tl.store(O + seq * stride_ob + head * stride_oh + offs_d, (acc / denom).to(O.dtype.element_ty), mask=dmask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q `[B, H, D]`, caches `[num_blocks, block_size, KVH, D]`, block_tables `[B, max_blocks]` int32,
    seq_lens `[B]` int32 (context length, this token included) -> `[B, H, D]`."""
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _paged_decode_kernel[(batch, heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return out
