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

The number of guesses adapts per sequence: after a step whose guesses were all kept it grows by two, after a
refusal it falls to one more than were kept; it never exceeds the request's `speculative_tokens`.
"""

from __future__ import annotations

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
            self.k = min(self.max_tokens, self.k + 2) if kept == guessed else kept + 1
        self.draft = []


def kept_prefix(draft: list[int], picked: list[int]) -> int:
    """How many guesses the step keeps: row j picked `picked[j]` having seen the first j guesses, so guess j stands
    while every row before it agreed."""
    kept = 0
    while kept < len(draft) and kept < len(picked) and picked[kept] == draft[kept]:
        kept += 1
    return kept
