"""The one place that decides whether a request can ever run on an engine (every worker role asks it)."""

from __future__ import annotations

from typing import Sequence

from engine.sampling_params import SamplingParams


def check_request(token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  pool_tokens: int) -> None:
    """ValueError, naming what is wrong, for a request that no amount of waiting would let run."""
    params.validate(vocab_size)
    if not token_ids:
        raise ValueError("prompt is empty")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt has token ids outside [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens; the model context is {max_model_len}")
    if len(token_ids) + 1 > pool_tokens:
        raise ValueError(f"prompt has {len(token_ids)} tokens; the KV pool holds {pool_tokens}")
