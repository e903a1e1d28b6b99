"""One request as the gateway holds it, whatever front door it came in by, and what can be checked of it before any
tokenizing: sizes first, so a huge input costs nothing, then the engine's own sampling rules.

A request that fails ends with a `RequestError`: a row of the failure table (`pdserve.failures`), a message for the
caller, and the parameter at fault if any. The front doors only translate it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from pdserve.engine.errors import InvalidParameter
from pdserve.failures import BY_LABEL, Failure
from pdserve.protos import common_pb2
from pdserve.wire import sampling_from_proto

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID = 128
MAX_MESSAGES = 4096  # a chat longer than this is refused before its template is rendered


class RequestError(Exception):
    """Why a request failed: its failure row, a message for the caller, and the parameter at fault if any."""

    def __init__(self, failure: Failure | str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.failure = BY_LABEL[failure] if isinstance(failure, str) else failure
        self.message, self.param = message, param

    @property
    def code(self) -> grpc.StatusCode:
        return self.failure.code


def invalid(param: str | None, message: str) -> RequestError:
    return RequestError("invalid_argument", message, param)


@dataclass
class DecodeAffinity:
    """Shared by the choices of one prompt (`choices.py`): the decode worker the first of them was routed to, where
    the others go while it is up. It holds their prompt's KV in its prefix cache from the first one's first token,
    so the others are sent (or compute) only the prompt's last, partial block."""

    decode: str = ""


@dataclass
class GenerationRequest:
    """Exactly one of `prompt`, `messages`, `token_ids`. `sampling` is what the workers get (no stop strings);
    `stop` strings are applied here."""

    request_id: str
    sampling: common_pb2.SamplingParams
    prompt: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    model: str = ""
    deadline: float | None = None  # time.monotonic() by which the request must end
    constraint_param: str = "constraint"  # the caller's name for `sampling.constraint` (OpenAI: response_format...)
    template_tools: list[dict] | None = None  # the tools the chat template renders (OpenAI's tool objects)
    affinity: DecodeAffinity | None = None  # several choices of one prompt: where they meet


@dataclass
class Delta:
    """What one streamed message carries; the last one has `finish_reason` and `usage`."""

    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob]
    finish_reason: str | None = None
    usage: common_pb2.Usage | None = None

    @staticmethod
    def joined(deltas: list[Delta]) -> Delta:
        """Consecutive deltas of one stream as one: their text, tokens and logprobs; the last one's ending."""
        last = deltas[-1]
        return Delta(
            "".join(d.text for d in deltas),
            [t for d in deltas for t in d.token_ids],
            [lp for d in deltas for lp in d.logprobs],
            last.finish_reason,
            last.usage,
        )


def check(req: GenerationRequest, model_name: str, max_prompt_bytes: int) -> None:
    """What can be checked without tokenizing."""
    if req.model and req.model != model_name:
        raise RequestError(
            "model_not_found", f"model {req.model!r} does not exist; this gateway serves {model_name!r}", "model"
        )
    if len(req.request_id) > MAX_REQUEST_ID:
        raise invalid("request_id", f"request_id is {len(req.request_id)} characters; at most {MAX_REQUEST_ID}")
    size = _prompt_bytes(req)
    if size > max_prompt_bytes:
        raise invalid(
            "prompt" if req.messages is None else "messages",
            f"the prompt is {size} bytes; this gateway takes at most {max_prompt_bytes}",
        )
    if len(req.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LENGTH for s in req.stop):
        raise invalid(
            "stop", f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} characters"
        )
    try:  # the engine's own rules, here before any work is done (the workers, which know the model, recheck)
        params = sampling_from_proto(req.sampling).validate()
        if params.constraint is not None:
            params.constraint.check(req.constraint_param)
    except InvalidParameter as e:
        raise invalid(e.param, str(e)) from None


def _prompt_bytes(req: GenerationRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt.encode())
    if req.messages is not None:
        if not req.messages:
            raise invalid("messages", "messages is empty: a chat needs at least one message")
        if len(req.messages) > MAX_MESSAGES:
            raise invalid("messages", f"messages has {len(req.messages)} entries; at most {MAX_MESSAGES}")
        # every message costs its role and the template's framing, not only its content
        return sum(len(str(m.get("content", "")).encode()) + len(str(m.get("role", ""))) + 16 for m in req.messages)
    return 4 * len(req.token_ids or [])
