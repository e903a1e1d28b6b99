"""Turning a batch of logits into next tokens: penalties, temperature, top-k / top-p / min-p, seeded draws.

The whole batch is sampled with batched tensor ops. Greedy rows take an argmax; the others are drawn by inverse
CDF with one uniform number per row: a seeded request draws it from a generator seeded by (seed, output
position), so its tokens depend only on the logits it sees, never on which other requests share the batch or
which worker (prefill or decode) samples. Rows with top-k work on their top k candidates; top-p without top-k is
drawn by rejection over the whole vocabulary (no sort: see `_draw_nucleus`). A temperature below 1e-5 is greedy,
as in vLLM. A row whose logits are not finite fails alone (`SamplingError` in its place), never the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.engine.errors import SamplingError
from pdserve.engine.grammar import GrammarState, allowed_tokens
from pdserve.engine.sampling_params import SampleOutput, SamplingParams


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """One row, OpenAI/vLLM semantics: repetition over prompt+output, presence/frequency over output only."""
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        ids = [t for t in (*prompt_ids, *output_ids) if t < vocab]
        seen[torch.as_tensor(ids, dtype=torch.long, device=logits.device)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        out_ids = torch.as_tensor([t for t in output_ids if t < vocab], dtype=torch.long, device=logits.device)
        counts = torch.bincount(out_ids, minlength=vocab).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def candidate_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Boolean mask of the tokens that survive top-k, then top-p (on the renormalised rest), then min-p: the
    definition the batched sampler implements (kept as the reference its tests compare against)."""
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


Argmax = Callable[[torch.Tensor], tuple[list[int], set[int]] | None]
"""A kernel for greedy rows: logits `[N, V]` -> (each row's first maximum, the rows whose maximum is not finite),
or None where it does not take these logits."""


def _is_greedy(p: SamplingParams) -> bool:
    return p.greedy


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (), argmax: Argmax | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.argmax = argmax
        self._rng = torch.Generator()
        self._rng.seed()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        grammars: Sequence[GrammarState | None] = (),
    ) -> list[SampleOutput | SamplingError]:
        """logits `[N, V]`, one row per sequence that samples this step; `token_ids[i]` is row i's sequence so
        far (prompt then output; read, never copied, unless a penalty needs it); `grammars[i]` (if given) row i's
        constraint: tokens it does not allow next are excluded before any choice."""
        logits = logits[:, : self.vocab_size]
        n = len(params)
        constrained = {i: g for i, g in enumerate(grammars) if g is not None}
        if all(
            _is_greedy(p) and not p.has_penalties and p.logprobs is None and p.min_tokens == 0 and not p.logit_bias
            for p in params
        ):
            picked, bad = self._greedy(logits)
            # most steps each grammar takes its row's favourite: one check, no mask
            refused = [i for i, g in constrained.items() if i not in bad and not g.allows(picked[i])]
            if refused:
                allowed = self._allowed([constrained[i] for i in refused], logits.shape[-1])
                masked = logits[refused].float().masked_fill(~allowed, float("-inf"))
                best = masked.argmax(-1)
                finite = torch.isfinite(masked.gather(1, best[:, None]))[:, 0].tolist()
                for i, token, ok in zip(refused, best.tolist(), finite):
                    picked[i] = token
                    if not ok:
                        bad = bad | {i}
            return [
                SamplingError("the model's logits are not finite, or every token was excluded")
                if i in bad
                else SampleOutput(t)
                for i, t in enumerate(picked)
            ]
        raw = logits.float()
        x = raw
        for i, p in enumerate(params):
            outputs = token_ids[i][num_prompt_tokens[i] :]
            if p.has_penalties:
                x = x.clone() if x is raw else x
                x[i] = apply_penalties(x[i], p, token_ids[i][: num_prompt_tokens[i]], outputs)
            if p.logit_bias:
                x = x.clone() if x is raw else x
                ids = [t for t, _ in p.logit_bias if t < x.shape[-1]]
                x[i, ids] += torch.tensor([b for t, b in p.logit_bias if t < x.shape[-1]], dtype=x.dtype)
            if len(outputs) < p.min_tokens:
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < x.shape[-1]]
                if banned:
                    x = x.clone() if x is raw else x
                    x[i, banned] = float("-inf")
        if constrained:
            x = x.clone() if x is raw else x
            allowed = self._allowed(list(constrained.values()), x.shape[-1]).to(x.device)
            for k, i in enumerate(constrained):
                x[i].masked_fill_(~allowed[k], float("-inf"))
        bad = self._nonfinite_rows(x)
        greedy = [i for i, p in enumerate(params) if _is_greedy(p) and i not in bad]
        drawn = [i for i, p in enumerate(params) if not _is_greedy(p) and i not in bad]
        chosen = torch.zeros(n, dtype=torch.long, device=x.device)
        if greedy:
            chosen[greedy] = x[greedy].argmax(-1)
        if drawn:
            rows = x if len(drawn) == n else x[drawn]
            chosen[drawn] = self._draw(
                rows, [params[i] for i in drawn], [len(token_ids[i]) - num_prompt_tokens[i] for i in drawn]
            )
        tokens = chosen.tolist()
        out: list[SampleOutput | SamplingError] = []
        wants = [i for i, p in enumerate(params) if p.logprobs is not None and i not in bad]
        logprobs = raw[wants].log_softmax(-1) if wants else None
        for i in range(n):
            if i in bad:
                out.append(SamplingError("the model's logits are not finite, or every token was excluded"))
                continue
            sample = SampleOutput(tokens[i])
            if logprobs is not None and i in wants:
                row = logprobs[wants.index(i)]
                sample.logprob = float(row[tokens[i]])
                n_top = params[i].logprobs
                if n_top:
                    top = row.topk(n_top)
                    sample.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
            out.append(sample)
        return out

    def _greedy(self, logits: torch.Tensor) -> tuple[list[int], set[int]]:
        """Each row's argmax and the rows whose logits are not finite: by the `argmax` kernel where it takes these
        logits, else by torch."""
        fast = self.argmax(logits) if self.argmax is not None else None
        if fast is not None:
            return fast
        exact = logits.float()  # bf16 -> fp32 is exact; argmax over bf16 on CPU measured 5x slower than both
        return exact.argmax(-1).tolist(), self._nonfinite_rows(exact)

    @staticmethod
    def _allowed(grammars: Sequence[GrammarState], vocab: int) -> torch.Tensor:
        """Bool `[R, vocab]`: the tokens each grammar allows next."""
        return torch.from_numpy(allowed_tokens(grammars, vocab))

    @staticmethod
    def _nonfinite_rows(x: torch.Tensor) -> set[int]:
        """Rows with a NaN or +inf, or with no finite value at all: the rows whose maximum is not finite."""
        broken = ~torch.isfinite(x.amax(-1))
        return set(torch.nonzero(broken).flatten().tolist()) if bool(broken.any()) else set()

    def _draw(self, x: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
        """Sampled token ids for rows of logits `x` `[S, V]` (no greedy rows among them)."""
        vocab = x.shape[-1]
        temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
        z = x / temp[:, None]
        uniforms = _Uniforms(params, steps, self._rng, x.device, x.dtype)
        chosen = torch.empty(len(params), dtype=torch.long, device=x.device)
        whole = [i for i, p in enumerate(params) if not 0 < p.top_k < vocab]
        if whole:
            rows = z if len(whole) == len(params) else z[whole]
            chosen[whole] = _draw_nucleus(rows, [params[i] for i in whole], uniforms.view(whole))
        ranked = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
        if ranked:
            k = max(params[i].top_k for i in ranked)
            chosen[ranked] = _draw_ranked(z[ranked], [params[i] for i in ranked], uniforms.view(ranked).next(), k)
        return chosen


class _Uniforms:
    """Uniform numbers for a step's drawn rows: a seeded row's come from a generator seeded by (seed, output
    position), so they do not depend on the batch; the others' from the sampler's own generator."""

    def __init__(
        self,
        params: list[SamplingParams],
        steps: list[int],
        rng: torch.Generator,
        device: torch.device,
        dtype: torch.dtype,
        index: list[int] | None = None,
        gens: dict[int, torch.Generator] | None = None,
    ) -> None:
        self.params, self.steps, self.rng, self.device, self.dtype = params, steps, rng, device, dtype
        self.index = index if index is not None else list(range(len(params)))
        self.gens = gens if gens is not None else {}

    def view(self, rows: list[int]) -> _Uniforms:
        """The same streams, for a subset of rows (positions into this view)."""
        return _Uniforms(
            self.params, self.steps, self.rng, self.device, self.dtype, [self.index[r] for r in rows], self.gens
        )

    def next(self, rows: list[int] | None = None) -> torch.Tensor:
        """The next uniform of each row (of `rows`, positions into this view; default all)."""
        picked = [self.index[r] for r in rows] if rows is not None else self.index
        free = torch.rand(len(picked), generator=self.rng)
        values = []
        for n, row in enumerate(picked):
            p = self.params[row]
            if p.seed is None:
                values.append(float(free[n]))
                continue
            gen = self.gens.get(row)
            if gen is None:
                gen = self.gens[row] = torch.Generator()
                gen.manual_seed((p.seed * 0x9E3779B97F4A7C15 + self.steps[row]) % (2**63))
            values.append(float(torch.rand((), generator=gen)))
        return torch.tensor(values, dtype=self.dtype, device=self.device)


MAX_ROUNDS = 16


def _draw_nucleus(z: torch.Tensor, params: list[SamplingParams], uniforms: _Uniforms) -> torch.Tensor:
    """Rows without top-k: top-p, then min-p, over the whole vocabulary, without sorting it.

    A token is in the nucleus exactly when the tokens strictly more probable than it hold less than top_p of the
    mass. Draw a token among the candidates; keep it if it is in the nucleus, else it and every less probable
    token are out, so draw again among the more probable ones. The accepted draw follows the nucleus
    distribution exactly, and costs a few vectorised passes over the vocabulary where a sort of 32 rows of 49k
    logits took 44 ms on this project's 2-core machine.
    """
    probs = z.softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
    weights = probs * (probs >= min_p[:, None] * probs.amax(-1, keepdim=True)) if bool((min_p > 0).any()) else probs
    chosen = torch.empty(len(params), dtype=torch.long, device=probs.device)
    floor = torch.zeros(len(params), dtype=probs.dtype, device=probs.device)
    active = list(range(len(params)))
    for round_ in range(MAX_ROUNDS):
        if round_ == 0:  # every row, every candidate: no copies
            p_active, candidates = probs, weights
        else:
            p_active = probs[active]
            candidates = weights[active].masked_fill_(p_active <= floor[active, None], 0.0)
        t = _inverse_cdf(candidates, uniforms.next(active))
        p_t = p_active.gather(1, t[:, None])
        above = p_active.masked_fill(p_active <= p_t, 0.0).sum(-1)
        ok = ((top_p[active] >= 1.0) | (above < top_p[active])).tolist()
        for n, row in enumerate(active):
            if ok[n]:
                chosen[row] = t[n]
            else:
                floor[row] = p_t[n, 0]
        active = [row for n, row in enumerate(active) if not ok[n]]
        if not active:
            return chosen
    for row in active:  # exceedingly rare: the exact definition, by sorting
        chosen[row] = _draw_ranked(z[row : row + 1], [params[row]], uniforms.next([row]), z.shape[-1])[0]
    return chosen


CDF_CHUNK = 256


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index of each row's draw from the unnormalised `weights` `[R, V]` with uniforms `u` `[R]`.

    In two levels over a large vocabulary: the cumulative sums of chunk totals pick the chunk, then one chunk's
    cumulative sum picks the token (a full-row cumsum was most of a sampled step's cost)."""
    rows, vocab = weights.shape
    n_full = vocab // CDF_CHUNK
    if n_full < 4:
        cdf = weights.cumsum(-1)
        pick = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)
        return _nonzero_pick(weights, pick.clamp_(max=vocab - 1)).squeeze(1)
    sums = weights[:, : n_full * CDF_CHUNK].reshape(rows, n_full, CDF_CHUNK).sum(-1)
    if n_full * CDF_CHUNK < vocab:
        sums = torch.cat([sums, weights[:, n_full * CDF_CHUNK :].sum(-1, keepdim=True)], 1)
    coarse = sums.cumsum(-1)
    target = (u[:, None] * coarse[:, -1:]).contiguous()
    chunk = torch.searchsorted(coarse, target, right=True).clamp_(max=coarse.shape[1] - 1)
    base = torch.where(chunk > 0, coarse.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    cols = chunk * CDF_CHUNK + torch.arange(CDF_CHUNK, device=weights.device)
    local = weights.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
    pick = torch.searchsorted(base + local.cumsum(-1), target, right=True).clamp_(max=CDF_CHUNK - 1)
    return _nonzero_pick(weights, (chunk * CDF_CHUNK + pick).clamp_(max=vocab - 1)).squeeze(1)


def _nonzero_pick(weights: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """`pick` `[R, 1]`, moved off a zero-weight token (where rounding left a target at the very end of a sum)
    to the nearest token with weight before it, or else after it."""
    empty = weights.gather(1, pick) == 0
    if bool(empty.any()):
        for row in torch.nonzero(empty[:, 0]).flatten().tolist():
            have = torch.nonzero(weights[row]).flatten()
            before = have[have <= pick[row, 0]]
            pick[row, 0] = before.max() if before.numel() else have.min()
    return pick


def _draw_ranked(z: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, k: int) -> torch.Tensor:
    """Draw among each row's top `k` scaled logits, applying its own top-k, then top-p on the renormalised rest,
    then min-p."""
    vocab = z.shape[-1]
    device, dtype = z.device, z.dtype
    vals, idx = z.sort(-1, descending=True) if k >= vocab else torch.topk(z, k, dim=-1)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    rank = torch.arange(vals.shape[-1], device=device)[None, :]
    in_top_k = rank < top_k[:, None]
    probs = vals.masked_fill(~in_top_k, float("-inf")).softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=dtype, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=dtype, device=device)
    before = probs.cumsum(-1) - probs
    keep = in_top_k & ((before < top_p[:, None]) | (rank == 0)) & (probs >= min_p[:, None] * probs[:, :1])
    pick = _inverse_cdf(probs * keep, u)
    return idx.gather(1, pick[:, None]).squeeze(1)
