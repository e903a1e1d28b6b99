"""Attention over the paged KV cache in plain torch: the CPU path and the oracle for the GPU kernels.

Every sequence in a batch contributes `q_len` query tokens (a prompt chunk, or 1 while decoding) that attend to
the first `seq_len` tokens of its context, read through its block table. Decode rows (q_len == 1) are gathered and
run as one padded batch; longer rows run one by one with a causal mask offset by the cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """`[length, kv_heads, head_dim]` of one sequence, from a `[num_blocks, block_size, ...]` K or V cache."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float) -> torch.Tensor:
    """q `[B, H, L, D]`, k/v `[B, KVH, S, D]`."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


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
        _decode_batch(q, kv_layer[0], kv_layer[1], query_start_loc, seq_lens, block_tables, decode_rows, scale, out)
    return out


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                      block_tables: torch.Tensor, rows: list[int], scale: float, out: torch.Tensor) -> None:
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


def _decode_batch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, rows, scale, out) -> None:
    """One padded batched attention for all single-token rows; GQA by grouping query heads (no K/V repeat)."""
    block_size, kv_heads, dim = k_cache.shape[1:]
    lengths = torch.tensor([seq_lens[i] for i in rows], device=q.device)
    max_len = int(lengths.max())
    n_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[rows, :n_blocks]
    b = len(rows)
    ids = table.reshape(-1)  # gather whole blocks as rows: memcpy speed, unlike advanced indexing
    k = k_cache.index_select(0, ids).view(b, -1, kv_heads, dim)[:, :max_len].permute(0, 2, 3, 1)  # [B, KVH, D, L]
    v = v_cache.index_select(0, ids).view(b, -1, kv_heads, dim)[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]
    token_idx = torch.tensor([query_start_loc[i] for i in rows], device=q.device)
    qd = q[token_idx].view(b, kv_heads, -1, dim)  # [B, KVH, G, D]
    scores = torch.matmul(qd, k).float() * scale
    pad = torch.arange(max_len, device=q.device)[None, :] >= lengths[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    out[token_idx] = torch.matmul(probs, v).view(b, -1, dim)
