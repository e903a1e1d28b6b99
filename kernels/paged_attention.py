"""Attention over the paged KV cache in plain torch: the CPU path and the oracle for the GPU kernels.

Every sequence in a batch contributes `q_len` query tokens (a prompt chunk, or 1 while decoding) that attend to
the first `seq_len` tokens of its context, read through its block table. Decode rows (q_len == 1) run as one
padded batch: each sequence's blocks are gathered whole (one `index_select` per K and V, memcpy speed) and fed to
SDPA with grouped-query heads and a padding mask, so no head-major copy of the context is ever made. Longer rows
run one by one with a causal mask offset by the cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """`[length, kv_heads, head_dim]` of one sequence, from a `[num_blocks, block_size, ...]` K or V cache."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float
) -> torch.Tensor:
    """q `[B, H, L, D]`, k/v `[B, KVH, S, D]` (grouped-query heads are matched inside SDPA, without copies)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q `[T, H, D]` -> `[T, H, D]`; `query_start_loc` has B+1 offsets into T, `seq_lens` B context lengths."""
    out = torch.empty_like(q)
    decode_rows = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    prefill_rows = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] > 1]
    prefill_attention(q, kv_layer, query_start_loc, seq_lens, block_tables, prefill_rows, scale, out)
    if decode_rows:
        tokens = torch.tensor([query_start_loc[i] for i in decode_rows], device=q.device)
        lens = [seq_lens[i] for i in decode_rows]
        n_blocks = -(-max(lens) // kv_layer.shape[2])
        mask = decode_mask(torch.tensor(lens, device=q.device), n_blocks * kv_layer.shape[2])
        out[tokens] = decode_attention(
            q[tokens], kv_layer[0], kv_layer[1], block_tables[decode_rows, :n_blocks], mask, scale
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    rows: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of the multi-token rows (prompts or prompt chunks), one at a time, into `out`."""
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    for i in rows:
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len, length = end - start, seq_lens[i]
        k = gather_context(k_cache, block_tables[i], length).transpose(0, 1)[None]
        v = gather_context(v_cache, block_tables[i], length).transpose(0, 1)[None]
        qi = q[start:end].transpose(0, 1)[None]
        if q_len == length:
            o = _sdpa(qi, k, v, None, True, scale)
        else:
            offset = length - q_len
            rows_pos = torch.arange(q_len, device=q.device)[:, None] + offset
            mask = torch.arange(length, device=q.device)[None, :] <= rows_pos
            o = _sdpa(qi, k, v, mask, False, scale)
        out[start:end] = o[0].transpose(0, 1)


def decode_mask(lens: torch.Tensor, padded_len: int) -> torch.Tensor:
    """`[B, 1, 1, padded_len]` True where a position is inside its sequence (built once per step, used per layer)."""
    return (torch.arange(padded_len, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: q `[B, H, D]` over the blocks named in `block_tables` `[B, n_blocks]` of a
    `[num_blocks, block_size, kv_heads, head_dim]` K and V cache; `mask` from `decode_mask`. Returns `[B, H, D]`."""
    b, n_blocks = block_tables.shape
    _, block_size, kv_heads, dim = k_cache.shape
    ids = block_tables.reshape(-1)
    k = k_cache.index_select(0, ids).view(b, n_blocks * block_size, kv_heads, dim).transpose(1, 2)
    v = v_cache.index_select(0, ids).view(b, n_blocks * block_size, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != kv_heads
    )
    return out.squeeze(2)
