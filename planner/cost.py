"""What one engine step costs, as a function of what it computes, fitted to measured steps.

A step runs prefill chunks and decode rows together (colocated), prefill chunks alone (a prefill worker) or decode
rows alone (a decode worker); one model covers all three, so a profile taken on one engine predicts every role.
The linear layers' cost follows the tokens in the forward, but not in a straight line (a CPU kernel changes its
blocking with the row count; a GPU is flat until it is compute-bound): it is piecewise linear between measured
token counts (`knots`). On top come terms linear in sequences sampled, KV positions a decode row's attention
reads, and query-key pairs of a prefill chunk's causal attention.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepShape:
    """What one step computes: prefill chunks as (chunk tokens, tokens already in the cache before it), and the
    context length of each decode row."""

    chunks: tuple[tuple[int, int], ...] = ()
    contexts: tuple[int, ...] = ()

    def features(self) -> tuple[float, float, float, float]:
        """(tokens in the forward, sequences, decode context, prefill attention pairs)."""
        tokens = sum(n for n, _ in self.chunks) + len(self.contexts)
        seqs = len(self.chunks) + len(self.contexts)
        context = float(sum(self.contexts))
        pairs = float(sum(n * (start + (n + 1) / 2) for n, start in self.chunks))
        return float(tokens), float(seqs), context, pairs


@dataclass(frozen=True)
class StepCost:
    """Seconds = tokens_s(tokens) + seq_s*sequences + context_s*decode context + pair_s*attention pairs, where
    tokens_s interpolates `at_knots` between `knots` (and extends the last segment beyond them)."""

    knots: tuple[float, ...]
    at_knots: tuple[float, ...]
    seq_s: float
    context_s: float
    pair_s: float

    def tokens_s(self, tokens: float) -> float:
        k, v = self.knots, self.at_knots
        if len(k) == 1:
            return v[0] * tokens / k[0]
        i = min(max(bisect_right(k, tokens) - 1, 0), len(k) - 2)
        return v[i] + (v[i + 1] - v[i]) * (tokens - k[i]) / (k[i + 1] - k[i])

    def seconds(self, tokens: float, seqs: float, context: float, pairs: float) -> float:
        return self.tokens_s(tokens) + self.seq_s * seqs + self.context_s * context + self.pair_s * pairs

    def of(self, shape: StepShape) -> float:
        return self.seconds(*shape.features())

    def to_dict(self) -> dict:
        return {
            "knots": list(self.knots),
            "at_knots": list(self.at_knots),
            "seq_s": self.seq_s,
            "context_s": self.context_s,
            "pair_s": self.pair_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> StepCost:
        return cls(
            tuple(float(x) for x in d["knots"]),
            tuple(float(x) for x in d["at_knots"]),
            float(d["seq_s"]),
            float(d["context_s"]),
            float(d["pair_s"]),
        )


def _hats(knots: Sequence[float], tokens: float) -> list[float]:
    """The piecewise-linear basis at `tokens`: the weights of the two knots around it (extending the last span)."""
    out = [0.0] * len(knots)
    if len(knots) == 1:
        out[0] = tokens / knots[0]
        return out
    i = min(max(bisect_right(knots, tokens) - 1, 0), len(knots) - 2)
    w = (tokens - knots[i]) / (knots[i + 1] - knots[i])
    out[i], out[i + 1] = 1 - w, w
    return out


def fit(shapes: Sequence[StepShape], seconds: Sequence[float], knots: Sequence[float] | None = None) -> StepCost:
    """Non-negative least squares on relative error (a 2 ms decode step counts as much as a 2 s prefill): no
    coefficient is negative, so the model never predicts a step that gets cheaper with more work. Knots default to
    the distinct token counts measured (powers of two when those are too many to fit)."""
    feats = [s.features() for s in shapes]
    if knots is None:
        knots = sorted({f[0] for f in feats})
        if len(knots) > len(feats) // 2:  # too many to fit: powers of two across the range
            top = max(knots)
            knots = [float(2**i) for i in range(int(np.log2(max(top, 1))) + 2) if 2**i <= 2 * top]
    knots = sorted(set(knots))
    x = np.array([[*_hats(knots, f[0]), f[1], f[2], f[3]] for f in feats], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    width = x.shape[1]
    if len(y) < width:
        raise ValueError(f"fitting {width} coefficients needs at least as many measured steps")
    weight = 1.0 / y
    active = list(range(width))
    coef = np.zeros(width)
    while active:
        scale = np.abs(x[:, active]).max(axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(x[:, active] / scale * weight[:, None], y * weight, rcond=None)
        sol /= scale
        if (sol >= -1e-15).all():
            coef[:] = 0
            coef[active] = np.maximum(sol, 0)
            break
        active.pop(int(np.argmin(sol)))  # drop the most negative and fit the rest again
    n = len(knots)
    return StepCost(tuple(knots), tuple(float(c) for c in coef[:n]), *(float(c) for c in coef[n:]))


def relative_errors(cost: StepCost, shapes: Sequence[StepShape], seconds: Sequence[float]) -> list[float]:
    return [abs(cost.of(s) - t) / t for s, t in zip(shapes, seconds)]
