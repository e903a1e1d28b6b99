"""Turning a batch of logits into next tokens: penalties, temperature, top-k / top-p / min-p, seeded draws.

A seeded request draws from a generator seeded by (seed, output position), so its tokens depend only on the
logits it sees, never on which other requests share the batch or which worker (prefill or decode) samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """OpenAI/vLLM semantics: repetition over prompt+output, presence/frequency over output only."""
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.as_tensor(list(prompt_ids) + list(output_ids), dtype=torch.long)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.as_tensor(output_ids, dtype=torch.long), minlength=vocab).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def candidate_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Boolean mask of the tokens that survive top-k, then top-p (on the renormalised rest), then min-p."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        keep &= logits >= kth
    masked = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        probs = masked.softmax(-1)
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        keep &= ~drop
        masked = logits.masked_fill(~keep, float("-inf"))
    if min_p > 0.0:
        probs = masked.softmax(-1)
        keep &= probs >= min_p * probs.max()
    return keep


def _generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + step) % (2**63))
    return g


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._rng = torch.Generator()
        self._rng.seed()

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
               output_ids: Sequence[Sequence[int]]) -> list[SampleOutput]:
        """logits `[B, V]` (fp32), one row per sequence that samples this step."""
        logits = logits[:, : self.vocab_size]
        if all(p.greedy and not p.has_penalties and p.logprobs is None and p.min_tokens == 0 for p in params):
            return [SampleOutput(int(t)) for t in logits.argmax(-1).tolist()]
        logits = logits.float().cpu()  # seeded draws use CPU generators: the same tokens on every device
        return [self._sample_row(logits[i], params[i], prompt_ids[i], output_ids[i]) for i in range(len(params))]

    def _sample_row(self, raw: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> SampleOutput:
        logits = apply_penalties(raw, params, prompt_ids, output_ids) if params.has_penalties else raw
        if len(output_ids) < params.min_tokens:
            banned = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < logits.shape[-1]]
            if banned:
                logits = logits.clone()
                logits[banned] = float("-inf")
        if params.greedy:
            token = int(logits.argmax())
        else:
            scaled = logits / params.temperature
            keep = candidate_mask(scaled, params.top_k, params.top_p, params.min_p)
            probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
            gen = _generator(params.seed, len(output_ids)) if params.seed is not None else self._rng
            token = int(torch.multinomial(probs, 1, generator=gen))
        out = SampleOutput(token)
        if params.logprobs is not None:
            lp = raw.log_softmax(-1)
            out.logprob = float(lp[token])
            if params.logprobs:
                top = lp.topk(params.logprobs)
                out.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        return out
