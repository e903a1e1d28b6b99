"""One request's state inside an engine: its tokens, its blocks, and how far its KV has been computed."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.grammar import GrammarState
    from pdserve.engine.speculation import Speculation

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # its KV is to be computed here
    RESERVING = "reserving"  # its KV comes from another process: queued for the blocks to receive it
    AWAITING_KV = "awaiting_kv"  # blocks reserved; another process is writing its KV into them
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: two requests with equal tokens are still two sequences
class Sequence:
    request_id: str  # the caller's name for it, for logs; never a key (callers may reuse ids)
    token_ids: list[int]  # prompt followed by every sampled token
    params: SamplingParams
    num_prompt_tokens: int = -1
    prefill_only: bool = False  # a prefill worker's job: done after one token, blocks kept until its KV is sent
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, taken from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    grammar: GrammarState | None = None  # where its constraint stands; it has taken every output token
    speculation: Speculation | None = None  # its guessed next tokens, when it speculates

    @property
    def draft(self) -> list[int]:
        """The guessed tokens the next (or in-flight) step checks after its last token; empty when none."""
        return self.speculation.draft if self.speculation is not None else []

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        """Add a sampled token (its grammar, if any, has taken it already) and decide whether the sequence is
        done: a complete grammar ends it as a stop, since nothing but the end may follow."""
        self.token_ids.append(token_id)
        n = self.num_output_tokens
        if n >= self.params.min_tokens and (
            (not self.params.ignore_eos and token_id in eos_token_ids) or token_id in self.params.stop_token_ids
        ):
            self.finish_reason = "stop"
        elif self.grammar is not None and self.grammar.done:
            self.finish_reason = "stop"
        elif n >= self.params.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = "length"
