"""Speculative decoding: guess a sequence's next tokens, by prompt lookup or a draft model, check them in one step.

Decode on a CPU reads every weight once per step whatever the number of rows, so a step that checks a few guessed
tokens of a sequence costs about what a step of one token costs. The guesses come from n-gram lookup (vLLM's
"ngram", the prompt-lookup method): the last n tokens (n from `MAX_NGRAM` down to `MIN_NGRAM`) are looked up in the
sequence's earlier text, prompt and output, and the tokens that followed their latest earlier occurrence are
proposed. Where the worker has a draft model (`engine.draft_model`: the served model with cheaper weights), it
guesses for the sequences that lookup finds nothing for, greedily, one forward per guess; the draft proposes a
single token per position too, so everything below holds for its guesses as well.

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

import bisect
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
class Guesser:
    """How one way of guessing has done for one sequence, and how many tokens it guesses next: after a step whose
    guesses were all kept two more, after a refusal one more than were kept, never more than `max_tokens`."""

    max_tokens: int
    k: int = 0
    proposed: int = 0
    accepted: int = 0
    refused: int = 0  # steps whose run of guesses ended at a guess its row did not pick

    def __post_init__(self) -> None:
        self.k = self.k or self.max_tokens

    def settle(self, guessed: int, kept: int) -> None:
        if guessed:
            self.proposed += guessed
            self.accepted += kept
            self.refused += kept < guessed
            self.k = min(self.max_tokens, self.k + 2) if kept == guessed else kept + 1

    @property
    def acceptance(self) -> float:
        """The estimated chance that a guess is kept when every guess before it was (Laplace's rule of succession
        over this sequence's checks so far)."""
        return (self.accepted + 1) / (self.accepted + self.refused + 2)


TO_DRAFT = -1  # a guess the draft model is still to make (`engine.draft_model`), in the step being run


@dataclass
class Speculation:
    """One sequence's speculation: its lookup index, how its two ways of guessing have done, and what it has guessed.
    With a draft model (`drafts`) the model guesses where lookup finds nothing, or where its guesses are expected to
    make more tokens per step time than lookup's (`propose`)."""

    max_tokens: int  # the request's speculative_tokens
    drafts: bool = False
    index: NgramIndex = field(default_factory=NgramIndex)
    draft: list[int] = field(default_factory=list)  # the guesses the step in flight checks
    lookup: Guesser = field(init=False)
    model: Guesser = field(init=False)
    source: Guesser | None = None  # which of the two guessed `draft`

    def __post_init__(self) -> None:
        self.lookup = Guesser(self.max_tokens)
        self.model = Guesser(self.max_tokens)

    def propose(self, tokens: list[int], room: int, draft_price: float = 0.0) -> list[int]:
        """Guesses to follow `tokens`, at most `room` of them (what max_tokens and the context leave); the draft
        model's are `TO_DRAFT` until it runs. Where lookup finds some, the draft model guesses instead only if its
        guesses are expected to make more tokens per step time: each costs a draft forward, `draft_price` of a
        one-row step (0 while unmeasured), where lookup's are free but for their rows."""
        found = self.index.propose(tokens, min(self.lookup.k, room))
        drafted = min(self.model.k, room) if self.drafts else 0
        if found and drafted:
            by_lookup = _expected(self.lookup.acceptance, len(found))
            if _expected(self.model.acceptance, drafted) / (1 + drafted * draft_price) <= by_lookup:
                drafted = 0
        if drafted:
            self.draft, self.source = [TO_DRAFT] * drafted, self.model
        elif found:
            self.draft, self.source = found, self.lookup
        else:
            self.draft, self.source = [], None
        return self.draft

    @property
    def to_draft(self) -> bool:
        """Its guesses in this step are the draft model's to make."""
        return self.source is self.model and bool(self.draft)

    def settle(self, kept: int) -> None:
        """The step in flight kept `kept` of its guesses: count them and size the next guess."""
        (self.source or self.lookup).settle(len(self.draft), kept)
        self.draft, self.source = [], None

    @property
    def acceptance(self) -> float:
        """The chance of a guess in flight (by whichever guessed it) being kept, when the ones before it were."""
        return (self.source or self.lookup).acceptance

    @property
    def proposed(self) -> int:
        return self.lookup.proposed + self.model.proposed

    @property
    def accepted(self) -> int:
        return self.lookup.accepted + self.model.accepted


def _expected(acceptance: float, guesses: int) -> float:
    """Tokens a step gives a sequence with `guesses` guesses each kept with `acceptance` after the ones before."""
    return sum(acceptance**j for j in range(guesses + 1))


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
        return _Costs(self.known())(rows)


class _Costs:
    """`StepCost.estimate` over one copy of what it knows, for the many row counts a step weighs (sorted once)."""

    def __init__(self, known: dict[int, float]) -> None:
        self.known = known
        self.rows = sorted(known)

    def __call__(self, rows: int) -> float | None:
        known, keys = self.known, self.rows
        if rows in known:
            return known[rows]
        i = bisect.bisect(keys, rows)
        if i == 0:
            return known[keys[0]] if keys else None
        if i == len(keys):
            return known[keys[-1]]
        below, above = keys[i - 1], keys[i]
        return known[below] + (known[above] - known[below]) * (rows - below) / (above - below)


def worth_checking(
    base_rows: int,
    chances: Sequence[float],
    cost: StepCost,
    depths: Sequence[int] = (),
    draft_cost: StepCost | None = None,
) -> int:
    """How many of the guess rows (their chances of being kept, best first) a step of `base_rows` rows should
    check: the number that maximises expected tokens per second by `cost`'s estimates; all of them while nothing
    is measured. `depths`, beside `chances`: 0 for a guess already made, j for the j-th guess a draft model is to
    make for its sequence; the draft model runs one forward per depth over the sequences guessing that deep, at
    what `draft_cost` says a forward of that many rows costs."""
    step = _Costs(cost.known())  # one copy for every row count this step weighs
    first = step(base_rows)
    if first is None:
        return len(chances)
    draft = _Costs(draft_cost.known() if draft_cost is not None else {})
    forward = [0.0]  # a draft forward's seconds by its rows, as far as needed
    at_depth: dict[int, int] = {}
    best, best_rate, expected, drafting = 0, base_rows / first, float(base_rows), 0.0
    for n, chance in enumerate(chances, 1):
        expected += chance
        depth = depths[n - 1] if depths else 0
        if depth:
            rows = at_depth[depth] = at_depth.get(depth, 0) + 1
            if rows == len(forward):
                forward.append(draft(rows) or 0.0)
            drafting += forward[rows] - forward[rows - 1]
        seconds = (step(base_rows + n) or first) + drafting
        if expected / seconds > best_rate:
            best, best_rate = n, expected / seconds
    return best
