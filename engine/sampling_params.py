"""Per-request sampling parameters, validated with messages that name the parameter, and what one draw returns
(plain data, no torch: the gateway checks parameters by these rules and the wire carries samples)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.errors import InvalidParameter
from pdserve.engine.grammar import KINDS, MAX_SPEC_CHARS, Constraint
from pdserve.engine.speculation import MAX_SPECULATIVE_TOKENS


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; n: the sampled token's plus the top n
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    constraint: Constraint | None = None  # what the output must match (JSON schema, regex, grammar)
    speculative_tokens: int | None = None  # tokens guessed and checked per step at most; 0 off; None: the worker's

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 1024  # entries

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 decode greedily (vLLM's rule): dividing by them overflows the logits."""
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ValueError naming the first bad parameter; returns self so calls chain."""

        def bad(name: str, rule: str) -> None:
            raise InvalidParameter(name, f"{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature < float("inf"):
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad("seed", "must be a non-negative 64-bit integer")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        if self.speculative_tokens is not None and not (
            isinstance(self.speculative_tokens, int) and 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            bad("speculative_tokens", f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}]")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise InvalidParameter("logit_bias", f"logit_bias takes at most {self.MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise InvalidParameter("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r}")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise InvalidParameter(
                    "logit_bias", f"logit_bias keys must be token ids in [0, {vocab_size}), got {token}"
                )
        if self.constraint is not None:
            if self.constraint.kind not in KINDS:
                raise InvalidParameter(
                    "constraint", f"constraint kind must be one of {', '.join(KINDS)}, got {self.constraint.kind!r}"
                )
            if len(self.constraint.spec) > MAX_SPEC_CHARS:
                raise InvalidParameter("constraint", f"constraint is longer than {MAX_SPEC_CHARS} characters")
        return self


@dataclass
class SampleOutput:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
