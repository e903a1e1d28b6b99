"""The one place that decides whether a request can ever run on an engine (every worker role asks it)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.errors import InvalidParameter
from pdserve.engine.sampling_params import SamplingParams


def check_request(
    token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    pool_tokens: int,
    new_tokens: int | None = None,
    num_prompt_tokens: int | None = None,
) -> None:
    """ValueError, naming what is wrong, for a request that no amount of waiting would let run: its prompt
    plus `max_tokens` must fit the model's context and, since one sequence may hold the whole pool, the pool.
    `new_tokens` is how many tokens this engine will add (a prefill worker: 1); default what `max_tokens`
    leaves. `num_prompt_tokens` below `len(token_ids)`: the rest were generated already (a moved stream)."""
    params.validate(vocab_size)
    if not token_ids:
        raise InvalidParameter("prompt", "prompt is empty")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidParameter("prompt", f"prompt has token ids outside [0, {vocab_size})")
    n = len(token_ids)
    prompt = n if num_prompt_tokens is None else num_prompt_tokens
    if not 0 < prompt <= n:
        raise InvalidParameter("num_prompt_tokens", f"num_prompt_tokens must be in [1, {n}] (the tokens given)")
    done = n - prompt
    if done >= params.max_tokens:
        raise InvalidParameter(
            "num_prompt_tokens", f"{done} tokens generated already: nothing is left of max_tokens {params.max_tokens}"
        )
    if n >= max_model_len:
        raise InvalidParameter("prompt", f"prompt has {n} tokens; the model context is {max_model_len}")
    if prompt + params.max_tokens > max_model_len:
        raise InvalidParameter(
            "max_tokens",
            f"max_tokens {params.max_tokens} + prompt {prompt} tokens exceeds the model context "
            f"({max_model_len} tokens)",
        )
    grow = params.max_tokens - done if new_tokens is None else new_tokens
    if n + grow > pool_tokens:
        raise InvalidParameter(
            "max_tokens",
            f"{'max_tokens' if new_tokens is None else 'new tokens'} {grow} + "
            f"prompt {n} tokens exceeds this worker's KV pool ({pool_tokens} tokens)",
        )
