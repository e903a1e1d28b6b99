"""Grammar-constrained decoding: what a request's constraint means, and each constrained sequence's grammar state.

The library is llguidance (its Rust matcher; no torch, so the gateway checks a constraint with the same code the
workers run). Per token it fills a bitmask of the vocabulary the grammar allows next; the sampler turns it into
-inf logits where logit_bias is applied. Measured on this project's 2-core Zen 4, SmolLM2's 49,152 tokens, a
nested JSON schema (benchmarks/grammar_mask.py): 8-12 us per mask at p50 against xgrammar's 1-2 us, both under
0.2% of a 10 ms decode step; llguidance was picked because it needs nothing else (xgrammar needs torch and
triton, which the gateway must not load) and validates a grammar without a tokenizer.

A grammar state is a function of the tokens a sequence has generated, so it moves by replay: the prefill worker
samples the first token under the mask, the decode worker replays that token into a fresh state, and a migrated
stream replays every token it carries. Compiling a grammar (0.5-10 ms for common schemas, far more for extreme
ones) happens once per distinct constraint, off the model thread (`EngineLoop.constrain`).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np

from pdserve.engine.errors import InvalidParameter

KINDS = ("json_schema", "regex", "lark")

MAX_SPEC_CHARS = 1 << 20


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` is "json_schema" (`spec` a JSON Schema's text; `{"type": "object"}` is
    JSON mode), "regex" or "lark" (a Lark grammar in llguidance's dialect). `strict`: a schema keyword that cannot
    be enforced is an error; otherwise it is ignored (what the answer must still satisfy is everything else)."""

    kind: str
    spec: str
    strict: bool = False

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint; InvalidParameter naming `constraint` if it is not one."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.spec)
        if self.kind != "json_schema":
            raise InvalidParameter(
                "constraint", f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        try:
            schema = json.loads(self.spec)
        except ValueError as e:
            raise InvalidParameter("constraint", f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, bool):  # true: anything; false: nothing
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise InvalidParameter("constraint", "a JSON schema must be an object (or true/false)")
        try:
            # the separators of Python's json.dumps and no free whitespace between tokens: a small model offered
            # "any whitespace" can spend its whole budget on newlines, and the answer reads the same either way
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema,
                overrides={
                    "whitespace_flexible": False,
                    "item_separator": ", ",
                    "key_separator": ": ",
                    "lenient": not self.strict,
                },
            )
        except (ValueError, TypeError) as e:
            raise InvalidParameter("constraint", f"the JSON schema cannot be compiled: {e}") from None

    def check(self, param: str = "constraint") -> None:
        """InvalidParameter naming `param` unless the constraint compiles (no tokenizer needed: the gateway's
        check, which a request passes more than once and many requests share, so the verdict is remembered)."""
        error = _compile_error(self)
        if error is not None:
            raise InvalidParameter(param, f"{param}: {error}")


@functools.lru_cache(maxsize=64)  # as many as the workers keep compiled (`Grammars`)
def _compile_error(constraint: Constraint) -> str | None:
    """Why `constraint` does not compile, or None: one compile per distinct constraint."""
    try:
        grammar = constraint.grammar()
    except InvalidParameter as e:
        return str(e)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return _one_line(error) if error and not error.startswith("WARNING") else None


def _one_line(text: str) -> str:
    """llguidance's multi-line error (with its caret lines) as one line for an API error message."""
    lines = [line.strip() for line in text.splitlines() if line.strip().strip("^")]
    return "; ".join(lines)[:500]


class GrammarState:
    """One sequence's position in its grammar: the mask of what may come next, and the tokens it has taken."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._matcher = matcher
        self._words = words

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask (bit t of word t // 32 set: token t may come next) into `row`, an int32
        array of `words` words."""
        assert row.dtype == np.int32 and row.shape == (self._words,) and row.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar takes `token_id` next (about a microsecond: no mask is computed)."""
        return bool(self._matcher.validate_tokens([token_id]) == 1)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, taken in order from here, the grammar allows (the state does not move)."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def fork(self, tokens: Sequence[int]) -> GrammarState:
        """A copy of this state that has taken `tokens` (which the grammar allows: see `valid_prefix`)."""
        copy = GrammarState(self._matcher.deep_copy(), self._words)
        for token in tokens:
            copy.accept(token)
        return copy

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and the state is spent) if the grammar does not allow it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only the end of the sequence)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


def constraint_attributes(constraint: Constraint | None) -> dict[str, str]:
    """A constrained request's span attribute: the kind of its constraint (json_schema, regex, lark)."""
    return {"pdserve.constraint": constraint.kind} if constraint is not None else {}


class Grammars:
    """Compiles constraints against one tokenizer and keeps the last `capacity` compiled: a request with a
    schema seen before starts from a copy of its compiled matcher. Thread-safe (compiles run off the event loop)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int], capacity: int = 64) -> None:
        self.words = (vocab_size + 31) // 32
        self._tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.compiles = 0  # constraints compiled (cache misses that compiled, failures included)
        self.hits = 0  # requests that started from a compiled constraint in the cache
        self.compile_seconds = 0.0

    def state(self, constraint: Constraint, generated: Sequence[int] = ()) -> GrammarState:
        """A fresh state for `constraint` that has taken the `generated` tokens (a sequence computed elsewhere, or
        moved here); InvalidParameter if the grammar does not compile or the tokens break it."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                self.hits += 1
        if compiled is None:
            t0 = time.perf_counter()
            compiled = llguidance.LLMatcher(self._tokenizer, constraint.grammar(), log_level=0)
            with self._lock:
                self.compiles += 1
                self.compile_seconds += time.perf_counter() - t0
                if not compiled.is_error():
                    self._compiled[constraint] = compiled
                    while len(self._compiled) > self._capacity:
                        self._compiled.popitem(last=False)
            if compiled.is_error():
                raise InvalidParameter("constraint", f"constraint: {_one_line(compiled.get_error())}")
        state = GrammarState(compiled.deep_copy(), self.words)
        for n, token in enumerate(generated):
            if not state.accept(token):
                raise InvalidParameter(
                    "constraint", f"generated token {n} ({token}) breaks the constraint: {_one_line(state.error)}"
                )
        return state


def allowed_tokens(grammars: Sequence[GrammarState], vocab: int) -> np.ndarray:
    """Bool `[R, vocab]`: the tokens each grammar allows next."""
    bits = np.empty((len(grammars), (vocab + 31) // 32), dtype=np.int32)
    for row, grammar in enumerate(grammars):
        grammar.fill(bits[row])
    return unpack_masks(bits, vocab)


def unpack_masks(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bitmask rows `[R, words]` int32 -> bool `[R, vocab_size]`, True where a token is allowed."""
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)
