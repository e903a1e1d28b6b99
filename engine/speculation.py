"""Speculative decoding by prompt lookup: guess a sequence's next tokens from its own text, check them in one step.

Decode on a CPU reads every weight once per step whatever the number of rows, so a step that checks a few guessed
tokens of a sequence costs about what a step of one token costs. The guesses come from n-gram lookup (vLLM's
"ngram", the prompt-lookup method): the last n tokens (n from `MAX_NGRAM` down to `MIN_NGRAM`) are looked up in the
sequence's earlier text, prompt and output, and the tokens that followed their latest earlier occurrence are
proposed. No second model runs.

The step then has one row per guessed position (the model runner gives each its own query over the sequence's
blocks), and the sampler picks a token at every row exactly as it would without speculation: row j sees the
sequence with the first j guesses appended, draws with the uniform of output position `len + j`. The guesses
are taken while each equals the token its row picked; the first row that disagrees contributes its own pick and
ends the run. A guess is a single token, so this is rejection sampling with a one-point proposal: a guess is
kept with exactly the probability the model gives it, and a refused one is replaced by a draw from the model's
distribution without it. The tokens are distributed exactly as without speculation, and with a seed they are the
same tokens, as far as the logits of a row repeat those of a one-token step.

How many guesses a step checks is decided twice. Per sequence: after a step whose guesses were all kept the next
proposal may be two longer, after a refusal it is one longer than were kept, never more than the request's
`speculative_tokens`. Per step: a guess row is not free once a step is bound by its arithmetic rather than by reading
the weights (on a 2-core Zen 4, bf16, one row costs 11.5 ms, 8 rows 14.5 ms, 16 rows 25 ms), so the step keeps the
guesses that maximise expected tokens per second: guess j of a sequence is kept with its estimated chance
`acceptance ** j`, and a step's cost by its rows is what such steps measured on this machine (`StepCost`). And
the rows stay within the step's span of row counts whose arithmetic per row is the same (`ModelRunner.rows_beside`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_NGRAM = 4
MIN_NGRAM = 2  # a one-token match guesses wrong too often to pay for its rows
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class NgramIndex:
    """For n in [MIN_NGRAM, MAX_NGRAM], where each n-gram of a token list last ended (the index just past it).
    Grows with the list; `propose` never matches the list's own final n-gram against itself."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # tokens of the list seen so far

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram that ends before the list's last token (the last one is what `propose` looks up)."""
        for end in range(max(self.indexed, MIN_NGRAM), len(tokens)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` found."""
        if k <= 0 or len(tokens) < MIN_NGRAM + 1:
            return []
        self.extend(tokens)
        for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []


@dataclass
class Speculation:
    """One sequence's speculation: its lookup index, how many tokens to guess next, and what it has guessed."""

    max_tokens: int  # the request's speculative_tokens
    k: int = 0  # guesses for the next step
    index: NgramIndex = field(default_factory=NgramIndex)
    draft: list[int] = field(default_factory=list)  # the guesses the step in flight checks
    proposed: int = 0
    accepted: int = 0
    refused: int = 0  # steps whose run of guesses ended at a guess its row did not pick

    def __post_init__(self) -> None:
        self.k = self.k or self.max_tokens

    def propose(self, tokens: list[int], room: int) -> list[int]:
        """Guesses to follow `tokens`, at most `room` of them (what max_tokens and the context leave)."""
        self.draft = self.index.propose(tokens, min(self.k, room))
        return self.draft

    def settle(self, kept: int) -> None:
        """The step in flight kept `kept` of its guesses: count them and size the next guess."""
        guessed = len(self.draft)
        if guessed:
            self.proposed += guessed
            self.accepted += kept
            self.refused += kept < guessed
            self.k = min(self.max_tokens, self.k + 2) if kept == guessed else kept + 1
        self.draft = []

    @property
    def acceptance(self) -> float:
        """The estimated chance that a guess is kept when every guess before it was (Laplace's rule of succession
        over this sequence's checks so far)."""
        return (self.accepted + 1) / (self.accepted + self.refused + 2)


class StepCost:
    """What a decode step (one token per row) costs by its number of rows on this machine: the least of the last
    `window` steps of each row count, filled in by the steps that run. Row counts not measured yet read as the nearest
    measured below them (so that a larger step gets tried, and then is known) or interpolate between two measured
    ones.

    The least, not an average: a step slowed by a neighbour says nothing about what the rows cost, and a row count
    the estimate makes look dear is seldom run again, so a slow outlier would stick. A low estimate corrects itself
    (that step size runs and is measured), and a machine that stays busier replaces the window within `window`
    steps."""

    def __init__(self, window: int = 8) -> None:
        self._seconds: dict[int, deque[float]] = {}
        self._least: dict[int, float] = {}  # each row count's estimate, kept as steps are observed
        self._window = window
        self._lock = threading.Lock()  # the model thread observes while the scheduler estimates

    def observe(self, rows: int, seconds: float) -> None:
        with self._lock:
            seen = self._seconds.setdefault(rows, deque(maxlen=self._window))
            seen.append(seconds)
            self._least[rows] = min(seen)

    def known(self) -> dict[int, float]:
        """Seconds by row count, of every row count measured (a copy)."""
        with self._lock:
            return dict(self._least)

    def estimate(self, rows: int) -> float | None:
        """Seconds for a step of `rows` rows; None while no step has been measured."""
        return interpolate(self.known(), rows)


def interpolate(known: dict[int, float], rows: int) -> float | None:
    """`StepCost.estimate` over one copy of what it knows."""
    if rows in known:
        return known[rows]
    below = max((r for r in known if r < rows), default=None)
    above = min((r for r in known if r > rows), default=None)
    if below is None:
        return None if above is None else known[above]
    if above is None:
        return known[below]
    return known[below] + (known[above] - known[below]) * (rows - below) / (above - below)


def worth_checking(base_rows: int, chances: Sequence[float], cost: StepCost) -> int:
    """How many of the guess rows (their chances of being kept, best first) a step of `base_rows` rows should
    check: the number that maximises expected tokens per second by `cost`'s estimates; all of them while nothing
    is measured."""
    known = cost.known()  # one copy for every row count this step weighs
    first = interpolate(known, base_rows)
    if first is None:
        return len(chances)
    best, best_rate, expected = 0, base_rows / first, float(base_rows)
    for n, chance in enumerate(chances, 1):
        expected += chance
        seconds = interpolate(known, base_rows + n) or first
        if expected / seconds > best_rate:
            best, best_rate = n, expected / seconds
    return best
