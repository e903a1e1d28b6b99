"""How long queued prompts will take to prefill: fixed cost per step + cost per token + cost per attention pair.

A ratio of tokens to step seconds, learned from whatever steps ran, says nothing about the next burst: a 1-token
warm-up step is nearly all fixed cost, so the ratio came out a few tokens per second and 138 queued tokens looked
like 45 s of work. Here each step is one observation of `seconds = fixed_s + token_s * tokens + pair_s * pairs`
(pairs: the query-key pairs of the chunks' causal attention, as the planner's step-cost model counts them), fitted
by non-negative least squares on relative error, recent steps weighing most (a neighbour's load comes and goes).
A prior (pseudo-steps from the model's FLOPs, never forgotten, weighing a thousandth of one measured step) is the
whole answer before any step ran and decides only what the measured steps cannot tell apart: with only 1-token
steps seen, their cost is split between fixed and per-token cost as the prior splits it, not all put on one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

Chunk = tuple[int, int]  # (tokens computed in the step, tokens of the sequence already in the cache before them)

PRIOR_FLOPS = 20e9  # FLOP/s the prior assumes: a 2-core CPU's order of magnitude (measured steps replace it)
PRIOR_FIXED_S = 0.01  # seconds a step costs beyond its tokens, before any step was measured
PRIOR_STEPS = 1e-3  # how many measured steps the prior weighs as: enough to break ties, too little to bias
PRIOR_SHAPES = (1, 64, 512, 2048)  # the prompt lengths its pseudo-steps have
DECAY = 0.9  # per measured step: the fit follows about the last 10 (a busier machine shows within a few dozen)


def features(chunks: Iterable[Chunk]) -> np.ndarray:
    """(1, tokens, attention pairs) of one step that computes `chunks`."""
    tokens = pairs = 0.0
    for n, start in chunks:
        tokens += n
        pairs += n * (start + (n + 1) / 2)
    return np.array([1.0, tokens, pairs])


@dataclass
class PrefillTime:
    """Online fit of step seconds; `token_flops`: FLOPs one prompt token costs (2 x parameters), for the prior."""

    token_flops: float
    max_step_tokens: int = 2048
    _a: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _b: np.ndarray = field(default_factory=lambda: np.zeros(3))
    _prior_a: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _prior_b: np.ndarray = field(default_factory=lambda: np.zeros(3))
    steps: int = 0
    _coef: tuple[float, float, float] | None = None  # solved when asked for, not on every step

    def __post_init__(self) -> None:
        prior = np.array([PRIOR_FIXED_S, self.token_flops / PRIOR_FLOPS, 0.0])
        for n in PRIOR_SHAPES:
            x = features([(n, 0)])
            self._add(self._prior_a, self._prior_b, x, float(x @ prior), PRIOR_STEPS / len(PRIOR_SHAPES))

    @property
    def coef(self) -> tuple[float, float, float]:
        """(fixed s, s per token, s per attention pair) as fitted so far."""
        if self._coef is None:
            self._coef = self._solve()
        return self._coef

    @coef.setter
    def coef(self, value: tuple[float, float, float]) -> None:
        self._coef = value

    @staticmethod
    def _add(a: np.ndarray, b: np.ndarray, x: np.ndarray, seconds: float, weight: float) -> None:
        w = weight / seconds**2  # relative error: a 10 ms step counts as much as a 2 s one
        a += w * np.outer(x, x)
        b += w * seconds * x

    def observe(self, chunks: Iterable[Chunk], seconds: float) -> None:
        """One step ran `chunks` in `seconds`."""
        x = features(chunks)
        if x[1] <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        self._a *= DECAY
        self._b *= DECAY
        self._add(self._a, self._b, x, seconds, 1.0)
        self.steps += 1
        self._coef = None

    def _solve(self) -> tuple[float, float, float]:
        """Non-negative least squares over three coefficients: the best of every subset's unconstrained fit that
        comes out non-negative (eight subsets: cheaper than an iterative solver, and exact)."""
        a, b = self._a + self._prior_a, self._b + self._prior_b
        scale = np.sqrt(np.maximum(np.diag(a), 1e-300))
        a_s, b_s = a / np.outer(scale, scale), b / scale
        best, best_loss = np.zeros(3), 0.0  # all zero: loss relative to it is 0
        for k in (1, 2, 3):
            for subset in itertools.combinations(range(3), k):
                idx = list(subset)
                sol = np.linalg.lstsq(a_s[np.ix_(idx, idx)], b_s[idx], rcond=None)[0]
                if (sol < 0).any():
                    continue
                theta = np.zeros(3)
                theta[idx] = sol
                loss = float(theta @ a_s @ theta - 2 * theta @ b_s)  # residual up to a constant
                if loss < best_loss:
                    best, best_loss = theta, loss
        coef = best / scale
        return float(coef[0]), float(coef[1]), float(coef[2])

    def step_seconds(self, chunks: Iterable[Chunk]) -> float:
        return float(features(chunks) @ np.array(self.coef))

    def backlog_seconds(self, pending: Iterable[Chunk]) -> float:
        """Seconds until the last of `pending` (tokens still to compute, tokens already cached) is computed: its
        tokens and pairs, plus a step's fixed cost for every `max_step_tokens` they fill."""
        x = features(pending)
        if x[1] <= 0:
            return 0.0
        fixed, per_token, per_pair = self.coef
        steps = math.ceil(x[1] / max(self.max_step_tokens, 1))
        return fixed * steps + per_token * x[1] + per_pair * x[2]
